"""Where the mono launch's time goes, one rank of TP8 (loopback): every
ticket's SM and timer readings from a trace build (k3mono/trace.py), per
task kind, for each token count; beside it the traced and the plain build's
CUDA-graph time (what recording costs).

    python benchmarks/mono_trace.py [--tokens 1 8] [--poll-sleep-ns 0 200] [--double ROUTE ...] [--m1b]
                                    [--m1b-rows 16 32 64] [--prefetch 0 1] [--bucket-us 15] [--out DIR]
                                    [--set final_split=1 prefetch_shared=1 ...]
    python benchmarks/mono_trace.py --from-json results/mono-trace-S16-sleep0.json [--bucket-us 15]

The traced launch runs after launches on the other rotated weight sets, as
a replay would (its weights are not in L2), and is read eagerly. ``--double``
traces, for each kind named, the timing variant that runs each of its tasks
twice in a row on one CTA (planner.timing_variant): the copy's run time
beside the first's tells what a task pays for being the first of its kind
(code and data not yet cached on its SM). ``--m1b`` traces an MLA layer's
launch with M1b folded in (bench_mla.fold_shape) instead of the plain one,
at each ``--m1b-rows`` (TileChoice.m1b_rows); ``--prefetch`` the launch at
each of MonoRunner's prefetch modes; ``--set`` fields of the defaults
(mono.default_options_with: TileChoice fields or mono.OPTION_FIELDS).
``--bucket-us`` adds the timeline (k3mono.trace.timeline: per bucket, the
CTAs running and waiting in each kind); ``--from-json`` prints the summary
and timeline of traces this script saved (``--out``), no GPU needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os

import torch

from k3mono.bench import BENCH_LAYER, WEIGHT_SETS, mono_runners, time_mono
from k3mono.bench_mla import fold_shape, m1b_runners, time_mono_m1b
from k3mono.config import preset
from k3mono.mono import DEFAULT_PREFETCH, default_options_with, parse_option_fields
from k3mono.planner import BACK_BLOCK_DV, TaskKind
from k3mono.synthetic import random_shard
from k3mono.timing import time_graph
from k3mono.trace import TICKET_FIELDS, KindSpan, format_summary, format_timeline, summarize, ticket_rows, timeline

WARM_LAUNCHES = 3


def traced_launch(ranks) -> tuple[float, list]:
    """Launch every set's rank WARM_LAUNCHES times, then the others once more
    and the first one last; its trace, summarized (the trace stays in
    ``ranks[0].trace``)."""
    for _ in range(WARM_LAUNCHES):
        for rank in ranks:
            rank.launch()
    for rank in ranks[1:] + ranks[:1]:
        rank.launch()
    torch.cuda.synchronize()
    for rank in ranks:
        rank.check_health()
    return summarize(ranks[0].trace, ranks[0].compiled.table)


def doubled_text(ranks, kind: str) -> str:
    """The variant running each ``kind`` task twice: its tasks' first and second runs (us)."""
    varied = [rank.timing_variant("double", TaskKind[kind]) for rank in ranks]
    traced_launch(varied)
    rows = varied[0].trace.cpu()
    tickets = [t.ticket for t in varied[0].compiled.table.tasks if t.kind == TaskKind[kind]]
    runs = [(rows[t, 3] - rows[t, 2]).item() / 1e3 for t in tickets]
    first, second = runs[0::2], runs[1::2]
    same_sm = sum(int(rows[a, 0] == rows[b, 0]) for a, b in zip(tickets[0::2], tickets[1::2]))
    return (f"{kind} doubled: first runs {sum(first) / len(first):.2f} us (max {max(first):.2f}), "
            f"second runs {sum(second) / len(second):.2f} us (max {max(second):.2f}), {len(first)} tasks, "
            f"{same_sm} copies on the first's SM")


def saved_text(path: str, bucket_us: float) -> str:
    """The summary and timeline of a trace saved by ``--out``."""
    with open(path) as f:
        record = json.load(f)
    spans = [KindSpan(**kind) for kind in record["kinds"]]
    head = f"{path}: T={record['tp']} S={record['tokens']}, plain {record['plain_us']:.1f} us"
    shown = (format_timeline(timeline(record["tickets"], bucket_us)) if "tickets" in record
             else "(saved without its tickets: no timeline)")
    return "\n".join([head, format_summary(record["launch_span_us"], spans), shown])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--poll-sleep-ns", type=int, nargs="+", default=[0], help="MonoOptions.poll_sleep_ns")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--double", nargs="*", default=[], help="task kinds (planner.TaskKind names) to run twice")
    parser.add_argument("--m1b", action="store_true", help="an MLA layer's launch, M1b folded in")
    parser.add_argument("--m1b-rows", type=int, nargs="+", default=[BACK_BLOCK_DV], help="TileChoice.m1b_rows")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[DEFAULT_PREFETCH], help="MonoRunner's prefetch")
    parser.add_argument("--out", default=None, help="directory for mono-trace-S<tokens>-sleep<ns>[-m1b].json")
    parser.add_argument("--bucket-us", type=float, default=15.0, help="the timeline's bucket width (0: none)")
    parser.add_argument("--from-json", nargs="+", default=[], help="saved traces to print instead of running")
    parser.add_argument("--set", nargs="*", default=[], help="NAME=VALUE: fields of the defaults")
    args = parser.parse_args()
    if args.from_json:
        print(*(saved_text(path, args.bucket_us or 15.0) for path in args.from_json), sep="\n\n")
        return
    given = parse_option_fields(args.set)
    cfg = preset("kimi-k3")
    sets = [random_shard(cfg, args.tp, seed=s, device="cuda") for s in range(WEIGHT_SETS)]
    m1b_rows = args.m1b_rows if args.m1b else [BACK_BLOCK_DV]
    if args.m1b:
        runners_of = functools.partial(m1b_runners, layer=BENCH_LAYER)
        time_of = functools.partial(time_mono_m1b, layer=BENCH_LAYER)
    else:
        runners_of, time_of = mono_runners, time_mono
    for tokens, sleep_ns, prefetch, rows in itertools.product(args.tokens, args.poll_sleep_ns, args.prefetch, m1b_rows):
        options = dataclasses.replace(
            default_options_with(tokens, {**given, "poll_sleep_ns": sleep_ns, "m1b_rows": rows}),
            m1b=fold_shape() if args.m1b else None)
        runners = runners_of(cfg, args.tp, tokens, sets, options=options, trace=True, prefetch=prefetch)
        ranks = [runner.rank_states[0] for runner in runners]
        launch_us, spans = traced_launch(ranks)
        tickets = ticket_rows(ranks[0].trace, ranks[0].compiled.table)
        traced = time_graph([lambda runner=runner: runner.launch(0) for runner in runners])
        doubled = [doubled_text(ranks, kind) for kind in args.double]
        del runners, ranks
        torch.cuda.empty_cache()
        plain = time_of(cfg, args.tp, tokens, sets, options=options, prefetch=prefetch)
        folded = f" M1b folded, {rows} value rows a task," if args.m1b else ""
        what = f"T={args.tp} S={tokens}{folded} prefetch {prefetch} poll sleep {sleep_ns} ns {' '.join(args.set)}"
        shown = [format_timeline(timeline(tickets, args.bucket_us))] if args.bucket_us else []
        print(f"{what}: traced launch {traced * 1e6:.1f} us, plain {plain * 1e6:.1f} us (CUDA-graph replay)\n"
              f"{format_summary(launch_us, spans)}", *doubled, *shown, sep="\n", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            record = dict(tp=args.tp, tokens=tokens, poll_sleep_ns=sleep_ns, m1b=args.m1b, m1b_rows=rows, given=given,
                          prefetch=prefetch, traced_us=traced * 1e6, plain_us=plain * 1e6, launch_span_us=launch_us,
                          kinds=[dataclasses.asdict(s) for s in spans],
                          tickets_fields=list(TICKET_FIELDS), tickets=tickets)
            name = f"mono-trace-S{tokens}-sleep{sleep_ns}{'-m1b' if args.m1b else ''}"
            if prefetch != DEFAULT_PREFETCH:
                name += f"-prefetch{prefetch}"
            if rows != BACK_BLOCK_DV:
                name += f"-rows{rows}"
            name += "".join(f"-{field}{value}" for field, value in given.items())
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
