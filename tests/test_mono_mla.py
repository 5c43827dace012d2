"""An MLA layer's mono launch: M1b (combine splits, w_v, gate) runs first in the
same launch, then o_proj reads the core it wrote. Under the interpreter.

Shapes: S tokens, T ranks, heads = num_attention_heads / T of the tiny preset's
v_head_dim value rows, splits, DL the latent width (LATENT: tiny-sized).

The launch is judged as the chain it replaces: the reference M1b (bf16 mode)
then the reference layer_post (the TP form for T > 1) against the float64
oracle of the same chain (the exact M1b core into the oracle layer_post, on
the launch's routes), within BUDGET_FACTOR of the bf16 chain's own error;
routes must equal the bf16 chain's. The core the launch wrote must be the
staged M1b's bit for bit (the same task function on the same data in the
same order). Outputs and core start poisoned (NaN), so an element left
unwritten fails. Cases past planner.BACK_SHORT_SPLITS splits (LONG_SPLITS)
take M1b's long combine, which steps over the splits.

With M1c in the launch as well (MonoOptions(m1c=...)), the launch starts from
q and a paged latent cache: the chain is the reference M1c -> M1b ->
layer_post, the split outputs in the launch's scratch and the core must be
the staged M1c and M1b kernels' bit for bit, and the split outputs start
poisoned too. Cache rows outside every context are NaN, pages are shuffled,
contexts are no multiple of the page size, and one request's context of 2
positions leaves a split empty.
"""

from __future__ import annotations

import functools

import pytest
import torch

from k3mono import mla
from k3mono.config import preset
from k3mono.errors import K3InputError
from k3mono.mono import MonoRunner
from k3mono.planner import BACK_SHORT_SPLITS, M1bShape, M1cShape, MonoOptions, TileChoice
from k3mono.reference import layer_post, layer_post_tp
from k3mono.reference import mla as ref_mla
from k3mono.runner import error_and_budget
from k3mono.staged import StagedLayer
from k3mono.synthetic import random_inputs, random_layer
from k3mono.weights import shard_all

FP8 = torch.float8_e4m3fn
LAYER = 13
LATENT = 32  # DL: tl.dot's smallest widths are 16, Kimi-K3's 512 would only slow the interpreter
SPLITS = 3
NAMES = ("moe_out", "prefix", "route_ids", "route_weights")


@functools.lru_cache(maxsize=None)
def layer_weights():
    return random_layer(preset("tiny"), 0)


def m1b_inputs(cfg, tp: int, tokens: int, w_v_dtype, seed: int, splits: int = SPLITS,
               latent: int = LATENT) -> list[dict]:
    """One rank's heads' M1b inputs a rank; token 0's last split is empty (lse -inf, o 0)."""
    gen = torch.Generator().manual_seed(seed)
    heads, value = cfg.num_attention_heads // tp, cfg.v_head_dim
    w_v_scale = 0.0029 if w_v_dtype == FP8 else 1.0
    out = []
    for _ in range(tp):
        o = torch.randn(splits, tokens, heads, latent, generator=gen)
        lse = 3 * torch.randn(splits, tokens, heads, generator=gen)
        o[-1, 0], lse[-1, 0] = 0.0, float("-inf")
        w_v = torch.randn(heads, value, latent, generator=gen) * latent**-0.5
        out.append(dict(o=o, lse=lse, w_v=(w_v / w_v_scale).to(w_v_dtype), w_v_scale=w_v_scale,
                        gate=torch.randn(tokens, heads * value, generator=gen).to(torch.bfloat16)))
    return out


def reference_core(m1b_in: list[dict], mode: str) -> torch.Tensor:
    """The reference M1b of every rank's heads, side by side: core [S, C]."""
    return torch.cat([ref_mla.mla_back(m["o"], m["lse"], m["w_v"], m["gate"], w_v_scale=m["w_v_scale"], mode=mode)
                      for m in m1b_in], dim=1)


def mla_runner(cfg, shards, tokens: int, w_v_dtype, splits: int = SPLITS, latent: int = LATENT) -> MonoRunner:
    shape = M1bShape(splits=splits, latent=latent, w_v_fp8=w_v_dtype == FP8)
    return MonoRunner(cfg, shards, tokens, LAYER, options=MonoOptions(m1b=shape))


def bits(t):
    return t.view(torch.uint8) if t.is_floating_point() else t


LONG_SPLITS = BACK_SHORT_SPLITS + 4  # past the short combine: each M1B task steps over the splits
CASES = [(1, 1, torch.bfloat16, SPLITS, LATENT), (1, 3, FP8, SPLITS, LATENT), (2, 1, FP8, SPLITS, LATENT),
         (2, 3, torch.bfloat16, SPLITS, LATENT), (2, 2, torch.bfloat16, LONG_SPLITS, 2 * LATENT),
         (1, 1, FP8, LONG_SPLITS, LATENT)]


@pytest.mark.parametrize("tp,tokens,w_v_dtype,splits,latent", CASES,
                         ids=[f"T{t}-S{s}-{str(d)[6:]}-{k}x{n}" for t, s, d, k, n in CASES])
def test_mono_with_m1b_matches_the_reference_chain_and_the_staged_m1b(tp, tokens, w_v_dtype, splits, latent):
    cfg, weights = preset("tiny"), layer_weights()
    shards = shard_all(weights, cfg, tp)
    act = random_inputs(cfg, tokens, LAYER, seed=40 + 7 * tp + tokens)
    m1b_in = m1b_inputs(cfg, tp, tokens, w_v_dtype, seed=tp * 10 + tokens, splits=splits, latent=latent)
    runner = mla_runner(cfg, shards, tokens, w_v_dtype, splits, latent)
    assert runner.compiled.table.tasks[0].kind.name == "M1B"
    got = runner.layer_post_mla(m1b_in, act["prefix"], act["blocks"])

    # (b) each rank's launch wrote its own core: the staged M1b's bits
    staged_core = mla.rank_cores(m1b_in)
    width = cfg.core_width // tp
    for r in range(tp):
        assert torch.equal(bits(runner.rank_states[r].core), bits(staged_core[:, r * width : (r + 1) * width])), r

    # (a) the chain: reference M1b (bf16) -> reference layer_post, judged against the oracle chain
    judge_chain(cfg, weights, shards, act, got, reference_core(m1b_in, "bf16"), reference_core(m1b_in, "oracle"))
    # every rank holds the same bits, and they are the staged chain's (staged M1b, then the staged layer)
    same_as_staged_chain(cfg, shards, tokens, m1b_in, act, runner)


def test_mla_layers_take_turns_on_one_set_of_buffers():
    """An MLA build's buffers serve its other layers too (MonoRank.for_layer):
    each launch's M1b writes its own layer's core, and each layer's chain is
    right against its own reference."""
    cfg, tokens = preset("tiny"), 1
    weights = {LAYER: layer_weights(), 92: random_layer(cfg, 1)}
    first = mla_runner(cfg, [weights[LAYER]], tokens, torch.bfloat16)
    second = first.for_layer(92, [weights[92]])
    assert second.key.m1b == first.key.m1b and second.rank_states[0].core is not first.rank_states[0].core
    for launch, (runner, layer) in enumerate([(second, 92), (first, LAYER)], start=1):
        act = random_inputs(cfg, tokens, layer, seed=60 + launch)
        m1b_in = m1b_inputs(cfg, 1, tokens, torch.bfloat16, seed=70 + launch)
        got = runner.layer_post_mla(m1b_in, act["prefix"], act["blocks"])
        judge_chain(cfg, weights[layer], [weights[layer]], act, got, reference_core(m1b_in, "bf16"),
                    reference_core(m1b_in, "oracle"), layer)
        assert first.epoch() == second.epoch() == launch + 1


def judge_chain(cfg, weights, shards, act, got, core, exact_core, layer=LAYER):
    """Routes equal the bf16 reference chain's (its core -> layer_post); moe_out,
    prefix and route_weights within budget of the float64 chain's (exact core)."""
    tp = len(shards)
    args = dict(prefix=act["prefix"], blocks=act["blocks"], layer=layer, cfg=cfg)
    want = layer_post(core, **args, weights=weights) if tp == 1 else layer_post_tp(core, **args, shards=shards)
    assert torch.equal(got.route_ids, want.route_ids), "routes differ from the bf16 reference chain"
    exact = layer_post(exact_core, **args, weights=weights, mode="oracle", forced_routes=got.route_ids)
    for name in ("moe_out", "prefix", "route_weights"):
        out = getattr(got, name)
        assert torch.isfinite(out.float()).all(), name
        err, budget = error_and_budget(out, getattr(want, name), getattr(exact, name))
        assert err <= budget, f"{name}: error {err:.3g} against the oracle chain, budget {budget:.3g}"


def same_as_staged_chain(cfg, shards, tokens, m1b_in, act, runner):
    """Every rank's outputs are the staged chain's bits (staged M1b, then the staged layer)."""
    staged = mla.staged_mla_layer_post(StagedLayer(cfg, shards, tokens, LAYER, tiles=runner.key.tiles), m1b_in,
                                       act["prefix"], act["blocks"])
    for r, other in enumerate(runner.rank_results()):
        assert all(torch.equal(bits(getattr(staged, n)), bits(getattr(other, n))) for n in NAMES), r


BAD = {
    "missing": (lambda m: None, r"^m1b_in: expected a dict"),
    "no-gate": (lambda m: {k: v for k, v in m.items() if k != "gate"}, r"^m1b_in: expected a dict"),
    "o-splits": (lambda m: {**m, "o": m["o"][:-1]}, r"^o: expected shape \[3, 1, 4, 32\], got \[2, 1, 4, 32\]"),
    "lse-fp64": (lambda m: {**m, "lse": m["lse"].double()}, r"^lse: expected dtype torch.float32, got torch.float64"),
    "w_v-fp8": (lambda m: {**m, "w_v": m["w_v"].to(FP8)}, r"^w_v: expected dtype torch.bfloat16, got .*float8"),
    "gate-width": (lambda m: {**m, "gate": m["gate"][:, :-1]}, r"^gate: expected shape \[1, 128\], got \[1, 127\]"),
    "w_v-scale": (lambda m: {**m, "w_v_scale": 0.5}, r"^w_v_scale: "),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_m1b_input_is_named_before_any_launch(case, mono_launches):
    cfg = preset("tiny")
    corrupt, message = BAD[case]
    launches = mono_launches
    runner = mla_runner(cfg, shard_all(layer_weights(), cfg, 1), 1, torch.bfloat16)
    act = random_inputs(cfg, 1, LAYER, seed=3)
    m1b_in = m1b_inputs(cfg, 1, 1, torch.bfloat16, seed=3)
    with pytest.raises(K3InputError, match=message):
        runner.layer_post_mla([corrupt(m1b_in[0])], act["prefix"], act["blocks"])
    assert launches == []
    with pytest.raises(K3InputError, match=r"^m1b_in: "):  # the runner launches with what it loaded
        runner.rank_states[0].m1b_in = None
        runner.run()
    assert launches == []


def test_m1b_and_plain_runners_refuse_each_others_inputs():
    cfg = preset("tiny")
    shards = shard_all(layer_weights(), cfg, 2)
    act = random_inputs(cfg, 1, LAYER, seed=4)
    with pytest.raises(K3InputError, match="layer_post_mla"):
        mla_runner(cfg, shards, 1, torch.bfloat16)(**act)
    with pytest.raises(K3InputError, match="no M1b"):
        MonoRunner(cfg, shards, 1, LAYER).layer_post_mla(m1b_inputs(cfg, 2, 1, torch.bfloat16, 4), act["prefix"],
                                                         act["blocks"])
    with pytest.raises(K3InputError, match=r"one dict of M1b inputs a rank \(2\), got 1"):
        mla_runner(cfg, shards, 1, torch.bfloat16).layer_post_mla(m1b_inputs(cfg, 1, 1, torch.bfloat16, 4),
                                                                  act["prefix"], act["blocks"])
    staged = StagedLayer(cfg, shards, 1, LAYER)
    with pytest.raises(K3InputError, match=r"^m1b_in\[1\]: expected a dict"):
        mla.staged_mla_layer_post(staged, [m1b_inputs(cfg, 2, 1, torch.bfloat16, 4)[0], {}], act["prefix"],
                                  act["blocks"])


@pytest.mark.parametrize("prefetch,prefetch_oproj", [(2, False), (0, True)], ids=["prefetch2", "prefetch_oproj"])
def test_o_proj_weights_read_before_the_core_wait_change_no_bits(prefetch, prefetch_oproj):
    """PREFETCH = 2 (every kind), or MonoOptions.prefetch_oproj alone: every OPROJ
    asks for its w_o tile before it polls CORE."""
    cfg = preset("tiny")
    shards = shard_all(layer_weights(), cfg, 1)
    act = random_inputs(cfg, 1, LAYER, seed=5)
    m1b_in = m1b_inputs(cfg, 1, 1, torch.bfloat16, seed=5)
    shape = M1bShape(splits=SPLITS, latent=LATENT)
    plain = MonoRunner(cfg, shards, 1, LAYER, options=MonoOptions(m1b=shape), prefetch=0)
    eager = MonoRunner(cfg, shards, 1, LAYER, options=MonoOptions(m1b=shape, prefetch_oproj=prefetch_oproj),
                       prefetch=prefetch)
    assert (eager.key.opt != plain.key.opt) == prefetch_oproj
    a = plain.layer_post_mla(m1b_in, act["prefix"], act["blocks"])
    b = eager.layer_post_mla(m1b_in, act["prefix"], act["blocks"])
    assert all(torch.equal(bits(getattr(a, n)), bits(getattr(b, n))) for n in NAMES)


def test_m1b_tasks_of_fewer_value_rows_give_the_staged_chains_bits():
    """TileChoice.m1b_rows 16: twice the M1B tasks (each recombines its head's
    splits for half the value rows); every core element is the same dot, so the
    launch gives the staged chain's bits (its M1b kernel at 32 rows a program)."""
    cfg = preset("tiny")
    shards = shard_all(layer_weights(), cfg, 1)
    act = random_inputs(cfg, 1, LAYER, seed=6)
    m1b_in = m1b_inputs(cfg, 1, 1, torch.bfloat16, seed=6)
    options = MonoOptions(m1b=M1bShape(splits=SPLITS, latent=LATENT), tiles=TileChoice(m1b_rows=16))
    runner = MonoRunner(cfg, shards, 1, LAYER, options=options)
    geometry = runner.compiled.table.geometry.m1b
    assert (geometry.block_dv, geometry.tasks) == (16, cfg.num_attention_heads * cfg.v_head_dim // 16)
    runner.layer_post_mla(m1b_in, act["prefix"], act["blocks"])
    same_as_staged_chain(cfg, shards, 1, m1b_in, act, runner)


# -- M1c in the launch too ------------------------------------------------------------------

ROPE = 32  # DR: two halves of tl.dot's smallest width (kernels.mla_attn.HALVES_MIN)
PAGE_SIZE = 8


def paged_cache(seq_lens, kv_dtype, gen):
    """(kv, kv_scale, pages, indptr) with shuffled pages and NaN rows outside every context."""
    dqk = LATENT + ROPE
    counts = [-(-n // PAGE_SIZE) for n in seq_lens]
    num_pages = sum(counts) + 1  # a page nobody owns
    pages = torch.randperm(num_pages, generator=gen)[: sum(counts)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    kv = torch.full((num_pages, PAGE_SIZE, dqk), float("nan"))
    for b, n in enumerate(seq_lens):
        owned = pages[indptr[b] : indptr[b + 1]].long()
        rows = kv[owned].reshape(-1, dqk)
        rows[:n] = torch.randn(n, dqk, generator=gen)
        kv[owned] = rows.reshape(-1, PAGE_SIZE, dqk)
    kv_scale = 0.037 if kv_dtype == FP8 else 1.0
    return (kv / kv_scale).to(kv_dtype), kv_scale, pages, indptr


def m1c_inputs(cfg, tp: int, queries, seq_lens, kv_dtype, seed: int) -> tuple[list[dict], list[dict]]:
    """(m1c_in, m1b_in), one dict a rank: the rank's heads' q over one shared cache,
    and its w_v and gate."""
    gen = torch.Generator().manual_seed(seed)
    heads, value, tokens = cfg.num_attention_heads // tp, cfg.v_head_dim, sum(queries)
    kv, kv_scale, pages, indptr = paged_cache(seq_lens, kv_dtype, gen)
    layout = dict(kv=kv, kv_scale=kv_scale, pages=pages, indptr=indptr, scale=(LATENT + ROPE) ** -0.5,
                  qsl=torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist(), dtype=torch.int32),
                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    attn, back = [], []
    for _ in range(tp):
        attn.append(dict(layout, q=(1.5 * torch.randn(tokens, heads, LATENT + ROPE, generator=gen)).to(torch.bfloat16)))
        back.append(dict(w_v=(torch.randn(heads, value, LATENT, generator=gen) * LATENT**-0.5).to(torch.bfloat16),
                         w_v_scale=1.0, gate=torch.randn(tokens, heads * value, generator=gen).to(torch.bfloat16)))
    return attn, back


def reference_m1c_core(m1c_in: list[dict], m1b_in: list[dict], mode: str, splits: int) -> torch.Tensor:
    """The reference M1c then M1b of every rank's heads, side by side: core [S, C]."""
    cores = []
    for a, m in zip(m1c_in, m1b_in):
        o, lse = ref_mla.mla_attn(a["q"], a["kv"], a["qsl"], a["seq_lens"], a["pages"], a["indptr"], a["scale"],
                                  splits, kv_scale=a["kv_scale"], latent_dim=LATENT, mode=mode)
        cores.append(ref_mla.mla_back(o, lse, m["w_v"], m["gate"], w_v_scale=m["w_v_scale"], mode=mode))
    return torch.cat(cores, dim=1)


def m1c_runner(cfg, shards, tokens: int, requests: int, kv_dtype, splits: int = SPLITS) -> MonoRunner:
    options = MonoOptions(m1b=M1bShape(splits=splits, latent=LATENT),
                          m1c=M1cShape(page_size=PAGE_SIZE, requests=requests, rope=ROPE, kv_fp8=kv_dtype == FP8))
    return MonoRunner(cfg, shards, tokens, LAYER, options=options)


# the T = 2 fp8 case's splits of 44 positions are two of the M1C tasks' steps and one of a separate M1c's
# (planner.attn_steps): the loopback pre-writes must come from the M1C tasks' tile (mla.folded_attn_tile)
M1C_CASES = [(1, [1], [13], torch.bfloat16, SPLITS), (1, [2, 1], [13, 2], FP8, SPLITS),
             (2, [1, 2], [21, 9], torch.bfloat16, SPLITS), (2, [2, 1], [130, 9], FP8, SPLITS),
             (2, [1, 2], [45, 9], torch.bfloat16, LONG_SPLITS)]


@pytest.mark.parametrize("tp,queries,seq_lens,kv_dtype,splits", M1C_CASES,
                         ids=[f"T{t}-B{len(q)}-S{sum(q)}-{str(d)[6:]}-{k}" for t, q, _, d, k in M1C_CASES])
def test_mono_with_m1c_and_m1b_matches_the_reference_chain_and_the_staged_kernels(tp, queries, seq_lens, kv_dtype,
                                                                                   splits):
    cfg, weights = preset("tiny"), layer_weights()
    shards, tokens = shard_all(weights, cfg, tp), sum(queries)
    act = random_inputs(cfg, tokens, LAYER, seed=60 + 7 * tp + tokens)
    m1c_in, m1b_in = m1c_inputs(cfg, tp, queries, seq_lens, kv_dtype, seed=tp * 10 + tokens)
    runner = m1c_runner(cfg, shards, tokens, len(queries), kv_dtype, splits)
    assert [t.kind.name for t in runner.compiled.table.tasks[:2]] == ["M1C", "M1C"]
    got = runner.layer_post_mla(m1b_in, act["prefix"], act["blocks"], m1c_in=m1c_in)

    # (b) each rank's launch wrote the staged M1c's split outputs and the staged M1b's core, bit for bit
    staged_in = mla.with_split_outputs(m1c_in, m1b_in, splits, mla.folded_attn_tile(runner.compiled.table.geometry.m1c))
    staged_core = mla.rank_cores(staged_in)
    width = cfg.core_width // tp
    for r in range(tp):
        scratch = runner.scratch(r)
        for name, want in (("split_o", staged_in[r]["o"]), ("split_lse", staged_in[r]["lse"])):
            assert not scratch[name].isnan().any() and torch.equal(bits(scratch[name]), bits(want)), (r, name)
        assert torch.equal(bits(runner.rank_states[r].core), bits(staged_core[:, r * width : (r + 1) * width])), r
    for r, a in enumerate(m1c_in):  # empty splits (lse -inf) exactly where the reference M1c has them
        _, want_lse = ref_mla.mla_attn(a["q"], a["kv"], a["qsl"], a["seq_lens"], a["pages"], a["indptr"], a["scale"],
                                       splits, kv_scale=a["kv_scale"], latent_dim=LATENT)
        assert torch.equal(staged_in[r]["lse"].isneginf(), want_lse.isneginf()), r

    # (a) the chain: reference M1c -> M1b (bf16) -> reference layer_post, judged against the oracle chain
    judge_chain(cfg, weights, shards, act, got, reference_m1c_core(m1c_in, m1b_in, "bf16", splits),
                reference_m1c_core(m1c_in, m1b_in, "oracle", splits))
    # every rank holds the staged chain's bits (staged M1c, M1b, then the staged layer)
    same_as_staged_chain(cfg, shards, tokens, staged_in, act, runner)


BAD_M1C = {
    "m1c-missing": (lambda a, m: (None, [m]), r"^m1c_in: expected one dict of M1c inputs a rank \(1\), got NoneType"),
    "no-scale": (lambda a, m: ([{k: v for k, v in a.items() if k != "scale"}], [m]), r"^m1c_in: expected a dict"),
    "q-fp32": (lambda a, m: ([{**a, "q": a["q"].float()}], [m]), r"^q: expected dtype torch.bfloat16, got .*float32"),
    "kv-fp8": (lambda a, m: ([{**a, "kv": a["kv"].to(FP8)}], [m]), r"^kv: expected dtype torch.bfloat16, got .*float8"),
    "kv-page-size": (lambda a, m: ([{**a, "kv": a["kv"][:, :4]}], [m]), r"^kv: expected shape \[pages, 8, 64\]"),
    "seq_lens-int64": (lambda a, m: ([{**a, "seq_lens": a["seq_lens"].long()}], [m]), r"^seq_lens: expected dtype"),
    "m1b-with-o": (lambda a, m: ([a], [{**m, "o": None, "lse": None}]), r"^m1b_in: expected a dict of \['w_v'"),
    "past-the-pages": (lambda a, m: ([{**a, "seq_lens": a["seq_lens"] + 8}], [m]), r"^request 0: "),
}


@pytest.mark.parametrize("case", list(BAD_M1C))
def test_bad_m1c_input_is_named_before_any_launch(case, mono_launches):
    cfg = preset("tiny")
    corrupt, message = BAD_M1C[case]
    launches = mono_launches
    runner = m1c_runner(cfg, shard_all(layer_weights(), cfg, 1), 1, 1, torch.bfloat16)
    act = random_inputs(cfg, 1, LAYER, seed=6)
    m1c_in, m1b_in = m1c_inputs(cfg, 1, [1], [13], torch.bfloat16, seed=6)
    attn, back = corrupt(m1c_in[0], m1b_in[0])
    with pytest.raises(K3InputError, match=message):
        runner.layer_post_mla(back, act["prefix"], act["blocks"], m1c_in=attn)
    assert launches == []
    with pytest.raises(K3InputError, match=r"^m1c_in: "):  # the runner launches with what it loaded
        runner.rank_states[0].m1b_in, runner.rank_states[0].m1c_in = m1b_in[0], None
        runner.run()
    assert launches == []
