"""M1b alone at several split counts, and M1b folded into the mono launch (one
rank of TP8, loopback) against the plain launch: the short device check of an
M1b change (``bench --mla`` runs the same rows among many more).

    python benchmarks/m1b_timing.py [--tokens 1 16] [--splits 16 132 264] [--fold-tokens 1] [--short-tiles 128x3 128x5]

``--short-tiles CHUNKxSTAGES``: M1b alone also at these short-combine tiles
(latent columns a step, steps in flight; mla.BACK_TILE's otherwise), for split
counts up to mla.BACK_TILE's short_splits.
"""

from __future__ import annotations

import argparse

import torch

CONTEXT = 1024
"""Positions of each request's cache: M1b reads o, lse and w_v, none of which grows
with the context, so a short one keeps the M1c runs that make o and lse quick."""


def main() -> None:
    from k3mono.bench import BENCH_LAYER, WEIGHT_SETS
    from k3mono.bench_mla import attn_call, back_call, bench_m1b_fold, rotation
    from k3mono.config import preset
    from k3mono.mla import BACK_TILE
    from k3mono.synthetic import random_shard
    from k3mono.timing import time_graph

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--splits", type=int, nargs="+", default=[16, 132, 264])
    parser.add_argument("--fold-tokens", type=int, nargs="*", default=[1])
    parser.add_argument("--short-tiles", nargs="*", default=[], help="CHUNKxSTAGES, e.g. 128x5 256x3")
    args = parser.parse_args()
    device = torch.device("cuda")
    short_tiles = [tuple(int(v) for v in text.split("x")) for text in args.short_tiles]
    for tokens in args.tokens:
        sets = rotation(tokens, CONTEXT, "bf16", device)
        for splits in args.splits:
            partials = []
            for inputs in sets:
                attend, o, lse = attn_call(inputs, splits)
                attend()
                partials.append((inputs, o, lse))
            tiles = [("", BACK_TILE)]
            if splits <= BACK_TILE["short_splits"]:
                tiles += [(f" chunk {c} stages {st}", dict(BACK_TILE, chunk=c, stages=st)) for c, st in short_tiles]
            for name, tile in tiles:
                backs = [back_call(inputs, o, lse, tile=tile)[0] for inputs, o, lse in partials]
                print(f"M1b alone S={tokens:>2} {splits:>3} splits{name}: {1e6 * time_graph(backs):7.1f} us",
                      flush=True)
        del sets
        torch.cuda.empty_cache()
    if args.fold_tokens:
        cfg = preset("kimi-k3")
        weight_sets = [random_shard(cfg, 8, seed=s, device=device) for s in range(WEIGHT_SETS)]
        bench_m1b_fold(cfg, weight_sets, args.fold_tokens, BENCH_LAYER)


if __name__ == "__main__":
    main()
