"""GPU correctness at the released dims: the staged path (T = 1, and T = 8 with
all eight ranks' shards on the one GPU) against the float64 oracle, on fresh
random inputs, outputs poisoned before each run, routes compared exactly with
the bf16 reference, every rank's copy compared bit for bit.

    python benchmarks/gpu_check.py [--tp 1 8] [--tokens 1 4 16]

Prints one line per case and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from k3mono.config import preset
from k3mono.runner import Oracle
from k3mono.staged import StagedLayer
from k3mono.synthetic import random_inputs, random_shard
from k3mono.weights import shard_all

LAYER = 25


def same_on_every_rank(results) -> bool:
    first = results[0]
    return all(
        torch.equal(r.moe_out.view(torch.int16), first.moe_out.view(torch.int16))
        and torch.equal(r.prefix.view(torch.int16), first.prefix.view(torch.int16))
        and torch.equal(r.route_ids, first.route_ids)
        for r in results[1:]
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    device = torch.device("cuda")
    full = random_shard(cfg, 1, seed=7, device=device)
    failures = 0
    for tp in args.tp:
        shards = shard_all(full, cfg, tp) if tp > 1 else [full]
        for tokens in args.tokens:
            started = time.time()
            staged = StagedLayer(cfg, shards, tokens, LAYER)
            inputs = {k: v.to(device) for k, v in random_inputs(cfg, tokens, LAYER, seed=31 * tp + tokens).items()}
            oracle = Oracle(cfg, full, inputs, LAYER)
            result = staged(**inputs)
            verdict = oracle.judge({k: v for k, v in result.outputs().items()})
            agree = same_on_every_rank(staged.rank_results())
            ok = verdict.ok and agree and not torch.isnan(result.moe_out.float()).any()
            failures += not ok
            print(
                f"staged T={tp} S={tokens:>2}: moe err {verdict.moe_err:.2e} (budget {verdict.moe_budget:.2e}) "
                f"prefix err {verdict.prefix_err:.2e} (budget {verdict.prefix_budget:.2e}) "
                f"routes {'identical' if verdict.routes_identical else 'DIFFER'} ranks {'agree' if agree else 'DIFFER'} "
                f"{'ok' if ok else 'FAIL'} ({time.time() - started:.0f} s)",
                flush=True,
            )
            del staged
        del shards
        torch.cuda.empty_cache()
    print("gpu_check: all ok" if not failures else f"gpu_check: {failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
