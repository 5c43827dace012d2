"""The mono launch's task trace (k3mono/trace.py): the per-kind summary of a
trace, the build's refusal under the interpreter, the launcher's checks."""

from __future__ import annotations

import pytest
import torch

from k3mono.config import preset
from k3mono.errors import K3InputError
from k3mono.mono import MonoRunner
from k3mono.planner import MonoOptions, TaskKind, plan
from k3mono.synthetic import random_inputs, random_layer
from k3mono.trace import format_timeline, summarize, ticket_rows, timeline
from k3mono.weights import shard_all

ORIGIN_NS = 10_000_000


def synthetic_trace(table, sms: int = 5) -> torch.Tensor:
    """Ticket i taken at 1000 i ns, ready 100 i ns later, done 10 ns after that, on SM i % sms."""
    rows = []
    for task in table.tasks:
        i = task.ticket
        taken = ORIGIN_NS + 1000 * i
        rows.append([i % sms, taken, taken + 100 * i, taken + 100 * i + 10])
    return torch.tensor(rows, dtype=torch.int64)


def test_summarize_gives_each_kind_its_span_in_table_order():
    table = plan(preset("tiny"), 2, 3, 7, MonoOptions())
    launch_us, spans = summarize(synthetic_trace(table), table)
    kinds = list(dict.fromkeys(task.kind.name for task in table.tasks))
    assert [s.kind for s in spans] == kinds
    assert sum(s.tasks for s in spans) == len(table.tasks)
    last = len(table.tasks) - 1
    assert launch_us == pytest.approx((1000 * last + 100 * last + 10) / 1e3)
    for span in spans:
        tickets = [t.ticket for t in table.tasks if t.kind.name == span.kind]
        first, final = min(tickets), max(tickets)
        assert span.first_taken_us == pytest.approx(first)  # 1000 ns a ticket
        assert span.first_ready_us == pytest.approx(1.1 * first)
        assert span.last_done_us == pytest.approx(1.1 * final + 0.01)
        assert span.wait_us == pytest.approx(0.1 * sum(tickets) / len(tickets))
        assert span.run_us == pytest.approx(0.01) and span.run_max_us == pytest.approx(0.01)
        assert span.sms == len({t % 5 for t in tickets})
    assert spans[0].kind == TaskKind.OPROJ.name


def test_ticket_rows_give_each_ticket_its_kind_sm_and_readings_after_the_first():
    table = plan(preset("tiny"), 2, 3, 7, MonoOptions())
    rows = ticket_rows(synthetic_trace(table), table)
    assert len(rows) == len(table.tasks)
    for task, (kind, sm, taken, ready, done) in zip(table.tasks, rows):
        i = task.ticket
        assert (kind, sm) == (task.kind.name, i % 5)
        assert (taken, ready, done) == pytest.approx((i, 1.1 * i, 1.1 * i + 0.01))
    with pytest.raises(ValueError, match="shape"):
        ticket_rows(synthetic_trace(table)[:-1], table)


def test_timeline_counts_the_ctas_running_and_waiting_in_each_kind_per_bucket():
    """A ticket runs from ready to done and waits from taken to ready; each bucket
    holds those times over its width, per kind (the rows of ticket_rows)."""
    tickets = [["OPROJ", 0, 0.0, 1.0, 3.0], ["ROUTE", 1, 0.0, 2.0, 4.0], ["ROUTE", 2, 3.0, 3.5, 4.5]]
    first, second, third = timeline(tickets, 2.0)
    assert (first.start_us, first.stop_us, third.stop_us) == (0.0, 2.0, 6.0)
    assert first.running == {"OPROJ": 0.5} and first.waiting == {"OPROJ": 0.5, "ROUTE": 1.0}
    assert second.running == {"OPROJ": 0.5, "ROUTE": 1.0 + 0.25} and second.waiting == {"ROUTE": 0.25}
    assert third.running == {"ROUTE": 0.25} and third.waiting == {}
    lines = format_timeline([first, second, third]).splitlines()
    assert len(lines) == 4
    assert lines[2].split() == ["2.0", "-", "4.0", "ROUTE", "1.2", "OPROJ", "0.5", "|", "ROUTE", "0.2"]
    with pytest.raises(ValueError, match="bucket_us"):
        timeline(tickets, 0.0)


def test_summarize_refuses_a_trace_of_another_table_or_with_unrecorded_tickets():
    table = plan(preset("tiny"), 2, 3, 7, MonoOptions())
    trace = synthetic_trace(table)
    with pytest.raises(ValueError, match="shape"):
        summarize(trace[:-1], table)
    trace[3, 1] = 0
    with pytest.raises(ValueError, match="never recorded"):
        summarize(trace, table)


def test_a_trace_build_needs_the_gpu_and_a_trace_buffer_needs_a_trace_build():
    cfg, tokens, layer = preset("tiny"), 1, 1
    shards = shard_all(random_layer(cfg, 0), cfg, 1)
    with pytest.raises(K3InputError, match="trace: .*interpreter"):
        MonoRunner(cfg, shards, tokens, layer, trace=True)
    runner = MonoRunner(cfg, shards, tokens, layer)
    runner.load_inputs(**random_inputs(cfg, tokens, layer, seed=5))
    rank = runner.rank_states[0]
    rank.trace = torch.zeros((len(rank.compiled.table.tasks), 4), dtype=torch.int64)
    rank.out.fill_(float("nan"))
    with pytest.raises(K3InputError, match="trace: given"):
        rank.launch()
    assert bool(torch.isnan(rank.out.float()).all()), "nothing is written before the check"
