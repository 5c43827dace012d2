"""Hardware counters of the staged stages and the mono launch, one rank of TP8
(loopback), for Nsight Compute: where a kernel's warps stall and how far it is
from its memory and issue ceilings, which timing differences cannot say.

    ncu --clock-control none --profile-from-start off --section WarpStateStats ... \
        python3 benchmarks/profile_stages.py [--tokens 1] [--mono]

Every kernel runs once unprofiled (compile, warm), then once between
cudaProfilerStart and Stop, so ncu sees one launch of each. Without ncu the
script just runs (a quick check that it still builds).
"""

from __future__ import annotations

import argparse

import torch

from k3mono.bench import _loopback_layers, _rank0_stages, mono_runners
from k3mono.config import preset
from k3mono.synthetic import random_shard


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--mono", action="store_true", help="also the mono launch (after the staged stages)")
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    shards = [random_shard(cfg, args.tp, seed=0, device=torch.device("cuda"))]
    layer = _loopback_layers(cfg, args.tp, args.tokens, shards)[0]
    stages = _rank0_stages(layer)
    runner = mono_runners(cfg, args.tp, args.tokens, shards)[0] if args.mono else None

    def run_all() -> None:
        for _, stage in stages:
            stage()
        if runner is not None:
            runner.launch(0)
        torch.cuda.synchronize()

    run_all()  # compile and warm, unprofiled
    torch.cuda.profiler.start()
    run_all()
    torch.cuda.profiler.stop()
    if runner is not None:
        runner.check_health()
    print("profiled:", ", ".join(name for name, _ in stages) + (", mono" if runner else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
