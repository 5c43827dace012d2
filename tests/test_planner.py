"""The mono launch's planner (CPU): order, flags, coverage, bytes, encoding,
and a discrete-event simulation of T ranks' CTAs walking the table."""

from __future__ import annotations

import heapq
import random
from collections import Counter, defaultdict
from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest
import torch

from k3mono.cli import main
from k3mono.config import preset
from k3mono.errors import K3InputError
from k3mono.floor import floor_bytes
from k3mono.layout import peer_layout, scratch_layout
from k3mono.mono import default_options
from k3mono.planner import (
    ATTN_FOLDED_BLOCK_N,
    ATTN_FOLDED_STAGES,
    BACK_SHORT_SPLITS,
    COL,
    MAX_WAITS,
    OPT_ALL,
    OPT_FINAL_SPLIT,
    PEER_FLAGS,
    TABLE_COLUMNS,
    Flag,
    M1bShape,
    M1cShape,
    MonoOptions,
    Raise,
    TaskKind,
    _check_invariant,
    plan,
    timing_variant,
    TileChoice,
    stage_geometry,
    tiles,
)

SMS = (132, 256, 1, 7, 100)  # H200, MI355X, and odd counts
TOKENS = (1, 4, 16)
CONFIGS = (
    [("kimi-k3", tp, s) for tp in (1, 2, 8) for s in TOKENS]
    + [("tiny", tp, s) for tp in (1, 2) for s in TOKENS]
    + [("small", 8, s) for s in TOKENS]
)
SIM_CASES = [(name, tp, s, sms) for name, tp, s in CONFIGS for sms in SMS]
M1B_CONFIGS = [("kimi-k3", 8, 4), ("kimi-k3", 1, 16), ("tiny", 2, 3), ("tiny", 1, 1)]
X_GROUP_CONFIGS = [("kimi-k3", 8, 16), ("kimi-k3", 2, 6), ("tiny", 2, 9), ("small", 8, 5)]
X_PARTS = 7
X_PARTS_CONFIGS = [("kimi-k3", 8, 8), ("kimi-k3", 2, 16), ("tiny", 2, 9), ("small", 8, 5)]
LONG_SPLITS = BACK_SHORT_SPLITS + 4
LONG_CONFIGS = [("kimi-k3", 8, 2), ("tiny", 2, 3)]
TABLES = ([(*c, None) for c in CONFIGS] + [(*c, "m1b") for c in M1B_CONFIGS]
          + [(*c, "m1c") for c in M1B_CONFIGS] + [(*c, mla) for c in LONG_CONFIGS for mla in ("m1b_long", "m1c_long")]
          + [(*c, "x_groups") for c in X_GROUP_CONFIGS] + [(*c, "x_parts") for c in X_PARTS_CONFIGS])
"""(preset, T, S, mla): every config plain, a few as MLA layers whose launch runs
M1b ("m1b"), or M1c then M1b ("m1c"), at 4 splits, or at LONG_SPLITS, past the
short combine ("m1b_long", "m1c_long"); a few past FMA_MAX_TOKENS tokens with the
router and latent down by groups of tokens ("x_groups": TileChoice.x_token_groups)
or by X_PARTS parts of K ("x_parts": TileChoice.x_k_parts)."""

KIND_ORDER = [
    TaskKind.OPROJ,
    TaskKind.REDUCE1,
    TaskKind.SEAM_MIX,
    TaskKind.SEAM_NORM,
    TaskKind.ROUTER,
    TaskKind.LATENT_DOWN,
    TaskKind.SHARED_GU,
    TaskKind.ROUTE_PART,
    TaskKind.ROUTE,
    TaskKind.EXPERT_GU,
    TaskKind.EXPERT_DOWN,
    TaskKind.LATENT_PART,
    TaskKind.FINAL,
    TaskKind.REDUCE3,
]


def m1b_shape(name: str, tp: int, splits: int = 4) -> M1bShape:
    """Kimi-K3's latent with fp8 w_v at TP8, bf16 otherwise; a small latent for the test presets."""
    return M1bShape(splits=splits, latent=512 if name == "kimi-k3" else 32, w_v_fp8=tp == 8)


def m1c_shape(name: str, tp: int, tokens: int) -> M1cShape:
    """Kimi-K3's positional width and fp8 cache at TP8; two requests where S allows."""
    return M1cShape(page_size=64 if name == "kimi-k3" else 16, requests=min(2, tokens),
                    rope=64 if name == "kimi-k3" else 16, kv_fp8=tp == 8)


@lru_cache(maxsize=None)
def table_for(name: str, tp: int, tokens: int, sms: int = 132, prefetch_final: bool = False, mla: str | None = None,
              route_early: bool = False, shared_late: bool = False, prefetch_shared: bool = False,
              prefetch_final_early: bool = False):
    long = mla in ("m1b_long", "m1c_long")
    m1b = m1b_shape(name, tp, LONG_SPLITS if long else 4) if mla and mla.startswith("m1") else None
    m1c = m1c_shape(name, tp, tokens) if mla in ("m1c", "m1c_long") else None
    options = MonoOptions(prefetch_final=prefetch_final, m1b=m1b, m1c=m1c, route_early=route_early,
                          shared_late=shared_late,
                          tiles=TileChoice(x_token_groups=mla == "x_groups",
                                           x_k_parts=X_PARTS if mla == "x_parts" else 1),
                          prefetch_shared=prefetch_shared, prefetch_final_early=prefetch_final_early)
    return plan(preset(name), tp, tokens, sms, options)


def raisers_of(table) -> dict:
    """(flag, index) -> tickets raising it."""
    out = defaultdict(list)
    for task in table.tasks:
        for r in task.raises:
            out[(r.flag, r.index)].append(task.ticket)
    return out


# -- order and flags ---------------------------------------------------------------


@pytest.mark.parametrize("name,tp,tokens,mla", TABLES)
@pytest.mark.parametrize("prefetch,route_early,shared_late",
                         [(False, False, False), (True, False, False), (False, True, False), (True, False, True)])
def test_every_wait_points_to_lower_tickets_of_its_raisers(name, tp, tokens, mla, prefetch, route_early, shared_late):
    table = table_for(name, tp, tokens, prefetch_final=prefetch, mla=mla, route_early=route_early,
                      shared_late=shared_late)
    raisers = raisers_of(table)
    for task in table.tasks:
        assert len(task.waits) <= MAX_WAITS and len(task.raises) <= 1
        for wait in task.waits:
            assert wait.sources == tuple(raisers[(wait.flag, wait.index)]), (task, wait.flag)
            # the same task on every other rank has the same ticket: lower there too
            assert wait.sources and max(wait.sources) < task.ticket, (task.ticket, task.kind, wait.flag)
    assert [t.ticket for t in table.tasks] == list(range(len(table.tasks)))


@pytest.mark.parametrize("name,tp,tokens,mla", TABLES)
def test_every_flag_is_raised_exactly_its_count_and_every_raise_is_awaited(name, tp, tokens, mla):
    table = table_for(name, tp, tokens, mla=mla)
    raisers = raisers_of(table)
    counts = {}
    for task in table.tasks:
        for wait in task.waits:
            counts.setdefault((wait.flag, wait.index), set()).add(wait.count)
    assert set(counts) == set(raisers), "a flag raised but never awaited, or awaited but never raised"
    for (flag, index), needed in counts.items():
        assert len(needed) == 1, f"{flag.name}[{index}]: waiters disagree on the count {needed}"
        per_launch = len(raisers[(flag, index)]) * (tp if flag in PEER_FLAGS else 1)
        assert needed == {per_launch}, f"{flag.name}[{index}]: raised {per_launch} times a launch, awaited {needed}"


@pytest.mark.parametrize("name,tp,tokens,mla", TABLES)
def test_flag_words_are_distinct_and_in_range(name, tp, tokens, mla):
    table = table_for(name, tp, tokens, mla=mla)
    words = {}
    for flag, slots in table.flag_slots:
        for index in range(slots):
            word = table.flag_word(flag, index)
            assert word not in words and 0 <= word < table.num_flag_words
            words[word] = (flag, index)
            assert table.flag_of_word(word) == (flag, index)
    assert len(words) == table.num_flag_words
    assert {flag for flag, _ in table.flag_slots} == set(Flag)


@pytest.mark.parametrize("prefetch,route_early,shared_late,early",
                         [(False, False, False, False), (True, False, False, False), (False, True, False, False),
                          (False, False, True, False), (True, False, True, False), (True, False, True, True)])
def test_kinds_come_in_the_documented_order(prefetch, route_early, shared_late, early):
    table = table_for("kimi-k3", 8, 4, prefetch_final=prefetch, route_early=route_early, shared_late=shared_late,
                      prefetch_shared=prefetch, prefetch_final_early=early)
    kinds = [group.kind for group in table.groups()]
    expected = list(KIND_ORDER)
    if prefetch:
        expected.insert(expected.index(TaskKind.LATENT_DOWN) + 1, TaskKind.PREFETCH_SHARED)
        final_before = TaskKind.PREFETCH_SHARED if early else TaskKind.LATENT_PART
        expected.insert(expected.index(final_before), TaskKind.PREFETCH_FINAL)
    if route_early or shared_late:
        expected.remove(TaskKind.SHARED_GU)
        after = TaskKind.EXPERT_GU if shared_late else TaskKind.ROUTE
        expected.insert(expected.index(after) + 1, TaskKind.SHARED_GU)
    assert kinds == expected
    assert MonoOptions.from_bits(table.options.bits()) == table.options
    # the MoE's static weights are right behind the seam: they stream while AR1 settles
    first = {g.kind: g.tasks[0].ticket for g in table.groups()}
    seam_end = table.groups()[kinds.index(TaskKind.SEAM_NORM)].tasks[-1].ticket
    assert first[TaskKind.ROUTER] == seam_end + 1


@pytest.mark.parametrize("name,tp,tokens", M1B_CONFIGS)
def test_m1b_tasks_come_first_and_every_oproj_waits_for_the_whole_core(name, tp, tokens):
    cfg, shape = preset(name), m1b_shape(name, tp)
    table = table_for(name, tp, tokens, mla="m1b")
    assert [group.kind for group in table.groups()] == [TaskKind.M1B] + KIND_ORDER
    m1b = table.groups()[0].tasks
    heads, g = cfg.num_attention_heads // tp, table.geometry.m1b
    assert (g.heads, g.value, g.latent, g.splits) == (heads, cfg.v_head_dim, shape.latent, shape.splits)
    # one task a token, head and BLOCK_DV rows of it, token-major, covering the rank's core columns in order
    blocks = tiles(heads * cfg.v_head_dim, g.block_dv)
    assert [(t.token, t.tile, t.span) for t in m1b] == [(s, b, (lo, hi)) for s in range(tokens) for b, lo, hi in blocks]
    assert len(m1b) == tokens * heads * (cfg.v_head_dim // g.block_dv) == g.tasks
    assert all((t.weight_bytes > 0) == (t.token == 0) for t in m1b), "token 0's tasks stream w_v, L2 holds it after"
    assert all(not t.waits and t.raises == (Raise(Flag.CORE, 0),) for t in m1b)
    assert not Raise(Flag.CORE, 0).every_rank, "CORE is the own rank's flag"
    sources = tuple(t.ticket for t in m1b)
    for task in table.tasks:
        if task.kind == TaskKind.OPROJ:
            assert [(w.flag, w.index, w.count, w.sources) for w in task.waits] == [(Flag.CORE, 0, len(m1b), sources)]
        else:
            assert all(w.flag != Flag.CORE for w in task.waits)
    w_v_bytes = heads * cfg.v_head_dim * shape.latent * (1 if shape.w_v_fp8 else 2)
    assert table.summary().weights_by_tensor["w_v"] == w_v_bytes
    assert table.summary().weight_bytes == table_for(name, tp, tokens).summary().weight_bytes + w_v_bytes
    assert dict(table.flag_slots)[Flag.CORE] == 1 and dict(table_for(name, tp, tokens).flag_slots)[Flag.CORE] == 0
    assert MonoOptions.from_bits(table.options.bits(), m1b=shape) == table.options
    with pytest.raises(K3InputError, match="m1b"):
        MonoOptions.from_bits(table.options.bits())
    assert LaunchSim(table, ranks=tp, ctas=table.ctas, launches=2).run().premature == []


@pytest.mark.parametrize("name,tp,tokens", M1B_CONFIGS)
def test_m1c_tasks_come_first_and_every_m1b_waits_for_all_of_them(name, tp, tokens):
    cfg, shape = preset(name), m1c_shape(name, tp, tokens)
    table, m1b_only = table_for(name, tp, tokens, mla="m1c"), table_for(name, tp, tokens, mla="m1b")
    assert [group.kind for group in table.groups()] == [TaskKind.M1C, TaskKind.M1B] + KIND_ORDER
    m1c = table.groups()[0].tasks
    g, heads = table.geometry.m1c, cfg.num_attention_heads // tp
    assert (g.heads, g.tokens, g.splits, g.latent, g.rope) == (heads, tokens, 4, m1b_shape(name, tp).latent, shape.rope)
    # token-major, then split, then head block; tile = split * head_blocks + block
    blocks = tiles(heads, g.block_h)
    want = [(s, k * g.head_blocks + b, (lo, hi))
            for s in range(tokens) for k in range(g.splits) for b, lo, hi in blocks]
    assert [(t.token, t.tile, t.span) for t in m1c] == want and len(m1c) == g.tasks
    assert all(not t.waits and t.raises == (Raise(Flag.SPLITS, 0),) and t.weight_bytes == 0 for t in m1c)
    assert not Raise(Flag.SPLITS, 0).every_rank, "SPLITS is the own rank's flag"
    sources = tuple(t.ticket for t in m1c)
    for task in table.tasks:
        if task.kind == TaskKind.M1B:
            assert [(w.flag, w.index, w.count, w.sources) for w in task.waits] == [(Flag.SPLITS, 0, len(m1c), sources)]
        else:
            assert all(w.flag != Flag.SPLITS for w in task.waits)
    # past the M1C tasks, the M1b table shifted by their count
    assert [t.row() for t in table.tasks[len(m1c):] if t.kind != TaskKind.M1B] == [
        t.row() for t in m1b_only.tasks if t.kind != TaskKind.M1B]
    assert table.summary().weights_by_tensor == m1b_only.summary().weights_by_tensor
    assert dict(table.flag_slots)[Flag.SPLITS] == 1 and dict(m1b_only.flag_slots)[Flag.SPLITS] == 0
    assert MonoOptions.from_bits(table.options.bits(), m1b=table.options.m1b, m1c=shape) == table.options
    with pytest.raises(K3InputError, match="m1c"):
        MonoOptions.from_bits(table.options.bits(), m1b=table.options.m1b)
    assert LaunchSim(table, ranks=tp, ctas=table.ctas, launches=2).run().premature == []


def test_m1c_needs_m1b_and_shapes_the_kernel_can_take():
    m1b = M1bShape(splits=2, latent=32)
    bad = [(None, M1cShape(page_size=16, requests=1, rope=16)), (m1b, M1cShape(page_size=0, requests=1, rope=16)),
           (m1b, M1cShape(page_size=16, requests=3, rope=16)), (m1b, M1cShape(page_size=16, requests=0, rope=16)),
           (m1b, M1cShape(page_size=16, requests=1, rope=24)), (m1b, M1cShape(page_size=16, requests=1, rope=8)),
           (m1b, (16, 1))]
    for m1b_shape_, m1c in bad:
        with pytest.raises(K3InputError, match="m1c"):
            plan(preset("tiny"), 1, 2, 132, MonoOptions(m1b=m1b_shape_, m1c=m1c))


def test_folded_m1c_stages_follow_the_tiles_and_change_nothing_else():
    """TileChoice.m1c_stages: the M1C tasks' pipeline depth, nothing else of the
    table (the same tasks, waits and bytes; ATTN_FOLDED_BLOCK_N positions a step
    either way); an unknown depth is refused."""
    cfg, m1b = preset("kimi-k3"), M1bShape(splits=16, latent=512)
    m1c = M1cShape(page_size=64, requests=4, kv_fp8=True)
    base = plan(cfg, 8, 4, 132, MonoOptions(m1b=m1b, m1c=m1c))
    deep = plan(cfg, 8, 4, 132, MonoOptions(m1b=m1b, m1c=m1c, tiles=TileChoice(m1c_stages=3)))
    assert (base.geometry.m1c.stages, deep.geometry.m1c.stages) == (ATTN_FOLDED_STAGES, 3)
    assert base.geometry.m1c.block_n == deep.geometry.m1c.block_n == ATTN_FOLDED_BLOCK_N
    assert replace(deep.geometry.m1c, stages=ATTN_FOLDED_STAGES) == base.geometry.m1c
    assert [t.row() for t in deep.tasks] == [t.row() for t in base.tasks]
    with pytest.raises(K3InputError, match="m1c_stages"):
        plan(cfg, 8, 4, 132, MonoOptions(m1b=m1b, m1c=m1c, tiles=TileChoice(m1c_stages=4)))


def test_floor_with_m1c_counts_the_cache_and_q_not_the_split_outputs():
    cfg, m1b, m1c = preset("kimi-k3"), M1bShape(splits=16, latent=512, w_v_fp8=True), M1cShape(64, 2, 64, True)
    with_m1c = floor_bytes(cfg, 8, 4, m1b=m1b, m1c=m1c, context=3000)
    m1b_only = floor_bytes(cfg, 8, 4, m1b=m1b)
    assert with_m1c["weights"] == m1b_only["weights"]
    acts, old = with_m1c["activations"], m1b_only["activations"]
    assert acts["kv"] == 3000 * 576 and acts["q"] == 4 * 12 * 576 * 2
    assert "o" not in acts and "lse" not in acts and acts["gate"] == old["gate"]
    assert with_m1c["total"] - m1b_only["total"] == acts["kv"] + acts["q"] - old["o"] - old["lse"]
    bf16 = floor_bytes(cfg, 8, 4, m1b=m1b, m1c=M1cShape(64, 2, 64, False), context=3000)
    assert bf16["activations"]["kv"] == 2 * acts["kv"]
    for bad in (dict(m1b=m1b, m1c=m1c), dict(m1b=m1b, m1c=m1c, context=0), dict(m1c=m1c, context=5)):
        with pytest.raises(K3InputError, match="context"):
            floor_bytes(cfg, 8, 4, **bad)


def test_m1b_rejects_widths_the_kernel_cannot_tile():
    for shape in (M1bShape(splits=0, latent=32), M1bShape(splits=2, latent=48), M1bShape(splits=2, latent=8)):
        with pytest.raises(K3InputError, match="m1b"):
            plan(preset("tiny"), 1, 1, 132, MonoOptions(m1b=shape))


def test_expert_tasks_load_after_the_routes_and_wait_for_data_after_loading():
    table = table_for("kimi-k3", 8, 4)
    for task in table.tasks:
        if task.kind in (TaskKind.EXPERT_GU, TaskKind.EXPERT_DOWN):
            assert [w.before_loads for w in task.waits] == [True, False]
            assert task.waits[0].flag == Flag.ROUTED and task.waits[0].index == task.token
        else:
            assert not any(w.before_loads for w in task.waits)


@pytest.mark.parametrize("name,tp,tokens", [("kimi-k3", 8, 1), ("kimi-k3", 8, 16), ("tiny", 2, 3)])
def test_final_split_makes_the_latent_wait_the_final_tasks_own(name, tp, tokens):
    """MonoOptions.final_split: every FINAL task polls SHARED_READY before it
    runs and LATENT_READY itself (after its shared down-projection): the int
    table's late_waits says so, and nothing else changes."""
    cfg = preset(name)
    plain, split = plan(cfg, tp, tokens, 132), plan(cfg, tp, tokens, 132, MonoOptions(final_split=True))
    assert split.options.bits() & OPT_FINAL_SPLIT and MonoOptions.from_bits(split.options.bits()).final_split
    for a, b in zip(plain.tasks, split.tasks, strict=True):
        if b.kind == TaskKind.FINAL:
            assert [(w.flag, w.in_task) for w in b.waits] == [(Flag.SHARED_READY, False), (Flag.LATENT_READY, True)]
            assert [replace(w, in_task=False) for w in b.waits] == list(a.waits)
        else:
            assert a == b
    rows, late = split.as_int_tensor(), COL["late_waits"]
    finals = torch.tensor([t.kind == TaskKind.FINAL for t in split.tasks])
    assert (rows[finals, late] == 1).all() and (rows[~finals, late] == 0).all()
    assert (plain.as_int_tensor()[:, late] == 0).all()
    assert split.decode_int_tensor(rows) == [t.row() for t in split.tasks]
    skipped = timing_variant(split, "skip", TaskKind.FINAL)  # a NOP polls every wait before its raise
    assert not any(w.in_task for t in skipped.tasks for w in t.waits)


def test_an_in_task_wait_is_refused_where_no_task_polls_it():
    table = plan(preset("tiny"), 1, 1, 1, MonoOptions(final_split=True))
    final = next(t for t in table.tasks if t.kind == TaskKind.FINAL)
    early_late = replace(final, waits=(replace(final.waits[0], in_task=True), replace(final.waits[1], in_task=False)))
    router = next(t for t in table.tasks if t.kind == TaskKind.ROUTER)
    on_router = replace(router, waits=tuple(replace(w, in_task=True) for w in router.waits))
    for bad in (early_late, on_router):
        tasks = tuple(bad if t.ticket == bad.ticket else t for t in table.tasks)
        with pytest.raises(AssertionError, match="in-task waits"):
            _check_invariant(tasks)


# -- coverage ------------------------------------------------------------------------


def coverage_arrays(table):
    """Zero counters for every region a task writes, with one rank's shapes."""
    cfg, tp, S = table.cfg, table.tp, table.tokens
    # M1C writes the split outputs there, split router / latent down tiles their parts
    scratch = scratch_layout(cfg, tp, S, table.geometry.m1c, table.geometry.x_parts)
    shapes = {name: shape for name, (_, shape, _) in {**peer_layout(cfg, tp, S), **scratch}.items()}
    shapes.pop("__end__")
    shapes["prefix"] = shapes["out"] = (S, cfg.hidden_size)
    if table.options.m1b is not None:
        shapes["core"] = (S, cfg.core_width // tp)  # M1B writes the rank's core
    return {name: np.zeros(shape, dtype=np.int32) for name, shape in shapes.items()}


@pytest.mark.parametrize("name,tp,tokens,mla", TABLES)
@pytest.mark.parametrize("prefetch", [False, True])
def test_every_output_element_is_written_by_exactly_one_task(name, tp, tokens, mla, prefetch):
    """On each rank: its own writes to local regions, and every rank's pushes
    into its peer regions (the same for every receiving rank)."""
    table = table_for(name, tp, tokens, prefetch_final=prefetch, mla=mla, prefetch_shared=prefetch)
    local = coverage_arrays(table)  # any one rank: the table is the same on all
    peer = coverage_arrays(table)  # what lands in a rank's peer regions, from all ranks
    for rank in range(tp):
        for task in table.tasks:
            for write in table.writes(task, rank):
                if write.every_rank:
                    peer[write.region][write.index] += 1
                elif rank == 0:
                    local[write.region][write.index] += 1
    peer_regions = {"ar1", "logits", "z", "ar2", "ar3"}
    for region in peer_regions:
        assert (peer[region] == 1).all(), f"{region}: counts {np.unique(peer[region])}"
        assert (local[region] == 0).all()
    for region in set(local) - peer_regions:
        assert (local[region] == 1).all(), f"{region}: counts {np.unique(local[region])}"
        assert (peer[region] == 0).all()


# -- bytes -----------------------------------------------------------------------------


@pytest.mark.parametrize("name,tp,tokens,mla", TABLES)
@pytest.mark.parametrize("prefetch", [False, True])
def test_streamed_weight_bytes_equal_the_floor(name, tp, tokens, mla, prefetch):
    table = table_for(name, tp, tokens, prefetch_final=prefetch, mla=mla, prefetch_shared=prefetch)
    cfg = preset(name)
    floor = floor_bytes(cfg, tp, tokens, unique_experts=tokens * cfg.num_experts_per_token, m1b=table.options.m1b,
                        m1c=table.options.m1c, context=100)
    summary = table.summary()
    assert summary.weights_by_tensor == floor["weights"]
    assert summary.weight_bytes == floor["weight_bytes"]


def test_prefetch_shared_moves_the_shared_weights_into_tasks_right_after_the_latent_down():
    plain, prefetched = table_for("kimi-k3", 8, 1), table_for("kimi-k3", 8, 1, prefetch_shared=True)
    kinds = [t.kind for t in prefetched.tasks]
    fetch = [t for t in prefetched.tasks if t.kind == TaskKind.PREFETCH_SHARED]
    shared = [t for t in prefetched.tasks if t.kind == TaskKind.SHARED_GU]
    assert kinds.index(TaskKind.PREFETCH_SHARED) == len(kinds) - kinds[::-1].index(TaskKind.LATENT_DOWN)
    assert all(not t.waits and not t.raises for t in fetch) and all(t.weight_bytes == 0 for t in shared)
    assert [t.span for t in fetch] == [t.span for t in shared]
    shared_bytes = sum(t.weight_bytes for t in plain.tasks if t.kind == TaskKind.SHARED_GU)
    assert sum(t.weight_bytes for t in fetch) == shared_bytes


def test_prefetch_moves_final_weights_into_the_prefetch_tasks():
    plain, prefetched = table_for("kimi-k3", 8, 1), table_for("kimi-k3", 8, 1, prefetch_final=True)
    final = [t for t in prefetched.tasks if t.kind == TaskKind.FINAL]
    fetch = [t for t in prefetched.tasks if t.kind == TaskKind.PREFETCH_FINAL]
    assert all(t.weight_bytes == 0 for t in final)
    assert [t.span for t in fetch] == [t.span for t in final]
    plain_final = sum(t.weight_bytes for t in plain.tasks if t.kind == TaskKind.FINAL)
    assert sum(t.weight_bytes for t in fetch) == plain_final > 0
    assert all(not t.waits and not t.raises for t in fetch)
    assert MonoOptions.from_bits(prefetched.options.bits()) == prefetched.options


def test_floor_matches_the_measured_tp8_numbers():
    """design-brief.md: 105 MB at S = 1 (24.6 us at 4.25 TB/s), 49.4 us at S = 4, 148.5 us at S = 16."""
    cfg = preset("kimi-k3")
    bandwidth = 4.25e12
    for tokens, micros in ((1, 24.6), (4, 49.4), (16, 148.5)):
        floor = floor_bytes(cfg, 8, tokens)
        assert floor["total"] / bandwidth * 1e6 == pytest.approx(micros, rel=0.025)
    weights = floor_bytes(cfg, 8, 1)["weights"]
    assert weights["o_proj"] == 7168 * 1536 * 2
    assert sum(weights[n] for n in ("shared_gate", "shared_up", "shared_down")) == 3 * 768 * 7168 * 2


def test_floor_counts_distinct_experts_and_validates():
    cfg = preset("tiny")
    one = floor_bytes(cfg, 2, 4, unique_experts=1)["weights"]["w2_packed"]
    assert floor_bytes(cfg, 2, 4, unique_experts=5)["weights"]["w2_packed"] == 5 * one
    assert floor_bytes(cfg, 2, 16) == floor_bytes(cfg, 2, 16, unique_experts=cfg.num_experts)  # min(S*K, E)
    blocks = floor_bytes(cfg, 2, 4, nblocks=3)["activations"]["blocks"]
    assert blocks == 4 * 3 * cfg.hidden_size * 2
    for kwargs in ({"tokens": 0}, {"tokens": 17}, {"tp": 3}, {"unique_experts": -1}, {"nblocks": 0}):
        args = {"tp": 2, "tokens": 4, **kwargs}
        with pytest.raises(K3InputError):
            floor_bytes(cfg, args.pop("tp"), args.pop("tokens"), **args)


# -- encoding and CTA count ---------------------------------------------------------------


@pytest.mark.parametrize("name,tp,tokens,mla", TABLES)
def test_int_tensor_round_trips(name, tp, tokens, mla):
    table = table_for(name, tp, tokens, prefetch_final=tokens == 4, mla=mla)
    encoded = table.as_int_tensor()
    assert encoded.dtype.is_floating_point is False and encoded.element_size() == 4
    assert tuple(encoded.shape) == (len(table.tasks), len(TABLE_COLUMNS))
    assert table.decode_int_tensor(encoded) == [task.row() for task in table.tasks]
    kinds = encoded[:, COL["kind"]].tolist()
    assert kinds == [int(t.kind) for t in table.tasks]
    peers = encoded[:, COL["raise_peer"]].tolist()
    assert peers == [int(bool(t.raises) and t.raises[0].flag in PEER_FLAGS) for t in table.tasks]


@pytest.mark.parametrize("name,tp,tokens,sms", SIM_CASES)
def test_cta_count_is_one_per_sm_and_at_most_the_tasks(name, tp, tokens, sms):
    table = table_for(name, tp, tokens, sms)
    assert table.ctas == min(len(table.tasks), sms)
    assert table_for(name, tp, tokens, 1 << 20).ctas == len(table.tasks)
    resident = plan(preset(name), tp, tokens, sms, MonoOptions(ctas_per_sm=4)) if tokens == 1 else None
    assert resident is None or resident.ctas == min(len(table.tasks), 4 * sms)


@pytest.mark.parametrize("name,tp,tokens,sms", [("kimi-k3", 8, 1, 132), ("tiny", 2, 4, 7)])
def test_simulated_launch_completes_with_several_ctas_an_sm(name, tp, tokens, sms):
    table = plan(preset(name), tp, tokens, sms, MonoOptions(ctas_per_sm=4))
    assert table.ctas == min(len(table.tasks), 4 * sms)
    assert LaunchSim(table, ranks=tp, ctas=table.ctas).run().done == [len(table.tasks)] * tp


def test_plan_rejects_bad_values():
    cfg = preset("tiny")
    bad = [
        dict(tokens=0),
        dict(tokens=17),
        dict(tokens=True),
        dict(tokens=2.0),
        dict(tp=3),
        dict(tp=8),  # tiny has 4 heads
        dict(sms=0),
        dict(sms=-7),
        dict(sms=1.5),
        dict(options="prefetch"),
        dict(options=MonoOptions(ctas_per_sm=0)),
        dict(options=MonoOptions(prefetch_final_early=True)),  # no PREFETCH_FINAL tasks to move
    ]
    for override in bad:
        args = {"tp": 2, "tokens": 4, "sms": 132, "options": MonoOptions(), **override}
        with pytest.raises(K3InputError):
            plan(cfg, **args)
    with pytest.raises(K3InputError, match="unknown option bits"):
        MonoOptions.from_bits(1 << OPT_ALL.bit_length())


def test_always_prefetched_kinds_are_the_chosen_prefetch_options():
    """MonoOptions.always_prefetched: the kernel's PREFETCH_KINDS mask, a bit per
    kind code whose rows are asked for before its other waits whatever the mode."""
    assert MonoOptions().always_prefetched() == 0
    assert MonoOptions(prefetch_oproj=True).always_prefetched() == 1 << TaskKind.OPROJ
    both = MonoOptions(prefetch_gate_up=True, prefetch_down=True).always_prefetched()
    assert both == (1 << TaskKind.EXPERT_GU) | (1 << TaskKind.EXPERT_DOWN)


# -- simulation ------------------------------------------------------------------------------


class Deadlock(AssertionError):
    pass


class LaunchSim:
    """T ranks, each with ``ctas`` CTAs taking tickets in table order (the next
    one grabbed once a task's waits are met), blocking on waits, raising flags at the end
    of a task: local flags at once, peer flags on every rank after a link
    latency. Counters are never cleared; launch e waits for e * count. Ranks run
    at different speeds with jitter, and ``launches`` back to back, so a fast
    rank's next launch raises into a slow rank's flags: a wait satisfied only
    thanks to a later epoch's raises is recorded in ``premature``."""

    LINK_LATENCY = 3.0
    TASK_OVERHEAD = 1.0
    BYTES_PER_TIME = 16384
    RANK_SKEW = 0.15  # rank r runs (1 + r * skew) slower
    LAUNCH_GAP = 2.0

    def __init__(self, table, ranks: int, ctas: int, launches: int = 1, seed: int = 0):
        self.table, self.ranks, self.ctas, self.launches = table, ranks, ctas, launches
        self.n = len(table.tasks)
        self.waits = [[(table.flag_word(w.flag, w.index), w.count) for w in t.waits] for t in table.tasks]
        self.raise_of = [
            (table.flag_word(t.raises[0].flag, t.raises[0].index), t.raises[0].every_rank) if t.raises else None
            for t in table.tasks
        ]
        rng = random.Random(seed)
        base = [self.TASK_OVERHEAD + t.weight_bytes / self.BYTES_PER_TIME for t in table.tasks]
        self.cost = [[b * (1 + r * self.RANK_SKEW) * rng.uniform(0.5, 1.5) for b in base] for r in range(ranks)]
        words = table.num_flag_words
        self.count = [[0] * words for _ in range(ranks)]
        self.by_epoch = [[Counter() for _ in range(words)] for _ in range(ranks)]
        self.waiters = defaultdict(list)  # (rank, word) -> [(target, cta)]
        self.next_ticket = [0] * ranks
        self.epoch = [0] * ranks
        self.done = [0] * ranks
        self.finished_at = [[] for _ in range(ranks)]
        self.premature = []
        self.events, self.seq, self.now = [], 0, 0.0

    # -- events --------------------------------------------------------------------
    def _at(self, time, action, *args):
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, action, args))

    def run(self):
        for rank in range(self.ranks):
            self._at(0.0, self._start_launch, rank)
        while self.events:
            self.now, _, action, args = heapq.heappop(self.events)
            action(*args)
        if any(len(f) < self.launches for f in self.finished_at):
            blocked = [(rank, self.table.flag_of_word(word), [(t, c["cur"]) for t, c in ws])
                       for (rank, word), ws in self.waiters.items() if ws]
            raise Deadlock(f"done {self.done} of {self.n}; blocked: {blocked[:6]}")
        return self

    def _take(self, rank):
        ticket = self.next_ticket[rank]
        if ticket >= self.n:
            return None
        self.next_ticket[rank] += 1
        return ticket

    def _start_launch(self, rank):
        self.epoch[rank] += 1
        self.next_ticket[rank], self.done[rank] = 0, 0
        for _ in range(self.ctas):
            cta = {"rank": rank, "epoch": self.epoch[rank], "cur": self._take(rank), "pos": 0, "next": None}
            if cta["cur"] is not None:
                self._proceed(cta)

    def _proceed(self, cta):
        rank, epoch, ticket = cta["rank"], cta["epoch"], cta["cur"]
        waits = self.waits[ticket]
        while cta["pos"] < len(waits):
            word, count = waits[cta["pos"]]
            target = epoch * count
            if self.count[rank][word] < target:
                self.waiters[(rank, word)].append((target, cta))
                return
            self._check_epochs(rank, word, epoch, target, ticket)
            cta["pos"] += 1
        cta["next"] = self._take(rank)  # grabbed as the task starts, after its waits
        self._at(self.now + self.cost[rank][ticket], self._finish, cta)

    def _check_epochs(self, rank, word, epoch, target, ticket):
        if self.launches > 1:
            mine = sum(n for e, n in self.by_epoch[rank][word].items() if e <= epoch)
            if mine < target:
                self.premature.append((rank, epoch, ticket, self.table.flag_of_word(word)))

    def _finish(self, cta):
        rank, ticket = cta["rank"], cta["cur"]
        raised = self.raise_of[ticket]
        if raised is not None:
            word, every_rank = raised
            if every_rank:
                self._at(self.now + self.LINK_LATENCY, self._bump_all, word, cta["epoch"], rank)
                self._bump(rank, word, cta["epoch"])  # the own copy lands at once
            else:
                self._bump(rank, word, cta["epoch"])
        self.done[rank] += 1
        cta["cur"], cta["pos"], cta["next"] = cta["next"], 0, None
        if cta["cur"] is not None:
            self._proceed(cta)
        elif self.done[rank] == self.n:
            self.finished_at[rank].append(self.now)
            if self.epoch[rank] < self.launches:
                self._at(self.now + self.LAUNCH_GAP, self._start_launch, rank)

    def _bump_all(self, word, epoch, source):
        for rank in range(self.ranks):
            if rank != source:
                self._bump(rank, word, epoch)

    def _bump(self, rank, word, epoch):
        self.count[rank][word] += 1
        if self.launches > 1:
            self.by_epoch[rank][word][epoch] += 1
        waiting = self.waiters.get((rank, word))
        if not waiting:
            return
        woken = [(t, c) for t, c in waiting if t <= self.count[rank][word]]
        if woken:
            self.waiters[(rank, word)] = [(t, c) for t, c in waiting if t > self.count[rank][word]]
            for target, cta in woken:
                self._check_epochs(rank, word, cta["epoch"], target, cta["cur"])
                cta["pos"] += 1
                self._proceed(cta)


@pytest.mark.parametrize("name,tp,tokens,sms", SIM_CASES)
def test_simulated_launch_completes_on_every_grid(name, tp, tokens, sms):
    table = table_for(name, tp, tokens, sms)
    sim = LaunchSim(table, ranks=tp, ctas=table.ctas, seed=sms).run()
    assert sim.done == [len(table.tasks)] * tp


@pytest.mark.parametrize("name,tp,tokens,sms", [("kimi-k3", 8, 4, 7), ("small", 8, 16, 100), ("tiny", 2, 16, 1),
                                                ("tiny", 2, 4, 256), ("kimi-k3", 2, 1, 132)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_back_to_back_launches_never_see_a_later_epochs_raises(name, tp, tokens, sms, prefetch):
    """Counters are never cleared: a fast rank's next launch raises into a slow
    rank's flags; no wait may be satisfied by those."""
    table = table_for(name, tp, tokens, sms, prefetch_final=prefetch)
    sim = LaunchSim(table, ranks=tp, ctas=table.ctas, launches=3, seed=tokens).run()
    assert sim.premature == []
    assert all(len(f) == 3 for f in sim.finished_at)


@pytest.mark.parametrize("name,tp,tokens,mla", TABLES)
def test_one_program_walks_the_table_in_order_with_loopback_peers(name, tp, tokens, mla):
    """The interpreter: rank 0 alone, one program, every other rank's pushes
    written beforehand. No wait may find its flag short."""
    table = table_for(name, tp, tokens, 1, mla=mla)
    count = Counter()
    for task in table.tasks:
        for r in task.raises:
            if r.every_rank:
                count[(r.flag, r.index)] += tp - 1
    for task in table.tasks:
        for wait in task.waits:
            assert count[(wait.flag, wait.index)] >= wait.count, (task.ticket, task.kind, wait.flag)
        for r in task.raises:
            count[(r.flag, r.index)] += 1


@pytest.mark.parametrize("name,tp,tokens,sms", [("kimi-k3", 2, 8, 7), ("small", 4, 16, 1), ("tiny", 2, 9, 132)])
def test_launches_with_parts_of_k_complete_and_never_see_a_later_epochs_raises(name, tp, tokens, sms):
    """A split tile's last part waits for its earlier parts (lower tickets) within the task."""
    table = table_for(name, tp, tokens, sms, mla="x_parts")
    last_parts = [t for t in table.tasks if t.kind in (TaskKind.ROUTER, TaskKind.LATENT_DOWN) and t.slot == X_PARTS - 1]
    assert last_parts and all(t.waits[-1].in_task and t.waits[-1].count == X_PARTS - 1 for t in last_parts)
    sim = LaunchSim(table, ranks=tp, ctas=table.ctas, launches=3, seed=tokens).run()
    assert sim.premature == []
    assert all(len(f) == 3 for f in sim.finished_at)


def test_the_simulation_detects_a_deadlocking_order():
    table = table_for("tiny", 1, 1, 1)
    reversed_table = type(table)(**{**table.__dict__, "tasks": tuple(reversed(table.tasks))})
    with pytest.raises(Deadlock):
        LaunchSim(reversed_table, ranks=1, ctas=1).run()


# -- CLI ---------------------------------------------------------------------------------------


def test_cli_plan_prints_a_line_per_group_and_the_summary(capsys):
    """The table printed is the mono launch's at its measured defaults for the S asked."""
    assert main(["plan", "--tokens", "4", "--tp", "8", "--sms", "132"]) == 0
    out = capsys.readouterr().out
    table = plan(preset("kimi-k3"), 8, 4, 132, default_options(4))
    for group in table.groups():
        assert f"{group.tasks[0].ticket}-{group.tasks[-1].ticket}" in out and group.kind.name in out
    summary = table.summary()
    assert f"summary: {summary.tasks} tasks, {table.ctas} CTAs, {summary.weight_bytes / 1e6:.3f} MB" in out
    assert f"{summary.waits} waits" in out
    floor = floor_bytes(preset("kimi-k3"), 8, 4, 64)
    assert f"{floor['total'] / 1e6:.3f} MB" in out


def test_cli_plan_options_and_presets(capsys):
    assert main(["plan", "--tokens", "2", "--tp", "2", "--sms", "7", "--preset", "tiny", "--ctas-per-sm", "1"]) == 0
    out = capsys.readouterr().out
    assert "PREFETCH_FINAL" in out and ", 7 CTAs" in out  # the default prefetch, the CTAs given
    assert main(["plan", "--tokens", "2", "--tp", "2", "--sms", "7", "--preset", "tiny", "--no-prefetch-final",
                 "--down-rows", "8"]) == 0
    out = capsys.readouterr().out
    assert "PREFETCH_FINAL" not in out and "down_rows=8" in out
    assert main(["plan", "--tokens", "6", "--tp", "2", "--sms", "7", "--preset", "tiny", "--final-split",
                 "--prefetch-shared", "--x-token-groups"]) == 0
    out = capsys.readouterr().out
    assert "PREFETCH_SHARED" in out and "LATENT_READY[0]>=12(in task)" in out and "x_token_groups=True" in out
    assert "ROUTER" in out and "tok 0..4" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tokens", "17", "--tp", "8", "--sms", "132"], "tokens"),
        (["--tokens", "0", "--tp", "8", "--sms", "132"], "tokens"),
        (["--tokens", "1", "--tp", "3", "--sms", "132"], "tp"),
        (["--tokens", "1", "--tp", "8", "--sms", "0"], "sms"),
        (["--tokens", "1", "--tp", "8", "--sms", "132", "--preset", "tiny"], "does not divide"),
        (["--tokens", "1", "--tp", "8", "--sms", "132", "--nblocks", "0"], "nblocks"),
        (["--tokens", "1", "--tp", "8", "--sms", "132", "--ctas-per-sm", "0"], "ctas_per_sm"),
    ],
)
def test_cli_plan_bad_value_is_one_line_and_exit_2(args, message, capsys):
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3mono: error:") and message in lines[0]


def test_dense_step_widens_the_gemv_steps_along_k_only_where_the_dims_allow():
    """TileChoice.dense_step_kb (shared_step_kb for the shared gate/up tasks,
    oproj_step_kb for o_proj's) doubles or quadruples a dense task's K step
    (never past the input width rounded up to a power of two), keeps its rows,
    and still streams every weight byte once."""
    cfg = preset("kimi-k3")
    T, H = 8, cfg.hidden_size
    in_dims = {"oproj": cfg.core_width // T, "router": H, "latent_down": H, "shared_gate_up": H,
               "final": max(cfg.routed_expert_hidden_size, cfg.shared_intermediate) // T}
    for tokens in (1, 8):
        base = stage_geometry(cfg, T, tokens)
        for kb in (16, 32):
            widened = dict(dense_step_kb=kb, shared_step_kb=kb, oproj_step_kb=kb)
            wide = stage_geometry(cfg, T, tokens, tiles=TileChoice(**widened))
            for stage, k in in_dims.items():
                b, w = getattr(base, stage), getattr(wide, stage)
                assert w.rows == b.rows, stage
                assert w.block_k == min(b.block_k * kb // 8, 1 << (k - 1).bit_length()), stage
            for own, stage in (("shared_step_kb", "shared_gate_up"), ("oproj_step_kb", "oproj")):
                alone = stage_geometry(cfg, T, tokens, tiles=TileChoice(**{own: kb}))
                assert getattr(alone, stage) == getattr(wide, stage), own
                assert [getattr(alone, s) for s in in_dims if s != stage] == [
                    getattr(base, s) for s in in_dims if s != stage], own
            table = plan(cfg, T, tokens, 132, MonoOptions(tiles=TileChoice(**widened)))
            streamed = lambda t: sorted(s for task in t.tasks for s in task.streams)  # noqa: E731
            assert streamed(table) == streamed(plan(cfg, T, tokens, 132))
    assert stage_geometry(cfg, T, 1, tiles=TileChoice(oproj_step_kb=32)).oproj.block_k == 2048  # K = C/T: one step
    for field in ("dense_step_kb", "shared_step_kb", "oproj_step_kb"):
        with pytest.raises(K3InputError, match=field):
            plan(cfg, T, 1, 132, MonoOptions(tiles=TileChoice(**{field: 12})))


@pytest.mark.parametrize("kind, field", [(TaskKind.EXPERT_GU, "gate_up_rows"), (TaskKind.EXPERT_DOWN, "down_rows")])
@pytest.mark.parametrize("rows", [8, 16])
def test_fewer_expert_rows_make_more_expert_tasks_over_the_same_bytes(rows, kind, field):
    """TileChoice.gate_up_rows / down_rows: 32 / rows times that kind's MXFP4
    tasks at S = 1, TP8 (the other kind's unchanged), each step as many bytes
    (as many times more groups), the same weight bytes streamed, and the
    launch's waits still name lower tickets (plan checks the invariant)."""
    cfg = preset("kimi-k3")
    tiles = TileChoice(**{field: rows})
    base, narrow = plan(cfg, 8, 1, 132), plan(cfg, 8, 1, 132, MonoOptions(tiles=tiles))
    other = TaskKind.EXPERT_DOWN if kind == TaskKind.EXPERT_GU else TaskKind.EXPERT_GU
    count = lambda t, k: sum(task.kind == k for task in t.tasks)  # noqa: E731
    assert count(narrow, kind) == count(base, kind) * 32 // rows
    assert count(narrow, other) == count(base, other)
    stage = "expert_gate_up" if kind == TaskKind.EXPERT_GU else "expert_down"
    b, n = getattr(base.geometry, stage), getattr(narrow.geometry, stage)
    assert (n.rows, b.rows) == (rows, 32)
    assert n.rows * n.block_k == b.rows * b.block_k == 32 * 16 * 32  # 16 groups of 32 rows a step
    streamed = lambda t: sum(b for task in t.tasks for _, b in task.streams)  # noqa: E731
    assert streamed(narrow) == streamed(base)
    with pytest.raises(K3InputError, match=field):
        plan(cfg, 8, 1, 132, MonoOptions(tiles=TileChoice(**{field: 12})))


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_router_rows_set_the_router_tasks_over_the_same_step_bytes(rows):
    """TileChoice.router_rows (FMA path): rows / 2 times fewer router tasks than
    the default 2 rows at S = 1, TP8, each step as many bytes (a shorter K step),
    the same bytes streamed; the tl.dot path (S = 8) keeps its 16-row tile."""
    cfg = preset("kimi-k3")
    options = MonoOptions(tiles=TileChoice(router_rows=rows))
    base, narrow = plan(cfg, 8, 1, 132), plan(cfg, 8, 1, 132, options)
    count = lambda t: sum(task.kind == TaskKind.ROUTER for task in t.tasks)  # noqa: E731
    assert base.geometry.router.rows == 2 and count(base) == 56
    assert count(narrow) == count(base) * 2 // rows
    b, n = base.geometry.router, narrow.geometry.router
    assert n.rows * n.block_k == b.rows * b.block_k
    streamed = lambda t: sum(b for task in t.tasks for _, b in task.streams)  # noqa: E731
    assert streamed(narrow) == streamed(base)
    assert plan(cfg, 8, 8, 132, options).geometry.router == plan(cfg, 8, 8, 132).geometry.router
    with pytest.raises(K3InputError, match="router_rows"):
        plan(cfg, 8, 1, 132, MonoOptions(tiles=TileChoice(router_rows=3)))


@pytest.mark.parametrize("field,kind,tile,consumer,flag,raises", [
    ("latent_rows", TaskKind.LATENT_DOWN, "latent_down", TaskKind.EXPERT_GU, Flag.Z, 8),
    ("shared_rows", TaskKind.SHARED_GU, "shared_gate_up", TaskKind.FINAL, Flag.SHARED_READY, 1),
])
@pytest.mark.parametrize("rows", [2, 4])
def test_latent_and_shared_rows_set_their_tasks_over_the_same_step_bytes(field, kind, tile, consumer, flag, raises,
                                                                          rows):
    """TileChoice.latent_rows / shared_rows (FMA path): 8 / rows times the latent
    down / shared gate/up tasks of the default at S = 1, TP8, each step as many
    bytes, the same bytes streamed, their consumer (the gate/up tasks, z raised on
    every rank; FINAL) waiting for all of them; the tl.dot path (S = 8) keeps its tile."""
    cfg = preset("kimi-k3")
    options = MonoOptions(tiles=TileChoice(**{field: rows}))
    base, narrow = plan(cfg, 8, 1, 132), plan(cfg, 8, 1, 132, options)
    tasks = lambda t: [task for task in t.tasks if task.kind == kind]  # noqa: E731
    assert getattr(base.geometry, tile).rows == 8 and len(tasks(base)) in (56, 96)
    assert len(tasks(narrow)) == len(tasks(base)) * 8 // rows
    b, n = getattr(base.geometry, tile), getattr(narrow.geometry, tile)
    assert n.rows * n.block_k == b.rows * b.block_k
    streamed = lambda t: sum(b for task in t.tasks for _, b in task.streams)  # noqa: E731
    assert streamed(narrow) == streamed(base)
    waiter = next(task for task in narrow.tasks if task.kind == consumer)
    assert any(wait.flag == flag and wait.count == raises * len(tasks(narrow)) for wait in waiter.waits)
    assert getattr(plan(cfg, 8, 8, 132, options).geometry, tile) == getattr(plan(cfg, 8, 8, 132).geometry, tile)
    with pytest.raises(K3InputError, match=field):
        plan(cfg, 8, 1, 132, MonoOptions(tiles=TileChoice(**{field: 16})))


@pytest.mark.parametrize("tokens,base_rows", [(1, 8), (8, 16)])
@pytest.mark.parametrize("rows", [16, 32])
def test_oproj_and_final_rows_set_their_tasks_over_the_same_step_bytes(tokens, base_rows, rows):
    """TileChoice.oproj_rows / final_rows: rows / base_rows times fewer o_proj
    (and FINAL) tasks than the default at TP8 (8 rows on the FMA path, 16 on the
    tl.dot path), each step as many bytes (a shorter K step), the same bytes
    streamed, every other kind's tasks unchanged; each knob moves its kind only."""
    cfg = preset("kimi-k3")
    base = plan(cfg, 8, tokens, 132)
    for knob, kind, tile in (("oproj_rows", TaskKind.OPROJ, "oproj"), ("final_rows", TaskKind.FINAL, "final")):
        wide = plan(cfg, 8, tokens, 132, MonoOptions(tiles=TileChoice(**{knob: rows})))
        b, w = getattr(base.geometry, tile), getattr(wide.geometry, tile)
        assert (b.rows, w.rows) == (base_rows, rows) and w.rows * w.block_k == b.rows * b.block_k
        count = lambda t, k: sum(task.kind == k for task in t.tasks)  # noqa: E731
        assert count(base, kind) == cfg.hidden_size // base_rows and count(wide, kind) == cfg.hidden_size // rows
        others = [k for k in TaskKind if k not in (kind, TaskKind.REDUCE1, TaskKind.REDUCE3)]
        assert all(count(wide, k) == count(base, k) for k in others), knob
        streamed = lambda t: sum(b for task in t.tasks for _, b in task.streams)  # noqa: E731
        assert streamed(wide) == streamed(base)
    with pytest.raises(K3InputError, match="final_rows"):
        plan(cfg, 8, 1, 132, MonoOptions(tiles=TileChoice(final_rows=12)))


@pytest.mark.parametrize("name,chunks,parts,latent_parts", [("kimi-k3", 14, 7, 7), ("tiny", 2, 2, 2),
                                                             ("small", 2, 2, 2)])
@pytest.mark.parametrize("tokens", [1, 16])
def test_seam_route_and_latent_norm_spread_each_token_over_ctas(name, chunks, parts, latent_parts, tokens):
    """The seam's mix and norm are a task per (token, chunk of H), after the
    REDUCE1 tasks that score its token (a task per (tile, token)); the route's
    first step a task per (token, part of the experts), the latent norm's a task
    per (token, part of L) after every rank's down-projection of its token; each
    next step waits for all of its own token's tasks and no other's (the small
    presets too have several)."""
    table = table_for(name, 1, tokens)
    by_kind = {}
    for task in table.tasks:
        by_kind.setdefault(task.kind, []).append(task)
    for kind in (TaskKind.SEAM_MIX, TaskKind.SEAM_NORM):
        assert len(by_kind[kind]) == tokens * chunks
        assert {t.span for t in by_kind[kind] if t.token == 0} == {
            (lo, min(lo + table.geometry.seam_cols, table.cfg.hidden_size))
            for lo in range(0, table.cfg.hidden_size, table.geometry.seam_cols)}
    reduce1 = by_kind[TaskKind.REDUCE1]
    tiles = {(lo, min(lo + table.geometry.score_cols, table.cfg.hidden_size))
             for lo in range(0, table.cfg.hidden_size, table.geometry.score_cols)}
    assert sorted((t.span, t.token) for t in reduce1) == sorted((span, s) for span in tiles for s in range(tokens))
    for task in by_kind[TaskKind.SEAM_MIX]:
        (wait,) = task.waits
        assert (wait.flag, wait.index, wait.count) == (Flag.P_READY, task.token, len(tiles))
        assert set(wait.sources) == {t.ticket for t in reduce1 if t.token == task.token}
    assert len(by_kind[TaskKind.ROUTE_PART]) == tokens * parts and len(by_kind[TaskKind.ROUTE]) == tokens
    L, part_cols = table.cfg.routed_expert_hidden_size, table.geometry.latent_part
    assert len(by_kind[TaskKind.LATENT_PART]) == tokens * latent_parts
    assert {t.span for t in by_kind[TaskKind.LATENT_PART] if t.token == 0} == {
        (lo, min(lo + part_cols, L)) for lo in range(0, L, part_cols)}
    down = by_kind[TaskKind.EXPERT_DOWN]
    for task in by_kind[TaskKind.LATENT_PART]:
        (wait,) = task.waits
        assert (wait.flag, wait.index) == (Flag.AR2, task.token)
        assert set(wait.sources) == {t.ticket for t in down if t.token == task.token}
    parts_done = {t.ticket for t in by_kind[TaskKind.LATENT_PART]}
    for task in by_kind[TaskKind.FINAL]:
        latent_wait = task.waits[-1]
        assert (latent_wait.flag, latent_wait.count) == (Flag.LATENT_READY, tokens * latent_parts)
        assert set(latent_wait.sources) == parts_done
    for step, flag, producers in ((TaskKind.SEAM_NORM, Flag.MIXED, chunks), (TaskKind.ROUTE, Flag.RANKED, parts)):
        for task in by_kind[step]:
            (wait,) = task.waits
            assert (wait.flag, wait.index, wait.count) == (flag, task.token, producers)
            assert {table.tasks[s].token for s in wait.sources} == {task.token}
    x_written = by_kind[TaskKind.LATENT_DOWN][0].waits[0]
    assert (x_written.flag, x_written.count) == (Flag.X_READY, tokens * chunks)
    # a single token's router tasks form x from h (StageGeometry.router_rms): they wait for the mix only
    router_waits = {(w.flag, w.count, w.sources) for t in by_kind[TaskKind.ROUTER] for w in t.waits}
    mixes = tuple(t.ticket for t in by_kind[TaskKind.SEAM_MIX])
    assert table.geometry.router_rms == (tokens == 1)
    assert router_waits == ({(Flag.MIXED, chunks, mixes)} if tokens == 1 else {(x_written.flag, x_written.count,
                                                                                  x_written.sources)})
