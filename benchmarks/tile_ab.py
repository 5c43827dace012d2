"""The mono launch at its defaults (mono.default_options) against one
TileChoice field set to other values, one rank of TP8 (loopback), CUDA-graph
replay, the values alternating over several rounds in one process, so every
number of a comparison comes from the same machine and the same minutes.

    python benchmarks/tile_ab.py --field x_token_groups --values 0 1 --tokens 8 16 [--rounds 2] [--tp 8]

A bool field takes 0 / 1. Prints a line a run and a table last (us, a column a value).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from k3mono.bench import WEIGHT_SETS, time_mono
from k3mono.config import preset
from k3mono.mono import default_options, default_tiles
from k3mono.planner import TileChoice
from k3mono.synthetic import random_shard


def field_type(name: str) -> type:
    for field in dataclasses.fields(TileChoice):
        if field.name == name:
            return type(field.default)
    raise SystemExit(f"--field: TileChoice has no field {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--field", required=True, help="a TileChoice field")
    parser.add_argument("--values", type=int, nargs="+", required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    cast = field_type(args.field)
    cfg = preset("kimi-k3")
    sets = [random_shard(cfg, args.tp, seed=s, device="cuda") for s in range(WEIGHT_SETS)]
    times: dict = {}
    for round_ in range(args.rounds):
        for tokens in args.tokens:
            for value in args.values:
                tiles = default_tiles(tokens, **{args.field: cast(value)})
                seconds = time_mono(cfg, args.tp, tokens, sets, options=default_options(tokens, tiles=tiles))
                times.setdefault((tokens, value), []).append(seconds * 1e6)
                print(f"round {round_} T={args.tp} S={tokens:>2} {args.field}={value}: {seconds * 1e6:8.1f} us",
                      flush=True)
                torch.cuda.empty_cache()
    print(f"\n| S | " + " | ".join(f"{args.field} = {v}" for v in args.values) + " |")
    print("|---|" + "---|" * len(args.values))
    for tokens in args.tokens:
        cells = [", ".join(f"{t:.1f}" for t in times[(tokens, v)]) for v in args.values]
        print(f"| {tokens} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
