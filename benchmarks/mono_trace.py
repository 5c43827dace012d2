"""Where the mono launch's time goes, one rank of TP8 (loopback): every
ticket's SM and timer readings from a trace build (k3mono/trace.py), per
task kind, for each token count; beside it the traced and the plain build's
CUDA-graph time (what recording costs).

    python benchmarks/mono_trace.py [--tokens 1 8] [--poll-sleep-ns 0 200] [--out DIR]

The traced launch runs after launches on the other rotated weight sets, as
a replay would (its weights are not in L2), and is read eagerly.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os

import torch

from k3mono.bench import WEIGHT_SETS, mono_runners, time_mono
from k3mono.config import preset
from k3mono.mono import default_options
from k3mono.synthetic import random_shard
from k3mono.timing import time_graph
from k3mono.trace import format_summary, summarize

WARM_LAUNCHES = 3


def traced_launch(runners) -> tuple[float, list]:
    """Launch every set's runner WARM_LAUNCHES times, then the others once more
    and the first one last; its trace, summarized."""
    for _ in range(WARM_LAUNCHES):
        for runner in runners:
            runner.launch(0)
    for runner in runners[1:] + runners[:1]:
        runner.launch(0)
    torch.cuda.synchronize()
    for runner in runners:
        runner.check_health()
    rank = runners[0].rank_states[0]
    return summarize(rank.trace, rank.compiled.table)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--poll-sleep-ns", type=int, nargs="+", default=[0], help="MonoOptions.poll_sleep_ns")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--out", default=None, help="directory for mono-trace-S<tokens>-sleep<ns>.json")
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    sets = [random_shard(cfg, args.tp, seed=s, device="cuda") for s in range(WEIGHT_SETS)]
    for tokens, sleep_ns in itertools.product(args.tokens, args.poll_sleep_ns):
        options = default_options(poll_sleep_ns=sleep_ns)
        runners = mono_runners(cfg, args.tp, tokens, sets, trace=True, options=options)
        launch_us, spans = traced_launch(runners)
        traced = time_graph([lambda runner=runner: runner.launch(0) for runner in runners])
        del runners
        torch.cuda.empty_cache()
        plain = time_mono(cfg, args.tp, tokens, sets, options=options)
        print(f"T={args.tp} S={tokens} poll sleep {sleep_ns} ns: traced launch {traced * 1e6:.1f} us, plain "
              f"{plain * 1e6:.1f} us (CUDA-graph replay)\n{format_summary(launch_us, spans)}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            record = dict(tp=args.tp, tokens=tokens, poll_sleep_ns=sleep_ns, traced_us=traced * 1e6,
                          plain_us=plain * 1e6, launch_span_us=launch_us, kinds=[dataclasses.asdict(s) for s in spans])
            with open(os.path.join(args.out, f"mono-trace-S{tokens}-sleep{sleep_ns}.json"), "w") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
