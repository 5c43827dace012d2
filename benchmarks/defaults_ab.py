"""The mono launch at its defaults (mono.default_options) against one field
of TileChoice or MonoOptions set to other values, one rank of TP8 (loopback),
CUDA-graph replay, the values alternating over several rounds in one process,
so every number of a comparison comes from the same machine and the same minutes.

    python benchmarks/defaults_ab.py --field x_token_groups --values 0 1 --tokens 8 16 [--rounds 2] [--tp 8]
    python benchmarks/defaults_ab.py --field final_split --values 0 1 --tokens 1 8 [--also shared_late=0]

``--also NAME=VALUE`` sets more fields, the same for every value of ``--field``;
``--field a,b`` sets fields a and b together to each value.
``--m1b``: every value's launch has M1b folded in (bench_mla.fold_shape), and each
round also times the plain launch at the defaults (the fold's cost is the difference).

A bool field takes 0 / 1. Prints a line a run and a table last (us, a column a value).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from k3mono.bench import BENCH_LAYER, WEIGHT_SETS, time_mono
from k3mono.bench_mla import fold_shape, time_mono_m1b
from k3mono.config import preset
from k3mono.mono import default_options_with, parse_option_fields
from k3mono.synthetic import random_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--field", required=True,
                        help="a TileChoice field or one of mono.OPTION_FIELDS (several, comma-separated: set together)")
    parser.add_argument("--values", type=int, nargs="+", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--also", nargs="*", default=[], help="NAME=VALUE: more fields, fixed")
    parser.add_argument("--m1b", action="store_true", help="M1b folded in; the plain launch timed beside")
    args = parser.parse_args()
    also = parse_option_fields(args.also)
    # every choice checked before the GPU is touched
    fields = args.field.split(",")
    options = {(tokens, value): default_options_with(tokens, {**also, **dict.fromkeys(fields, value)})
               for tokens in args.tokens for value in args.values}
    cfg = preset("kimi-k3")
    sets = [random_shard(cfg, args.tp, seed=s, device="cuda") for s in range(WEIGHT_SETS)]
    # (column, value): with --m1b the plain launch at the defaults first
    runs = ([("plain", None)] if args.m1b else []) + [(f"{args.field} = {v}", v) for v in args.values]
    columns = [column for column, _ in runs]
    times: dict = {}
    for round_ in range(args.rounds):
        for tokens in args.tokens:
            for column, value in runs:
                if value is None:
                    seconds = time_mono(cfg, args.tp, tokens, sets)
                elif args.m1b:
                    seconds = time_mono_m1b(cfg, args.tp, tokens, sets, BENCH_LAYER,
                                            options=dataclasses.replace(options[(tokens, value)], m1b=fold_shape()))
                else:
                    seconds = time_mono(cfg, args.tp, tokens, sets, options=options[(tokens, value)])
                times.setdefault((tokens, column), []).append(seconds * 1e6)
                print(f"round {round_} T={args.tp} S={tokens:>2} {column}: {seconds * 1e6:8.1f} us", flush=True)
                torch.cuda.empty_cache()
    folded = " (M1b folded in: every column but plain)" if args.m1b else ""
    print(f"\n{' '.join(args.also)}{folded}\n| S | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for tokens in args.tokens:
        cells = [", ".join(f"{t:.1f}" for t in times[(tokens, column)]) for column in columns]
        print(f"| {tokens} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
