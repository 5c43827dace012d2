"""How fast the dense GEMV tile reads weights that sit in L2, against the same
weights from HBM: the staged o_proj kernel (one rank of TP8, S = 1) at several
task rows and K steps, replayed on one weight set (22 MB: L2-resident after the
first replay) and rotated over four (88 MB: each replay reads HBM), with the
copy bandwidth of the same bytes beside it. The mono launch's o_proj tasks
read w_o that prefetch_oproj asked into L2 at 2.2 TB/s (docs/PERF.md), about
their rate from HBM; this tells whether the tile or the prefetch is to blame.

    python benchmarks/l2_reads.py [--rows 8 32] [--step-kb 8 16 32]
"""

from __future__ import annotations

import argparse

import torch

from k3mono.config import preset
from k3mono.kernels.oproj import launch_oproj
from k3mono.planner import TileChoice, stage_geometry
from k3mono.timing import time_graph

TP = 8
ROTATED_SETS = 4  # 4 x 22 MB: more than the 50 MB of L2, so a rotated replay reads HBM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--step-kb", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    hidden, core_width = cfg.hidden_size, cfg.core_width // TP
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(hidden, core_width, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
               for _ in range(ROTATED_SETS)]
    core = torch.randn(1, core_width, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty(1, hidden, device="cuda", dtype=torch.float32)
    nbytes = weights[0].numel() * weights[0].element_size()
    copies = [torch.empty_like(w) for w in weights]
    copy_s = time_graph([lambda w=w, c=c: c.copy_(w) for w, c in zip(weights, copies)])
    copy_tbs = 2 * nbytes / copy_s / 1e12
    print(f"w_o of one rank: {nbytes / 1e6:.1f} MB; copy {copy_s * 1e6:.1f} us a set ({copy_tbs:.2f} TB/s read + write)")
    print("| rows | step KB | one set (L2) us | TB/s | rotated (HBM) us | TB/s |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        for step_kb in args.step_kb:
            geom = stage_geometry(cfg, TP, 1, tiles=TileChoice(oproj_rows=rows, oproj_step_kb=step_kb))
            calls = [lambda w=w: launch_oproj(core, w, out, geom) for w in weights]
            warm = time_graph(calls[:1])
            cold = time_graph(calls)
            print(f"| {rows} | {step_kb} | {warm * 1e6:.1f} | {nbytes / warm / 1e12:.2f} | {cold * 1e6:.1f} | "
                  f"{nbytes / cold / 1e12:.2f} |", flush=True)


if __name__ == "__main__":
    main()
