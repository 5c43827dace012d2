"""Where a mono launch's time goes, read off the launch itself.

A trace build (``MonoRunner(..., trace=True)``, compiled GPU builds only)
records for every ticket the SM that ran it and three readings of the GPU's
global nanosecond timer (kernels/mono.py ``_record_task``):

    taken  the CTA turned to the ticket (its row read)
    ready  every wait of the ticket was met (weights already requested where
           the task issues them first)
    done   the task's stores and raises were issued

``summarize`` folds those rows into one line per task kind, in table order:
when the kind's first task was taken, when its first one could start, when
its last one finished (us after the launch's first ticket), and per task the
mean time spent waiting and running. The waits of one kind are the latency
of the chain before it; a kind whose last ``done`` sets the next kind's
first ``ready`` is on the critical path.

``timeline`` cuts the launch into buckets of time and says, per kind, how
many CTAs ran its tasks and how many waited in them on average over each
bucket: where the grid idles behind a chain, and what shares it when.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NS_PER_US = 1e3


@dataclass(frozen=True)
class KindSpan:
    kind: str
    tasks: int
    sms: int  # distinct SMs that ran the kind's tasks
    first_taken_us: float
    first_ready_us: float
    last_done_us: float
    wait_us: float  # mean over its tasks of ready - taken
    run_us: float  # mean over its tasks of done - ready
    run_max_us: float


def _readings(trace: torch.Tensor, table) -> torch.Tensor:
    """The trace's rows on the CPU [tickets, 4] int64, checked complete."""
    rows = trace.detach().to("cpu", torch.int64)
    if rows.shape != (len(table.tasks), 4):
        raise ValueError(f"trace: expected shape ({len(table.tasks)}, 4), got {tuple(rows.shape)}")
    if bool((rows[:, 1] == 0).any()):
        raise ValueError("trace: some tickets were never recorded (the launch did not finish, or did not trace)")
    return rows


TICKET_FIELDS = ("kind", "sm", "taken_us", "ready_us", "done_us")
"""The fields of a ticket_rows row (the saved traces' ``tickets_fields``)."""


def ticket_rows(trace: torch.Tensor, table) -> list[list]:
    """Every ticket as [kind, SM, taken, ready, done] (TICKET_FIELDS; us after the
    launch's first ticket), in ticket order: which CTA held what, when."""
    rows = _readings(trace, table)
    origin = int(rows[:, 1].min())
    return [[task.kind.name, int(row[0])] + [round((int(t) - origin) / NS_PER_US, 3) for t in row[1:]]
            for task, row in zip(table.tasks, rows)]


def summarize(trace: torch.Tensor, table) -> tuple[float, list[KindSpan]]:
    """(launch span in us: last done - first taken, one KindSpan per task kind in table order)."""
    sm, taken, ready, done = _readings(trace, table).unbind(1)
    origin = int(taken.min())
    tickets_of: dict = {}
    for task in table.tasks:
        tickets_of.setdefault(task.kind, []).append(task.ticket)
    spans = []
    for kind, tickets in tickets_of.items():
        t = torch.tensor(tickets)
        waits, runs = (ready[t] - taken[t]).double(), (done[t] - ready[t]).double()
        spans.append(KindSpan(
            kind=kind.name, tasks=len(tickets), sms=int(torch.unique(sm[t]).numel()),
            first_taken_us=(int(taken[t].min()) - origin) / NS_PER_US,
            first_ready_us=(int(ready[t].min()) - origin) / NS_PER_US,
            last_done_us=(int(done[t].max()) - origin) / NS_PER_US,
            wait_us=float(waits.mean()) / NS_PER_US, run_us=float(runs.mean()) / NS_PER_US,
            run_max_us=float(runs.max()) / NS_PER_US,
        ))
    return (int(done.max()) - origin) / NS_PER_US, spans


def format_summary(launch_us: float, spans: list[KindSpan]) -> str:
    head = (f"{'kind':<13}{'tasks':>6}{'SMs':>5}{'first taken':>12}{'first ready':>12}{'last done':>10}"
            f"{'wait/task':>10}{'run/task':>9}{'run max':>8}   (us after the first ticket)")
    lines = [head]
    for s in spans:
        lines.append(f"{s.kind:<13}{s.tasks:>6}{s.sms:>5}{s.first_taken_us:>12.1f}{s.first_ready_us:>12.1f}"
                     f"{s.last_done_us:>10.1f}{s.wait_us:>10.2f}{s.run_us:>9.2f}{s.run_max_us:>8.2f}")
    lines.append(f"launch span {launch_us:.1f} us (first ticket taken to last task done)")
    return "\n".join(lines)


@dataclass(frozen=True)
class Bucket:
    start_us: float
    stop_us: float
    running: dict  # kind -> CTAs running its tasks, on average over the bucket
    waiting: dict  # kind -> CTAs taken into its tasks, not yet ready, on average


def _overlap(lo: float, hi: float, start: float, stop: float) -> float:
    return max(0.0, min(hi, stop) - max(lo, start))


def timeline(tickets: list[list], bucket_us: float) -> list[Bucket]:
    """Buckets of ``bucket_us`` from the first ticket to the last done, over
    ``ticket_rows``' rows: a ticket runs from ready to done, waits from taken to ready."""
    if not bucket_us > 0:
        raise ValueError(f"bucket_us: expected a positive width, got {bucket_us}")
    end = max(done for *_, done in tickets)
    buckets = []
    start = 0.0
    while start < end:
        stop = start + bucket_us
        running: dict = {}
        waiting: dict = {}
        for kind, _, taken, ready, done in tickets:
            run, wait = _overlap(start, stop, ready, done), _overlap(start, stop, taken, ready)
            if run:
                running[kind] = running.get(kind, 0.0) + run / bucket_us
            if wait:
                waiting[kind] = waiting.get(kind, 0.0) + wait / bucket_us
        buckets.append(Bucket(start, stop, running, waiting))
        start = stop
    return buckets


def format_timeline(buckets: list[Bucket], kinds_shown: int = 4) -> str:
    """A line a bucket: the kinds most CTAs ran, then the ones most waited in."""
    def most(counts: dict) -> str:
        top = sorted(counts.items(), key=lambda item: -item[1])[:kinds_shown]
        return " ".join(f"{kind} {ctas:.1f}" for kind, ctas in top)

    lines = ["CTAs on average a bucket (us after the first ticket): running | waiting"]
    for b in buckets:
        lines.append(f"{b.start_us:7.1f} - {b.stop_us:7.1f}  {most(b.running)} | {most(b.waiting)}")
    return "\n".join(lines)
