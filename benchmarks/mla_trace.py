"""Where an MLA layer's folded launch spends its time, one rank of TP8
(loopback): the trace (k3mono/trace.py) of the launch with M1b folded in
and of the one with M1c and M1b folded in (bench_mla.mla_fused_calls, M1c
at bench_mla.fused_splits), per task kind and over time; beside it each
way's CUDA-graph time, the separate launches' too.

    PYTHONPATH=. python benchmarks/mla_trace.py [--tokens 1 16] [--context 32768] [--kv fp8] [--ways m1b m1c]
        [--bucket-us 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch

WARM_LAUNCHES = 3


def traced(call, rank) -> tuple[float, list, list]:
    """(launch span us, per-kind spans, ticket rows) of ``call``'s last launch, after WARM_LAUNCHES."""
    from k3mono.trace import summarize, ticket_rows

    for _ in range(WARM_LAUNCHES + 1):
        call()
    torch.cuda.synchronize()
    span, spans = summarize(rank.trace, rank.compiled.table)
    return span, spans, ticket_rows(rank.trace, rank.compiled.table)


def main() -> None:
    from k3mono.bench import BENCH_LAYER
    from k3mono.bench_mla import fused_splits, mla_fused_calls
    from k3mono.config import preset
    from k3mono.mono import device_sms
    from k3mono.synthetic import random_shard
    from k3mono.timing import time_graph
    from k3mono.trace import TICKET_FIELDS, format_summary, format_timeline, timeline

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--kv", default="fp8", choices=["fp8", "bf16"])
    parser.add_argument("--ways", nargs="+", default=["m1b", "m1c"], choices=["m1b", "m1c"])
    parser.add_argument("--bucket-us", type=float, default=10.0, help="the timeline's bucket width (0: none)")
    parser.add_argument("--out", default=None, help="directory for mla-trace-<kv>-<context>-S<tokens>-<way>.json")
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    shard = random_shard(cfg, 8, seed=0, device="cuda")
    for tokens in args.tokens:
        splits = fused_splits(tokens, device_sms(shard.o_proj.device))
        calls = mla_fused_calls(cfg, shard.tp, tokens, args.context, args.kv, shard, BENCH_LAYER, splits, trace=True)
        times = {name: 1e6 * time_graph([calls[name]]) for name in ("separate", "m1b", "m1c")}
        print(f"{args.kv} ctx {args.context} S={tokens} {splits} splits, CUDA-graph us (the folded ways traced): "
              + ", ".join(f"{name} {us:.1f}" for name, us in times.items()), flush=True)
        runners = dict(zip(("separate", "m1b", "m1c"), calls["runners"]))
        for way in args.ways:
            rank = runners[way].rank_states[0]
            span, spans, tickets = traced(calls[way], rank)
            runners[way].check_health()
            shown = [format_timeline(timeline(tickets, args.bucket_us))] if args.bucket_us else []
            print(f"-- {way} folded, S={tokens}:", format_summary(span, spans), *shown, sep="\n", flush=True)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                record = dict(kv=args.kv, context=args.context, tokens=tokens, splits=splits, way=way,
                              times_us=times, launch_span_us=span, kinds=[dataclasses.asdict(s) for s in spans],
                              tickets_fields=list(TICKET_FIELDS), tickets=tickets)
                name = f"mla-trace-{args.kv}-{args.context}-S{tokens}-{way}.json"
                with open(os.path.join(args.out, name), "w") as f:
                    json.dump(record, f, indent=1)
        del calls, runners
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
