"""Timing variants of the mono launch (planner.timing_variant): a task kind
skipped or doubled, sharing the plain launch's buffers, flags and epochs, so
that launch-time differences say what the kind costs inside the launch."""

import pytest
import torch

from k3mono.config import preset
from k3mono.errors import K3InputError
from k3mono.mono import MonoRunner
from k3mono.planner import VARIANTS, Flag, TaskKind, plan, timing_variant
from k3mono.synthetic import random_inputs, random_layer
from k3mono.weights import shard_all

LAYER = 13
NAMES = ("moe_out", "prefix", "route_ids", "route_weights")


@pytest.mark.parametrize("how", VARIANTS)
@pytest.mark.parametrize("kind", [TaskKind.OPROJ, TaskKind.EXPERT_GU, TaskKind.FINAL])
def test_variant_tables_keep_the_flags_and_every_wait_behind_its_raisers(how, kind):
    cfg = preset("kimi-k3")
    table = plan(cfg, 8, 4, 132)
    varied = timing_variant(table, how, kind)
    copies = [t.kind for t in table.tasks].count(kind) if how == "double" else 0
    plain_raises = sorted((r.flag, r.index) for t in table.tasks for r in t.raises)
    # a copy raises the DISCARD word only, which no wait reads
    assert sorted((r.flag, r.index) for t in varied.tasks for r in t.raises) == sorted(
        plain_raises + [(Flag.DISCARD, 0)] * copies)
    assert all(w.flag != Flag.DISCARD for t in varied.tasks for w in t.waits)
    assert varied.flag_slots == table.flag_slots
    kinds = [t.kind for t in varied.tasks]
    if how == "skip":
        assert len(varied.tasks) == len(table.tasks) and kind not in kinds
        assert kinds.count(TaskKind.NOP) == [t.kind for t in table.tasks].count(kind)
        assert varied.summary().weight_bytes < table.summary().weight_bytes
    else:
        assert kinds.count(kind) == 2 * [t.kind for t in table.tasks].count(kind)
    for task in varied.tasks:  # every wait still names lower tickets that raise its flag
        for wait in task.waits:
            assert all(s < task.ticket for s in wait.sources)
            assert all((wait.flag, wait.index) in [(r.flag, r.index) for r in varied.tasks[s].raises] for s in wait.sources)


def test_variants_refuse_what_they_cannot_vary():
    table = plan(preset("tiny"), 1, 1, 1)
    with pytest.raises(K3InputError, match="expected one of"):
        timing_variant(table, "drop", TaskKind.OPROJ)
    with pytest.raises(K3InputError, match="no M1B tasks"):
        timing_variant(table, "skip", TaskKind.M1B)


@pytest.mark.parametrize("tp", [1, 2])
def test_skipped_or_doubled_expert_tasks_leave_the_outputs_alone(tp):
    """After a plain launch on the same buffers, a launch that skips the expert
    gate/up tasks (their activations stay) or runs them twice gives the plain
    outputs bit for bit; the launch walks its varied table to the end, the
    copies raising the DISCARD word once each."""
    cfg = preset("tiny")
    shards = shard_all(random_layer(cfg, seed=3), cfg, tp)
    inputs = random_inputs(cfg, 1, LAYER, seed=9)
    runner = MonoRunner(cfg, shards, 1, LAYER)
    plain = runner(**inputs)
    for how in VARIANTS:
        for rank in runner.rank_states:
            rank.load_inputs(**inputs)  # the input prefix again (the launch updates its copy in place)
            varied = rank.timing_variant(how, TaskKind.EXPERT_GU)
            table = varied.compiled.table
            discard = rank.flags()[table.flag_word(Flag.DISCARD, 0)].item()
            varied.launch()
            varied.check_health()
            assert varied.epoch() == rank.epoch()  # one epoch word, shared
            copies = [t.kind for t in table.tasks].count(TaskKind.EXPERT_GU) // 2 if how == "double" else 0
            assert rank.flags()[table.flag_word(Flag.DISCARD, 0)].item() == discard + copies
        got = runner.result(0)
        for name in NAMES:
            a, b = getattr(plain, name), getattr(got, name)
            assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b), (how, name)
