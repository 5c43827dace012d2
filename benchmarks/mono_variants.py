"""Where the mono launch's time goes: each task kind skipped and doubled.

    PYTHONPATH=. python3 benchmarks/mono_variants.py [--tokens 1 8] [--tp 8]

For every task kind of the table, rank 0's loopback launch (bench.time_mono's
setting: weights rotated over 4 sets, CUDA-graph replays) is timed on the
plain table and on two timing variants (planner.timing_variant) that share
its buffers: the kind's tasks skipped (they only raise their flags) and run
twice. ``cost`` = (double - skip) / 2 is what the kind's work adds to the
launch; ``plain - skip`` is what the launch saves without it (less than the
cost where the kind's work overlaps others'). Prints one table per S.
"""

from __future__ import annotations

import argparse

import torch

from k3mono.bench import WEIGHT_SETS, mono_runners
from k3mono.config import preset
from k3mono.planner import VARIANTS, TaskKind
from k3mono.synthetic import random_shard
from k3mono.timing import time_graph


def time_launches(ranks) -> float:
    return time_graph([lambda rank=rank: rank.launch() for rank in ranks])


def variant_table(cfg, tp: int, tokens: int, weight_sets: list) -> list[dict]:
    runners = mono_runners(cfg, tp, tokens, weight_sets)
    plain = [runner.rank_states[0] for runner in runners]
    plain_us = 1e6 * time_launches(plain)
    kinds = sorted({task.kind for task in runners[0].compiled.table.tasks})
    rows = []
    for kind in kinds:
        row = {"kind": TaskKind(kind).name, "plain_us": plain_us}
        for how in VARIANTS:
            for rank in plain:  # the variant reads what the plain launch wrote
                rank.launch()
            torch.cuda.synchronize()
            varied = [rank.timing_variant(how, kind) for rank in plain]
            row[f"{how}_us"] = 1e6 * time_launches(varied)
            for rank in varied:
                rank.check_health()
        row["cost_us"] = (row["double_us"] - row["skip_us"]) / 2
        rows.append(row)
        print(f"S={tokens:>2} {row['kind']:<15} skip {row['skip_us']:8.1f}  double {row['double_us']:8.1f}  "
              f"cost {row['cost_us']:7.1f}  saved {plain_us - row['skip_us']:7.1f} us (plain {plain_us:.1f})", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    device = torch.device("cuda")
    weight_sets = [random_shard(cfg, args.tp, seed=s, device=device) for s in range(WEIGHT_SETS)]
    for tokens in args.tokens:
        variant_table(cfg, args.tp, tokens, weight_sets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
