"""One MLA layer of rank 0 (TP8, loopback) three ways: M1c, M1b and the mono
launch as separate launches, M1b folded into the mono launch, and M1c and M1b
folded in (bench_mla.bench_mla_fused: the MLA rows of `k3mono bench --mla`
without its M1c split sweep and M1b fold rows, so a call can time them in
two trees).

    PYTHONPATH=. python benchmarks/mla_layers.py [--tokens 1 4 16] [--contexts 32768] [--kv fp8]
        [--set ctas_per_sm=2 ...]

``--set``: the three ways' mono launches with these fields of the defaults
(mono.default_options_with: TileChoice fields or mono.OPTION_FIELDS).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from k3mono.bench import BENCH_LAYER
    from k3mono.bench_mla import bench_mla_fused
    from k3mono.config import preset
    from k3mono.mono import parse_option_fields
    from k3mono.synthetic import random_shard
    from k3mono.timing import copy_bandwidth

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768])
    parser.add_argument("--kv", nargs="+", default=["fp8"], choices=["fp8", "bf16"])
    parser.add_argument("--set", nargs="*", default=[], help="NAME=VALUE: fields of the defaults")
    args = parser.parse_args()
    fields = parse_option_fields(args.set)
    device = torch.device("cuda")
    cfg = preset("kimi-k3")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s {' '.join(args.set)}", flush=True)
    bench_mla_fused(cfg, random_shard(cfg, 8, seed=0, device=device), bandwidth, BENCH_LAYER, args.tokens,
                    args.contexts, args.kv, fields)


if __name__ == "__main__":
    main()
