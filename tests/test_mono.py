"""The mono launch (one persistent kernel per rank) under the interpreter.

T = 1 runs the whole table; T > 1 runs every rank in loopback (its launch
alone, the other ranks' pushes pre-written from a staged run, its own slots
poisoned). Routes must equal the bf16 TP reference's, errors against the
float64 oracle stay within twice the bf16 reference's own, every rank holds
the same bits, and the launch reproduces the staged driver bit for bit (the
same task functions on the same data).
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch
import triton

from k3mono.config import preset
from k3mono.errors import K3InputError
from k3mono.mono import (DEFAULT_TILES, EVICT_FIRST_MAX_TOKENS, FOLDED_M1C_CTAS_PER_SM, SINGLE_TOKEN_DOWN_ROWS,
                         SINGLE_TOKEN_LATENT_ROWS, WIDE_DOWN_MIN_TOKENS, WIDE_DOWN_ROWS, WIDE_DOWN_STEP_KB,
                         SINGLE_TOKEN_ROUTER_ROWS, SINGLE_TOKEN_SHARED_STEP_KB, WIDE_OPROJ_MAX_TOKENS,
                         WIDE_OPROJ_STEP_KB,
                         MonoBuild, MonoRunner, MonoTimeout, build, buffer_bytes, default_options, default_options_with,
                         default_tiles, mono_key, parse_option_fields,
                         peer_regions, scratch_regions)
from k3mono.layout import ROUTE_PART_ROWS
from k3mono.mxfp4 import mma_order
from k3mono.kernels import mono as mono_kernels
from k3mono.planner import (COL, MAX_WAITS, MONO_WARPS, SM_REGISTERS, M1bShape, M1cShape, MonoOptions, TaskKind,
                            TileChoice, expert_mma_tile, next_pow2)
from k3mono.reference import layer_post_tp
from k3mono.runner import error_and_budget
from k3mono.staged import StagedLayer
from k3mono.synthetic import random_inputs, random_layer
from k3mono.weights import experts_in_f16_order_, shard_all

NAMES = ("moe_out", "prefix", "route_ids", "route_weights")


@functools.lru_cache(maxsize=None)
def layer_weights(preset_name: str = "tiny", seed: int = 0):
    return random_layer(preset(preset_name), seed)


def bits(t):
    return t.view(torch.uint8) if t.is_floating_point() else t


def same_bits(a, b) -> bool:
    return all(torch.equal(bits(getattr(a, n)), bits(getattr(b, n))) for n in NAMES)


def check_against_reference(cfg, shards, inputs, layer, got):
    ref = layer_post_tp(**inputs, layer=layer, shards=shards, cfg=cfg)
    assert torch.equal(got.route_ids, ref.route_ids), "routes differ from the bf16 TP reference"
    exact = layer_post_tp(**inputs, layer=layer, shards=shards, cfg=cfg, mode="oracle", forced_routes=got.route_ids)
    for name in ("moe_out", "prefix", "route_weights"):
        out = getattr(got, name)
        assert torch.isfinite(out.float()).all(), name
        err, budget = error_and_budget(out, getattr(ref, name), getattr(exact, name))
        assert err <= budget, f"{name}: error {err:.3g} against the oracle, budget {budget:.3g}"


def assert_staged_bits(runner, cfg, shards, tokens, layer, inputs, tp):
    """The staged path at the runner's tiles (in loopback, the one that wrote the
    other ranks' pushes) has the runner's geometry and gives its bits on every rank: that layer."""
    staged = runner._staged if tp > 1 else StagedLayer(cfg, shards, tokens, layer, tiles=runner.key.tiles)
    if tp == 1:
        staged(**inputs)
    assert staged.geom == runner.compiled.table.geometry
    for rank in range(tp):
        assert same_bits(runner.result(rank), staged.result(rank)), f"rank {rank}: mono and staged differ"
    return staged


CASES = [(1, 1, 1), (1, 3, 13), (1, 16, 92), (4, 3, 13)]


@pytest.mark.parametrize("tp,tokens,layer", CASES, ids=[f"T{t}-S{s}-L{l}" for t, s, l in CASES])
def test_mono_matches_the_reference_and_staged(tp, tokens, layer):
    cfg = preset("tiny")
    shards = shard_all(layer_weights(), cfg, tp)
    inputs = random_inputs(cfg, tokens, layer, seed=300 + 7 * tp + tokens, nb_max=cfg.num_blocks(layer) + 1)
    before = inputs["prefix"].clone()
    runner = MonoRunner(cfg, shards, tokens, layer)
    assert runner.loopback == (tp > 1)
    got = runner(**inputs)
    assert torch.equal(inputs["prefix"], before), "the caller's prefix must not be modified"
    assert got.route_ids.dtype == torch.int64 and got.route_weights.dtype == torch.float32
    check_against_reference(cfg, shards, inputs, layer, got)
    for rank, other in enumerate(runner.rank_results()):
        assert same_bits(got, other), f"rank {rank} differs from rank 0"
    assert_staged_bits(runner, cfg, shards, tokens, layer, inputs, tp)
    assert runner.epoch() == 2 and runner.ctl(0).tolist() == [0, 0]


def _waited_counts(runner) -> dict:
    """flag word -> raises per launch (what a wait on it expects, per epoch)."""
    rows = runner.compiled.rows
    counts = {}
    for i in range(2):
        for word, count in zip(rows[:, COL[f"wait{i}_word"]].tolist(), rows[:, COL[f"wait{i}_count"]].tolist()):
            if word >= 0:
                assert counts.setdefault(word, count) == count
    return counts


def test_two_launches_flip_parity_without_host_reset():
    cfg, tp, tokens, layer = preset("tiny"), 2, 1, 13
    shards = shard_all(layer_weights(), cfg, tp)
    a = random_inputs(cfg, tokens, layer, seed=11)
    b = random_inputs(cfg, tokens, layer, seed=12)
    runner = MonoRunner(cfg, shards, tokens, layer)
    counts = _waited_counts(runner)
    first = runner(**a)
    check_against_reference(cfg, shards, a, layer, first)
    for r in range(tp):  # epoch 1 used parity 1: the own slots of parity 0 are still poisoned
        assert torch.isfinite(runner.parity_views(r, 1)["ar1"][r]).all()
        assert torch.isnan(runner.parity_views(r, 0)["ar1"][r]).all()
        assert runner.epoch(r) == 2 and runner.ctl(r).tolist() == [0, 0]
        flags = runner.flags(r).tolist()
        assert all(flags[w] == 1 * c for w, c in counts.items())
    second = runner(**b)  # epoch 2: no reset, no host work on flags or counters
    check_against_reference(cfg, shards, b, layer, second)
    fresh = MonoRunner(cfg, shards, tokens, layer)(**b)
    assert same_bits(second, fresh)
    for r in range(tp):
        assert torch.isfinite(runner.parity_views(r, 0)["ar1"][r]).all()
        assert runner.epoch(r) == 3 and runner.ctl(r).tolist() == [0, 0]
        flags = runner.flags(r).tolist()
        assert all(flags[w] == 2 * c for w, c in counts.items())
        assert runner.health[r].tolist()[0] == 0


def test_layers_take_turns_on_one_set_of_buffers():
    """An engine holds one set of buffers a rank per token count, not one a layer
    (MonoRank.for_layer): two layers of other weights and AttnRes candidate pads
    alternate on it, with no host work on flags or counters between them, each
    right against its own reference, the epoch and the flags counting every
    launch whichever layer ran it, the parities alternating across layers."""
    cfg, tp, tokens = preset("tiny"), 2, 1
    layers = {13: shard_all(layer_weights(), cfg, tp), 92: shard_all(layer_weights(seed=1), cfg, tp)}
    first = MonoRunner(cfg, layers[13], tokens, 13)
    second = first.for_layer(92, layers[92])
    assert second.key.cands != first.key.cands and second.compiled.table.tasks == first.compiled.table.tasks
    for a, b in zip(first.rank_states, second.rank_states):
        assert b.buffers is a.buffers and b.out is not a.out
    counts = _waited_counts(first)
    outs = []
    for launch, (runner, layer) in enumerate([(first, 13), (second, 92), (first, 13)], start=1):
        inputs = random_inputs(cfg, tokens, layer, seed=40 + launch, nb_max=cfg.num_blocks(layer) + 1)
        got = runner(**inputs)
        check_against_reference(cfg, layers[layer], inputs, layer, got)
        outs.append((runner.rank_states[0].out, got.moe_out))
        assert all(torch.equal(bits(out), bits(want)) for out, want in outs[-2:]), "a layer's out was overwritten"
        for r in range(tp):
            assert first.epoch(r) == second.epoch(r) == launch + 1
            assert torch.isfinite(runner.parity_views(r, launch & 1)["ar1"][r]).all()
            flags = first.flags(r).tolist()
            assert all(flags[w] == launch * c for w, c in counts.items())


def test_a_layer_for_other_buffers_is_refused_before_any_launch(mono_launches):
    """for_layer takes that layer's shard of the same rank, on the same device."""
    cfg, tokens = preset("tiny"), 1
    runner = MonoRunner(cfg, shard_all(layer_weights(), cfg, 2), tokens, 13)
    other = shard_all(layer_weights(seed=1), cfg, 2)
    with pytest.raises(K3InputError, match=r"^shards\[1\]: expected rank 1 of 2, got rank 0 of 2"):
        runner.for_layer(92, [other[0], other[0]])
    with pytest.raises(K3InputError, match=r"^shard: expected rank 0 of 2, got rank 1 of 2"):
        runner.rank_states[0].for_layer(92, other[1])
    with pytest.raises(K3InputError, match=r"^layer: expected an MoE layer"):
        runner.rank_states[0].for_layer(0, other[0])
    with pytest.raises(K3InputError, match=r"^weights.router_bias: expected"):
        runner.rank_states[0].for_layer(92, replace(other[0], router_bias=other[0].router_bias[:-1]))
    with pytest.raises(K3InputError, match=r"^shard.o_proj: expected device cpu \(as the rank's buffers\), got meta"):
        runner.rank_states[0].for_layer(92, replace(other[0], o_proj=other[0].o_proj.to("meta")))
    assert len(mono_launches) == 0


def test_a_timeout_breaks_every_layer_on_its_buffers():
    """The flags a failed wait leaves behind are every layer's: another layer's
    rank on the same buffers refuses to launch until reset()."""
    runner = _rank_zero_alone()
    cfg = runner.cfg
    later = runner.for_layer(92, shard_all(layer_weights(seed=1), cfg, 2))
    with pytest.raises(MonoTimeout):
        runner.check_health()
    with pytest.raises(RuntimeError, match=r"mono rank 0: broken by an earlier timeout \(rank 0 layer 13 "):
        later.launch(0)
    later.reset()
    assert runner.rank_states[0].buffers.broken is None and runner.epoch(0) == 1


def test_a_rank_bound_to_the_callers_tensors_launches_with_no_copies():
    """An engine's activation tensors bound once (MonoRank.bind): the launch reads
    its core in place, updates its prefix in place and writes its out, the bits
    of the runner's launch on copies."""
    cfg, tokens, layer = preset("tiny"), 3, 13
    shards = shard_all(layer_weights(), cfg, 1)
    inputs = random_inputs(cfg, tokens, layer, seed=21, nb_max=cfg.num_blocks(layer) + 2)
    want = MonoRunner(cfg, shards, tokens, layer)(**inputs)
    rank = MonoRunner(cfg, shards, tokens, layer).rank_states[0]
    core, prefix, blocks = (inputs[name].clone() for name in ("core", "prefix", "blocks"))
    out = torch.full((tokens, cfg.hidden_size), float("nan"), dtype=torch.bfloat16)
    rank.bind(core, prefix, blocks, out)
    rank.launch()
    rank.check_health()
    assert torch.equal(bits(out), bits(want.moe_out)) and torch.equal(bits(prefix), bits(want.prefix))
    assert rank.core is core and torch.equal(core, inputs["core"]) and rank.out is out


def test_bound_tensors_are_checked_before_any_launch(mono_launches):
    cfg, tokens, layer = preset("tiny"), 2, 13
    shards = shard_all(layer_weights(), cfg, 2)
    rank = MonoRunner(cfg, shards, tokens, layer).rank_states[1]
    inputs = random_inputs(cfg, tokens, layer, seed=22)
    width, H = cfg.core_width // 2, cfg.hidden_size
    good = dict(core=inputs["core"][:, width:], prefix=inputs["prefix"], blocks=inputs["blocks"],
                out=torch.empty(tokens, H, dtype=torch.bfloat16))
    rank.bind(**good)
    assert rank.core.data_ptr() == inputs["core"][:, width:].data_ptr()
    for bad, message in [
        (dict(core=inputs["core"]), rf"^core: expected shape \[{tokens}, {width}\], got \[{tokens}, {2 * width}\]"),
        (dict(prefix=inputs["prefix"][:1]), rf"^prefix: expected shape \[{tokens}, {H}\]"),
        (dict(out=good["out"].float()), r"^out: expected dtype torch.bfloat16, got torch.float32"),
        (dict(out=torch.empty(H, tokens, dtype=torch.bfloat16).t()), r"^out: expected unit stride along the last dim"),
        (dict(blocks=inputs["blocks"][:, :1]), r"^blocks: expected at least 2 AttnRes blocks for layer 13"),
        (dict(prefix=good["prefix"].to("meta")), r"^prefix: expected device cpu \(as the rank's buffers\), got meta"),
        (dict(out=good["prefix"]), r"^prefix: expected memory of its own, got bytes within out's span"),
        (dict(out=inputs["blocks"][:, 0]), r"^out: expected memory of its own, got bytes within blocks's span"),
    ]:
        with pytest.raises(K3InputError, match=message):
            rank.bind(**dict(good, **bad))
    mla = MonoRunner(cfg, shards, tokens, layer, options=MonoOptions(m1b=M1bShape(splits=3, latent=32)))
    with pytest.raises(K3InputError, match="runs M1b and writes core itself"):
        mla.rank_states[0].bind(**good)
    assert len(mono_launches) == 0


def _rank_zero_alone() -> MonoRunner:
    """T = 2 without loopback, rank 0 launched alone: rank 1's AR1 pushes never come."""
    cfg, tp, tokens, layer = preset("tiny"), 2, 1, 13
    runner = MonoRunner(cfg, shard_all(layer_weights(), cfg, tp), tokens, layer, loopback=False, spin_limit=8)
    runner.load_inputs(**random_inputs(cfg, tokens, layer, seed=5))
    runner.poison()
    runner.launch(0)
    return runner


def test_a_wait_that_cannot_be_met_is_a_clear_error():
    """Rank 0 launched alone (_rank_zero_alone)."""
    runner = _rank_zero_alone()
    with pytest.raises(MonoTimeout, match=r"rank 0 layer 13 .*REDUCE1 tile 0.* flag AR1\[0\].*expected \d+, seen \d+"):
        runner.check_health()
    assert runner.ctl(0).tolist() == [0, 0], "the stopped launch still resets its ticket counter"
    with pytest.raises(RuntimeError, match="broken"):
        runner.launch(0)
    with pytest.raises(K3InputError, match="loopback"):
        runner.reset()
        runner.run()
    runner.reset()
    assert runner.flags(0).abs().sum() == 0 and runner.epoch(0) == 1


def test_a_timeout_downstream_of_a_stalled_exchange_still_names_the_missing_rank():
    """On the GPU every wait has the same bound, so a wait on a local flag that the
    stalled reduce would have raised can be the one on record; the host still names
    the first exchange missing a push. The interpreter's one program always fails at
    the exchange itself, so the record is rewritten to the downstream wait."""
    from k3mono.kernels import sync
    from k3mono.planner import Flag

    runner = _rank_zero_alone()
    table = runner.rank_states[0].compiled.table
    ticket = next(i for i, t in enumerate(table.tasks) if t.kind == TaskKind.LATENT_DOWN)
    runner.health[0][sync.H_TICKET] = ticket
    runner.health[0][sync.H_WORD] = table.flag_word(Flag.X_READY, 0)
    with pytest.raises(MonoTimeout, match=r"LATENT_DOWN .*flag X_READY\[0\].*exchange ar1: nothing arrived from rank\(s\) \[1\]"):
        runner.check_health()


def test_the_launch_options_change_no_bits():
    cfg, tokens, layer = preset("tiny"), 1, 1
    shards = shard_all(layer_weights(), cfg, 1)
    inputs = random_inputs(cfg, tokens, layer, seed=21)
    plain = MonoRunner(cfg, shards, tokens, layer, prefetch=0, options=MonoOptions())(**inputs)
    for options in (MonoOptions(prefetch_final=True, route_early=True),
                    MonoOptions(shared_late=True, expert_evict_first=True, final_split=True, prefetch_shared=True,
                                prefetch_final=True, prefetch_final_early=True),
                    MonoOptions(route_early=True, prefetch_gate_up=True, prefetch_down=True)):
        eager = MonoRunner(cfg, shards, tokens, layer, prefetch=2, options=options)
        kinds = [task.kind for task in eager.compiled.table.tasks]
        assert (TaskKind.PREFETCH_FINAL in kinds) == options.prefetch_final
        assert kinds.index(TaskKind.ROUTE) < kinds.index(TaskKind.SHARED_GU)
        assert (kinds.index(TaskKind.EXPERT_GU) < kinds.index(TaskKind.SHARED_GU)) == options.shared_late
        assert (TaskKind.PREFETCH_SHARED in kinds) == options.prefetch_shared
        assert same_bits(plain, eager(**inputs))


def test_final_split_in_loopback_changes_no_bits():
    """MonoOptions.final_split at T = 2 (loopback) and S = 3: FINAL's shared
    down-projection before its own wait for the latent, the same sums."""
    cfg, tp, tokens, layer = preset("tiny"), 2, 3, 13
    shards = shard_all(layer_weights(), cfg, tp)
    inputs = random_inputs(cfg, tokens, layer, seed=23)
    plain = MonoRunner(cfg, shards, tokens, layer)(**inputs)
    split = MonoRunner(cfg, shards, tokens, layer, options=default_options(tokens, final_split=True))
    finals = cfg.hidden_size // split.compiled.table.geometry.final.rows
    assert split.compiled.rows[:, COL["late_waits"]].sum() == finals
    assert same_bits(plain, split(**inputs))


def test_default_options_with_sets_tile_and_option_fields_from_command_line_pairs():
    """mono.default_options_with / parse_option_fields: the benchmarks' NAME=INTEGER
    pairs set TileChoice fields and OPTION_FIELDS (0 / 1 for a bool), the rest
    staying default_options'; anything else is refused before any launch."""
    fields = parse_option_fields(["x_token_groups=1", "final_split=1", "shared_late=0", "down_rows=32"])
    assert fields == {"x_token_groups": 1, "final_split": 1, "shared_late": 0, "down_rows": 32}
    got = default_options_with(1, fields)
    assert got.tiles.x_token_groups is True and got.final_split is True and got.shared_late is False
    assert got.tiles.down_rows == 32 and got.tiles.shared_step_kb == SINGLE_TOKEN_SHARED_STEP_KB
    assert replace(got, final_split=False, shared_late=True, tiles=default_tiles(1)) == default_options(1)
    assert default_options_with(8, {}) == default_options(8)
    for bad in (["final_split"], ["final_split=yes"], ["=1"]):
        with pytest.raises(K3InputError, match="NAME=INTEGER"):
            parse_option_fields(bad)
    with pytest.raises(K3InputError, match="neither a TileChoice field"):
        default_options_with(1, {"m1b": 1})


def test_the_kernels_table_columns_and_kind_codes_are_the_planners():
    for name, column in (("C_KIND", "kind"), ("C_TILE", "tile"), ("C_START", "start"), ("C_STOP", "stop"),
                         ("C_TOKEN", "token"), ("C_SLOT", "slot"), ("C_NWAITS", "num_waits"),
                         ("C_NADDR", "addr_waits"), ("C_WAIT0", "wait0_word"), ("C_RAISE", "raise_word"),
                         ("C_RAISE_PEER", "raise_peer"), ("C_LATE", "late_waits")):
        assert getattr(mono_kernels, name).value == COL[column], name
    assert mono_kernels.MAX_WAITS.value == MAX_WAITS
    for kind in TaskKind:
        assert getattr(mono_kernels, f"K_{kind.name}").value == kind.value, kind.name


def test_an_unknown_prefetch_mode_is_refused_before_any_build():
    cfg = preset("tiny")
    shards = shard_all(layer_weights(), cfg, 1)
    with pytest.raises(ValueError, match="prefetch: expected one of"):
        MonoRunner(cfg, shards, 1, 1, prefetch=3)


def test_the_launch_stays_inside_its_buffers():
    """Guard bands around every buffer of the rank keep their pattern."""
    cfg, tokens, layer = preset("tiny"), 3, 13
    shards = shard_all(layer_weights(), cfg, 1)
    runner = MonoRunner(cfg, shards, tokens, layer)
    buffers = runner.rank_states[0].buffers
    guards = []
    for name in ("own", "scratch"):
        n = getattr(buffers, name).numel()
        big = torch.full((n + 2048,), 0xA5, dtype=torch.uint8)
        big[1024 : 1024 + n] = 0
        setattr(buffers, name, big[1024 : 1024 + n])
        guards.append((name, big, n))
    buffers.peers = [buffers.own]
    runner(**random_inputs(cfg, tokens, layer, seed=8))
    for name, big, n in guards:
        assert (big[:1024] == 0xA5).all() and (big[1024 + n :] == 0xA5).all(), name


@pytest.mark.parametrize("preset_name,tp,tokens", [("tiny", 1, 1), ("tiny", 2, 16), ("tiny", 4, 3), ("kimi-k3", 8, 16)])
@pytest.mark.parametrize("loopback", [False, True])
def test_layout_regions_are_disjoint_and_hold_every_access(preset_name, tp, tokens, loopback):
    cfg = preset(preset_name)
    key = MonoBuild(cfg=cfg, tokens=tokens, tp=tp, loopback=loopback, sms=132)
    c = build(key)
    k = c.consts

    def disjoint(regions):
        spans = sorted((off, off + n, name) for name, (off, n) in regions.items() if name != "__end__")
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            assert a1 <= b0, f"{an} overlaps {bn}"
        assert spans[0][0] >= 0 and spans[-1][1] <= regions["__end__"][0]
        assert all(off % 256 == 0 for off, _, _ in spans)

    peer = peer_regions(key, c.table.num_flag_words)
    scratch = scratch_regions(key)
    disjoint(peer)
    disjoint(scratch)
    half = peer["parity0"][1]
    H, E, L, S = cfg.hidden_size, cfg.num_experts, cfg.routed_expert_hidden_size, tokens
    # the kernel's element offsets and extents (ar slots [T, S, *], logits [S, E], z [S, L])
    accesses = {
        "ar1": (k["AR1_F"] * 4, tp * S * H * 4),
        "logits": (k["LOG_F"] * 4, S * E * 4),
        "z": (k["Z_B"] * 2, S * L * 2),
        "ar2": (k["AR2_F"] * 4, tp * S * L * 4),
        "ar3": (k["AR3_F"] * 4, tp * S * H * 4),
    }
    for parity in (0, 1):
        for name, (off, n) in accesses.items():
            lo = parity * k["PAR_F"] * 4 + off
            assert peer[f"parity{parity}"][0] <= lo and lo + n <= peer[f"parity{parity}"][0] + half, name
    assert k["PAR_F"] * 4 == half == k["PAR_B"] * 2
    flag_lo = k["FLAG_I"] * 4
    assert flag_lo == peer["flags"][0] and flag_lo + 4 * c.table.num_flag_words <= buffer_bytes(peer)
    rows = c.rows
    for col in ("wait0_word", "wait1_word", "raise_word"):
        words = rows[:, COL[col]]
        assert int(words.max()) < c.table.num_flag_words and int(words.min()) >= -1
    I_R, SI_R, K = cfg.moe_intermediate_size // tp, cfg.shared_intermediate // tp, cfg.num_experts_per_token
    scratch_access = {
        "x": (k["X_B"] * 2, S * H * 2),
        "route_ids": (k["IDS_I"] * 4, S * K * 4),
        "route_w": (k["RW_F"] * 4, S * K * 4),
        "route_keys": (k["RK_I"] * 4, S * -(-E // k["RC"]) * ROUTE_PART_ROWS * triton.next_power_of_2(K) * 8),
        "expert_act": (k["ACT_B"] * 2, S * K * I_R * 2),
        "latent": (k["LAT_B"] * 2, S * (L // tp) * 2),
        "shared_act": (k["SACT_B"] * 2, S * SI_R * 2),
        "seam_part": (k["SPART_F"] * 4, S * -(-H // k["SCORE_COLS"]) * 2 * k["CP"] * 4),
        "seam_h": (k["SH_B"] * 2, S * H * 2),
        "seam_hsq": (k["SHSQ_F"] * 4, S * -(-H // k["SC"]) * 4),
        "ctl": (k["CTL_I"] * 4, 8),
    }
    assert k["CANDS"] <= k["CP"]
    for name, (off, n) in scratch_access.items():
        assert scratch[name] == (off, n), name
    # loopback divides the peer waits by T; the counts stay whole
    if loopback and tp > 1:
        full = build(MonoBuild(cfg=cfg, tokens=tokens, tp=tp, loopback=False, sms=132)).rows
        ratio = full[:, COL["wait0_count"]].float() / rows[:, COL["wait0_count"]].clamp_min(1).float()
        assert set(ratio.unique().tolist()) <= {0.0, 1.0, float(tp)}
    assert math.prod(rows.shape) > 0


def test_defaults_take_fewer_down_rows_and_the_shared_tasks_late_at_one_token_only():
    """The measured defaults (mono.default_options): the expert loops summing in f16
    at every S; S = 1 takes SINGLE_TOKEN_DOWN_ROWS down rows, SINGLE_TOKEN_ROUTER_ROWS
    router and SINGLE_TOKEN_LATENT_ROWS latent rows, SINGLE_TOKEN_SHARED_STEP_KB a shared step and SHARED_GU after
    EXPERT_GU, every other S DEFAULT_TILES (from WIDE_DOWN_MIN_TOKENS with the
    wide down tasks) and the planner's order; up to WIDE_OPROJ_MAX_TOKENS a
    WIDE_OPROJ_STEP_KB o_proj step; every S the
    FINAL prefetch; up to EVICT_FIRST_MAX_TOKENS the expert weights evict_first;
    from MANY_CTAS_MIN_TOKENS 3 CTAs a SM under a register cap that keeps them
    resident, but 2 with M1c folded in, whose M1C tasks keep 3 steps in flight from
    FOLDED_M1C_DEEP_MIN_TOKENS over an fp8 cache and whose M1B tasks take 64 value
    rows from FOLDED_M1C_WIDE_M1B_MIN_TOKENS; a caller's options are kept as given."""
    cfg = preset("kimi-k3")
    keys = {s: mono_key(cfg, s, 8, 25, loopback=True, sms=132) for s in (1, 2, 4, 8, 16)}
    assert keys[1].tiles == replace(DEFAULT_TILES, down_rows=SINGLE_TOKEN_DOWN_ROWS,
                                    shared_step_kb=SINGLE_TOKEN_SHARED_STEP_KB, router_rows=SINGLE_TOKEN_ROUTER_ROWS,
                                    latent_rows=SINGLE_TOKEN_LATENT_ROWS,
                                    oproj_step_kb=WIDE_OPROJ_STEP_KB) != DEFAULT_TILES
    assert keys[2].tiles == keys[4].tiles == replace(DEFAULT_TILES, oproj_step_kb=WIDE_OPROJ_STEP_KB)
    wide = replace(DEFAULT_TILES, down_rows=WIDE_DOWN_ROWS, down_step_kb=WIDE_DOWN_STEP_KB)
    assert keys[8].tiles == replace(wide, oproj_step_kb=WIDE_OPROJ_STEP_KB) and WIDE_OPROJ_MAX_TOKENS == 8
    assert keys[16].tiles == wide and WIDE_DOWN_MIN_TOKENS == 8
    assert all(k.tiles.expert_f16 for k in keys.values())  # EXPERT_F16_SUMS: one expert order at every S
    assert [k.options.shared_late for k in keys.values()] == [True, False, False, False, False]
    assert [k.options.expert_evict_first for k in keys.values()] == [s <= EVICT_FIRST_MAX_TOKENS for s in keys]
    assert all(k.options.prefetch_final for k in keys.values())
    assert [k.ctas_per_sm for k in keys.values()] == [2, 2, 2, 2, 3]  # MANY_CTAS_MIN_TOKENS
    assert [k.max_registers for k in keys.values()] == [None, None, None, None, 168]
    m1b = M1bShape(splits=16, latent=512)
    folded = {s: default_options(s, m1b=m1b, m1c=M1cShape(page_size=64, requests=s, kv_fp8=True)) for s in keys}
    assert all(f.ctas_per_sm == FOLDED_M1C_CTAS_PER_SM == 2 for f in folded.values())  # its M1C step loop spills at 3
    assert [f.tiles.m1c_stages for f in folded.values()] == [2, 2, 3, 3, 3]  # FOLDED_M1C_DEEP_MIN_TOKENS
    assert [f.tiles.m1b_rows for f in folded.values()] == [32, 32, 32, 32, 64]  # FOLDED_M1C_WIDE_M1B_MIN_TOKENS
    assert all(replace(f.tiles, m1c_stages=keys[s].tiles.m1c_stages, m1b_rows=keys[s].tiles.m1b_rows) == keys[s].tiles
               for s, f in folded.items())
    over_bf16 = default_options(16, m1b=m1b, m1c=M1cShape(page_size=64, requests=16, kv_fp8=False))
    assert (over_bf16.tiles.m1c_stages, over_bf16.tiles.m1b_rows) == (2, 64)  # the deep stages timed over fp8 only
    assert all(default_options(s, m1b=m1b).tiles == keys[s].tiles for s in keys)  # M1b alone: the plain tiles
    with_fields = default_options_with(16, {"ctas_per_sm": 3}, m1b=m1b, m1c=M1cShape(64, 16, 64, True))
    assert (with_fields.ctas_per_sm, with_fields.tiles) == (3, folded[16].tiles)
    given = MonoOptions(tiles=TileChoice(down_rows=32))
    assert mono_key(cfg, 1, 8, 25, loopback=True, sms=132, options=given).options == given


def test_default_tiles_take_given_fields_and_the_tensor_core_experts_drop_the_f16_sums():
    """default_tiles(S, **given): each given field overrides S's default; asking for
    the tensor-core experts (mma order) drops the default f16 sums (the other
    order) unless expert_f16 is given too, which TileChoice then refuses."""
    assert default_tiles(1, down_rows=8, m1b_rows=16) == replace(default_tiles(1), down_rows=8, m1b_rows=16)
    mma = default_tiles(8, expert_mma=True)
    assert mma == replace(default_tiles(8), expert_mma=True, expert_f16=False)
    mma.check()
    with pytest.raises(K3InputError, match="expert_mma and expert_f16"):
        default_tiles(8, expert_mma=True, expert_f16=True).check()
    assert default_tiles(8, expert_mma=False) == default_tiles(8)


def test_a_build_key_caps_registers_so_its_planned_ctas_stay_resident():
    """mono_key takes the register cap that lets options.ctas_per_sm CTAs of
    MONO_WARPS warps share an SM's registers (none where 255 already fits), and
    keeps a caller's cap as given."""
    cfg = preset("kimi-k3")
    caps = {n: mono_key(cfg, 8, 8, 25, loopback=True, sms=132, options=MonoOptions(ctas_per_sm=n)).max_registers
            for n in (1, 2, 3, 4, 8)}
    assert caps == {1: None, 2: None, 3: 168, 4: 128, 8: 64}
    for n, cap in caps.items():
        assert cap is None or cap * n * MONO_WARPS * 32 <= SM_REGISTERS < (cap + 8) * n * MONO_WARPS * 32
    given = mono_key(cfg, 8, 8, 25, loopback=True, sms=132, options=MonoOptions(ctas_per_sm=4), max_registers=96)
    assert given.max_registers == 96


def test_mono_rejects_more_than_16_tokens():
    cfg = preset("tiny")
    with pytest.raises(K3InputError, match="tokens"):
        MonoBuild(cfg=cfg, tokens=17, tp=1)
    with pytest.raises(K3InputError, match="tokens"):
        MonoRunner(cfg, shard_all(layer_weights(), cfg, 1), 17, 13)
    runner = MonoRunner(cfg, shard_all(layer_weights(), cfg, 1), 3, 13)
    with pytest.raises(K3InputError, match="tokens"):
        runner(**random_inputs(cfg, 2, 13, seed=3))


def test_a_register_cap_is_checked_and_changes_no_bits_under_the_interpreter():
    cfg, tokens, layer = preset("tiny"), 1, 1
    with pytest.raises(K3InputError, match="max_registers"):
        MonoBuild(cfg=cfg, tokens=1, tp=1, max_registers=300)
    shards = shard_all(layer_weights(), cfg, 1)
    inputs = random_inputs(cfg, tokens, layer, seed=21)
    plain = MonoRunner(cfg, shards, tokens, layer)(**inputs)
    assert same_bits(plain, MonoRunner(cfg, shards, tokens, layer, max_registers=168)(**inputs))


def test_a_poll_pause_is_checked_and_the_interpreter_takes_none():
    cfg = preset("tiny")
    for bad in (-1, 2000):  # 2 us a poll would stretch a wait's bound past a few seconds
        with pytest.raises(K3InputError, match="poll_sleep_ns"):
            MonoBuild(cfg=cfg, tokens=1, tp=1, poll_sleep_ns=bad)
    key = MonoBuild(cfg=cfg, tokens=1, tp=1, poll_sleep_ns=200)
    assert key.options.poll_sleep_ns == 200 and build(key).consts["SLEEP_NS"] == 0


def test_any_grid_completes_and_the_last_cta_out_resets_the_counters():
    """Grids of 1, 7 and 100 CTAs (under the interpreter the first program walks
    the table, the others find no ticket): the same bits, the ticket and CTA
    counters back at zero, the epoch advanced by one."""
    cfg, tokens, layer = preset("tiny"), 2, 13
    shards = shard_all(layer_weights(), cfg, 1)
    inputs = random_inputs(cfg, tokens, layer, seed=31)
    results = []
    for sms in (1, 7, 100):
        runner = MonoRunner(cfg, shards, tokens, layer, sms=sms, options=MonoOptions(ctas_per_sm=1))
        assert runner.compiled.grid == min(sms, len(runner.compiled.table.tasks))
        results.append(runner(**inputs))
        assert runner.ctl(0).tolist() == [0, 0] and runner.epoch(0) == 2
    assert all(same_bits(results[0], other) for other in results[1:])


@pytest.fixture(scope="module")
def plain_s3():
    """(cfg, shards, inputs, the default launch's result) at S = 3, T = 1, layer 13:
    what each other task shape is compared with, launched once for all of them."""
    cfg, tokens, layer = preset("tiny"), 3, 13
    shards = shard_all(layer_weights(), cfg, 1)
    inputs = random_inputs(cfg, tokens, layer, seed=41)
    return cfg, shards, inputs, MonoRunner(cfg, shards, tokens, layer)(**inputs)


@pytest.mark.parametrize("tiles", [TileChoice(gate_up_rows=8, down_rows=16), TileChoice(gate_up_rows=16, down_rows=8),
                                   TileChoice(router_rows=8), TileChoice(router_rows=1, latent_rows=2),
                                   TileChoice(shared_rows=2), TileChoice(expert_lookahead=True)],
                         ids=["gate-up-8-down-16", "gate-up-16-down-8", "router-rows-8", "router-1-latent-2",
                              "shared-rows-2", "expert-lookahead"])
def test_other_task_shapes_change_no_bits(tiles, plain_s3):
    """Each output row's sums run over the same columns in the same order
    whatever the rows a task holds (the tiny preset's router step is capped at
    its 224-wide input either way): more, smaller tasks give the same bits
    (S = 3 at T = 1: 4x or 2x the expert tasks, a quarter or twice the router tasks, 4x the latent or the
    shared ones); so do
    expert loops that load a step ahead. (The defaults' o_proj and FINAL rows are
    kept: they may change bits; test_wider_hidden_tasks_stay_within_budget_... covers them.
    So is their expert order: f16 sums round otherwise than fp32 ones.)"""
    cfg, shards, inputs, plain = plain_s3
    tiles = replace(tiles, oproj_rows=DEFAULT_TILES.oproj_rows, final_rows=DEFAULT_TILES.final_rows,
                    expert_f16=DEFAULT_TILES.expert_f16)
    tokens, layer = 3, 13
    narrow = MonoRunner(cfg, shards, tokens, layer, options=MonoOptions(tiles=tiles))
    geometry = narrow.compiled.table.geometry
    rows = (geometry.expert_gate_up.rows, geometry.expert_down.rows, geometry.router.rows, geometry.latent_down.rows,
            geometry.shared_gate_up.rows)
    assert rows == (tiles.gate_up_rows, tiles.down_rows, tiles.router_rows, tiles.latent_rows, tiles.shared_rows)
    assert geometry.expert_gate_up.lookahead == geometry.expert_down.lookahead == tiles.expert_lookahead
    assert same_bits(plain, narrow(**inputs))


def test_wider_hidden_tasks_stay_within_budget_and_loopback_pushes_the_same_tiles():
    """32-row o_proj and FINAL tasks (TileChoice.oproj_rows, final_rows) take K
    in shorter steps, so their sums may round otherwise: the launch stays within
    the reference's budget, and the loopback's pre-writes (a staged run) use the
    launch's tiles, so every rank's launch gives the staged path's bits at them."""
    cfg, tokens, layer, tp = preset("tiny"), 1, 13, 2
    tiles = TileChoice(oproj_rows=32, final_rows=32)
    shards = shard_all(layer_weights(), cfg, tp)
    inputs = random_inputs(cfg, tokens, layer, seed=43)
    runner = MonoRunner(cfg, shards, tokens, layer, options=MonoOptions(tiles=tiles))
    got = runner(**inputs)
    check_against_reference(cfg, shards, inputs, layer, got)
    geometry = runner.compiled.table.geometry
    assert (geometry.oproj.rows, geometry.final.rows) == (32, 32)
    assert runner._staged.geom == geometry
    for rank in range(tp):
        assert same_bits(runner.result(rank), runner._staged.result(rank)), f"rank {rank}: mono and staged differ"


X_GROUP_CASES = [(2, 6, 4, False), (1, 9, 4, True), (2, 8, 8, False)]


@pytest.mark.parametrize("tp,tokens,group,split", X_GROUP_CASES,
                         ids=[f"T{t}-S{s}-G{g}-split{int(x)}" for t, s, g, x in X_GROUP_CASES])
def test_router_and_latent_down_by_token_groups_stay_within_budget_and_match_staged(tp, tokens, group, split):
    """TileChoice.x_token_groups: past FMA_MAX_TOKENS tokens the router and latent
    down tasks run FMAs on groups of 4 or 8 tokens (x_group_tokens; the last
    group's window shifted back to end at S: 6 and 9 are not multiples of 4; 8
    is one group), summing otherwise than tl.dot: the launch stays within the
    reference's budget, every task's rows land once (the buffers are poisoned),
    and the staged path at the same tiles gives the same bits on every rank; so
    it does with final_split and prefetch_shared on too (``split``)."""
    cfg, layer = preset("tiny"), 13
    shards = shard_all(layer_weights(), cfg, tp)
    inputs = random_inputs(cfg, tokens, layer, seed=47 + tokens)
    tiles = TileChoice(x_token_groups=True, x_group_tokens=group)
    options = MonoOptions(tiles=tiles, final_split=split, prefetch_shared=split)
    runner = MonoRunner(cfg, shards, tokens, layer, options=options)
    geometry = runner.compiled.table.geometry
    assert geometry.x_groups == -(-tokens // group) and not geometry.x_group_dot and geometry.use_dot
    got = runner(**inputs)
    check_against_reference(cfg, shards, inputs, layer, got)
    assert_staged_bits(runner, cfg, shards, tokens, layer, inputs, tp)


X_PARTS_CASES = [(2, 8, 7, False), (1, 16, 4, True), (4, 5, 2, False)]


@pytest.mark.parametrize("tp,tokens,parts,split", X_PARTS_CASES,
                         ids=[f"T{t}-S{s}-X{p}-split{int(x)}" for t, s, p, x in X_PARTS_CASES])
def test_router_and_latent_down_by_parts_of_k_stay_within_budget_and_match_staged(tp, tokens, parts, split):
    """TileChoice.x_k_parts: past FMA_MAX_TOKENS tokens a router or latent down
    row tile is cut into parts of K, the earlier parts' partials summed by the
    tile's last task after its in-task wait: the launch stays within the
    reference's budget, every tile lands once (the buffers are poisoned), and
    the staged path, summing the same parts in one program, gives the same bits
    on every rank; so it does with final_split and prefetch_shared on too."""
    cfg, layer = preset("tiny"), 13
    shards = shard_all(layer_weights(), cfg, tp)
    inputs = random_inputs(cfg, tokens, layer, seed=53 + tokens)
    tiles = TileChoice(x_k_parts=parts)
    options = MonoOptions(tiles=tiles, final_split=split, prefetch_shared=split)
    runner = MonoRunner(cfg, shards, tokens, layer, options=options)
    geometry = runner.compiled.table.geometry
    assert geometry.x_parts == parts and geometry.x_group_dot
    assert geometry.router.block_k <= next_pow2(cfg.hidden_size // parts)
    got = runner(**inputs)
    check_against_reference(cfg, shards, inputs, layer, got)
    assert_staged_bits(runner, cfg, shards, tokens, layer, inputs, tp)


EXPERT_ORDER_CASES = [("mma", 2, 3), ("mma", 1, 16), ("f16", 2, 3), ("f16", 1, 16)]


@pytest.mark.parametrize("order,tp,tokens", EXPERT_ORDER_CASES, ids=[f"{o}-T{t}-S{s}" for o, t, s in EXPERT_ORDER_CASES])
def test_experts_in_other_orders_stay_within_budget_and_match_staged(order, tp, tokens):
    """TileChoice.expert_mma: the expert tasks on tensor cores (weights in mma
    order, z pushed times 2^63) sum in another order; TileChoice.expert_f16:
    the FMA loops sum each group in f16 (weights in f16 order). Either launch
    is held to the reference's budget and routes; the staged path at the same
    tiles gives its bits on every rank (loopback's pre-writes included)."""
    cfg, layer = preset("tiny"), 13
    shards = shard_all(layer_weights(), cfg, tp)
    inputs = random_inputs(cfg, tokens, layer, seed=47 + tokens)
    tiles = TileChoice(expert_mma=True) if order == "mma" else TileChoice(expert_f16=True)
    runner = MonoRunner(cfg, shards, tokens, layer, options=MonoOptions(tiles=tiles))
    got = runner(**inputs)
    check_against_reference(cfg, shards, inputs, layer, got)
    geometry = runner.compiled.table.geometry
    L, I_r = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size // tp
    if order == "mma":
        assert (geometry.expert_gate_up, geometry.expert_down) == (expert_mma_tile(I_r), expert_mma_tile(L))
    staged = assert_staged_bits(runner, cfg, shards, tokens, layer, inputs, tp)
    if tp > 1:  # the prewrite's staged layer reads the ranks' own tensors: each expert tensor converted once
        assert runner.expert_words.conversions == 3 * tp
        for rank in range(tp):
            assert staged.expert_words[rank]["w2"] is runner.rank_states[rank]._args["w2"]


def test_experts_turned_in_place_run_as_the_checkpoints_bytes_do():
    """An engine turns its experts to f16 order once, in place
    (weights.experts_in_f16_order_): the runner at the defaults takes them as
    they are (no second copy) and gives the bits it gives from the checkpoint's
    bytes, as does the staged path; a shard with the orders mixed, or a build summing in fp32, is refused
    by name."""
    cfg, tokens, layer = preset("tiny"), 1, 13
    inputs = random_inputs(cfg, tokens, layer, seed=59)
    checkpoint = MonoRunner(cfg, shard_all(layer_weights(), cfg, 1), tokens, layer)
    expected = checkpoint(**inputs)
    assert checkpoint.expert_words.conversions == 3
    turned = [experts_in_f16_order_(w) for w in shard_all(random_layer(cfg, 0), cfg, 1)]  # layer_weights' values
    runner = MonoRunner(cfg, turned, tokens, layer)
    assert same_bits(runner(**inputs), expected) and runner.expert_words.conversions == 0
    # tiles that do not say f16: the staged launchers read the order from the dtype
    staged = StagedLayer(cfg, turned, tokens, layer, tiles=replace(runner.key.tiles, expert_f16=False))
    staged(**inputs)
    assert same_bits(staged.result(0), expected)
    mixed = replace(turned[0], w2_packed=shard_all(layer_weights(), cfg, 1)[0].w2_packed)
    with pytest.raises(K3InputError, match="^weights: the packed experts must share one order"):
        MonoRunner(cfg, [mixed], tokens, layer)
    fp32_sums = MonoRunner(cfg, turned, tokens, layer, options=MonoOptions(tiles=TileChoice()))
    with pytest.raises(K3InputError, match=r"^w13\[0\]: expected torch.uint8"):
        fp32_sums(**inputs)


def test_the_expert_weights_must_be_in_the_builds_order(mono_launches):
    """A build with TileChoice.expert_mma reads int32 words in mma order; one
    without, the checkpoint's bytes: either mixed up is named before any launch."""
    from k3mono.mono import k2_launch

    cfg, tokens, layer = preset("tiny"), 1, 13
    for expert_mma in (False, True):
        options = MonoOptions(tiles=TileChoice(expert_mma=expert_mma))
        runner = MonoRunner(cfg, shard_all(layer_weights(), cfg, 1), tokens, layer, options=options)
        runner.load_inputs(**random_inputs(cfg, tokens, layer, seed=53))
        rank, b = runner.rank_states[0], runner.rank_states[0].buffers
        args = dict(core=rank.core, prefix=rank.prefix, blocks=rank.blocks, **rank._args, out=rank.out,
                    scratch=b.scratch, peers=b.peers, peer_table=b.peer_table(), rank=0, epoch=b.epoch_word,
                    layer=layer, health=b.health, alarm=rank.spin_limit)
        k2_launch(rank.key, **args)
        swapped = runner.shards[0].w2_packed if expert_mma else mma_order(runner.shards[0].w2_packed)
        want = "torch.int32" if expert_mma else "torch.uint8"
        with pytest.raises(K3InputError, match=rf"^w2: expected {want}"):
            k2_launch(rank.key, **dict(args, w2=swapped))
    assert len(mono_launches) == 2


@pytest.mark.parametrize("bad,message", [
    (lambda t: t.to(torch.int32), r"^peer_table: expected dtype torch.int64"),
    (lambda t: torch.cat([t, t]), r"^peer_table: expected shape \[2\], got \[4\]"),
])
def test_a_bad_peer_table_is_named_before_any_launch(bad, message, mono_launches):
    """k2_launch reads the peers through their address table: a table of the
    wrong dtype or length is refused before the kernel runs."""
    from k3mono.mono import k2_launch

    launches = mono_launches
    cfg, tokens, layer = preset("tiny"), 1, 13
    runner = MonoRunner(cfg, shard_all(layer_weights(), cfg, 2), tokens, layer, loopback=False)
    runner.load_inputs(**random_inputs(cfg, tokens, layer, seed=51))
    rank, b = runner.rank_states[0], runner.rank_states[0].buffers
    args = dict(core=rank.core, prefix=rank.prefix, blocks=rank.blocks, **rank._args, out=rank.out,
                scratch=b.scratch, peers=b.peers, rank=0, epoch=b.epoch_word, layer=layer, health=b.health,
                alarm=rank.spin_limit)
    k2_launch(rank.key, peer_table=b.peer_table(), **args)
    assert len(launches) == 1
    with pytest.raises(K3InputError, match=message):
        k2_launch(rank.key, peer_table=bad(b.peer_table()), **args)
    assert len(launches) == 1
