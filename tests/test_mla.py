"""MLA decode: M1c (split attention over a paged latent cache) and M1b (combine, w_v, gate).

The reference's properties are checked by hand (float64 oracle: one split is
plain softmax attention, splits combine to no split, empty splits weigh
nothing, causality, fp8 is its dequantisation). The staged kernels are
checked against the float64 oracle on the same inputs: each output may err
at most BUDGET_FACTOR times the bf16 reference's own error ("error budgets,
not loose tolerances"). The finite lse values get a 1e-7 relative floor on
top: a split of one position has p = 1 exactly, so the reference's lse error
there is only the fp32 rounding of the score, which the kernel's other dot
order may double. Which lse are -inf (empty splits) must match exactly.

Every kernel output starts poisoned with NaN, so an unwritten element fails.
Cache rows that belong to no request's context are NaN too, so a row read
past a context (a wrong page, row or mask) fails. Pages are handed out in a
shuffled order, contexts are not multiples of the page size, a context of 2
positions leaves splits empty (chunks are ceil(L / splits) positions of each
request), and some splits are longer than a step (planner.attn_steps: 32
positions over a bf16 cache, 64 over an fp8 one), so the online softmax's
running max moves between steps.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from k3mono import mla
from k3mono.errors import K3InputError
from k3mono.kernels.common import e4m3_pairs_to_fp16
from k3mono.kernels.mla_attn import launch_mla_attn
from k3mono.kernels.mla_back import _ordered_sum, launch_mla_back
from k3mono.reference import mla as ref
from k3mono.runner import error_and_budget

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FP8 = torch.float8_e4m3fn
LSE_FLOOR = 1e-7
SMALL = (32, 32, 16)  # (DL, DR, DV): the kernels take the widths as constexprs
REAL = (ref.LATENT_DIM, ref.ROPE_DIM, 128)


@dataclass
class Batch:
    q: torch.Tensor  # [S, heads, DL + DR] bf16
    kv: torch.Tensor  # [pages, page_size, DL + DR] bf16 or fp8
    kv_scale: float
    qsl: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    pages: torch.Tensor  # int32
    indptr: torch.Tensor  # [B + 1] int32
    scale: float
    w_v: torch.Tensor  # [heads, DV, DL] bf16 or fp8
    w_v_scale: float
    gate: torch.Tensor  # [S, heads * DV] bf16

    @property
    def layout(self) -> tuple:
        return self.q, self.kv, self.qsl, self.seq_lens, self.pages, self.indptr, self.scale

    def to(self, device) -> Batch:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return Batch(**moved)


def _int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _offsets(counts) -> torch.Tensor:
    return _int32([0] + torch.tensor(counts).cumsum(0).tolist())


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return (x / scale).to(dtype)


def make_batch(queries, seq_lens, *, page_size=16, heads=3, widths=SMALL, kv_dtype=torch.bfloat16,
               w_v_dtype=torch.bfloat16, seed=0) -> Batch:
    """A random batch whose cache rows outside every context are NaN, pages shuffled."""
    gen = torch.Generator().manual_seed(seed)
    latent, rope, value = widths
    dqk = latent + rope
    page_counts = [-(-length // page_size) for length in seq_lens]
    num_pages = sum(page_counts) + 2  # two pages nobody owns
    pages = torch.randperm(num_pages, generator=gen)[: sum(page_counts)].to(torch.int32)
    indptr = _offsets(page_counts)
    kv_scale = 0.037 if kv_dtype == FP8 else 1.0
    w_v_scale = 0.0029 if w_v_dtype == FP8 else 1.0
    kv = torch.full((num_pages, page_size, dqk), float("nan"))
    for b, length in enumerate(seq_lens):
        owned = pages[indptr[b] : indptr[b + 1]].long()
        rows = kv[owned].reshape(-1, dqk)
        rows[:length] = torch.randn(length, dqk, generator=gen)
        kv[owned] = rows.reshape(-1, page_size, dqk)
    tokens = sum(queries)
    return Batch(
        q=(1.5 * torch.randn(tokens, heads, dqk, generator=gen)).to(torch.bfloat16),
        kv=_quantize(kv, kv_dtype, kv_scale),
        kv_scale=kv_scale,
        qsl=_offsets(queries),
        seq_lens=_int32(seq_lens),
        pages=pages,
        indptr=indptr,
        scale=dqk**-0.5,
        w_v=_quantize(torch.randn(heads, value, latent, generator=gen) * latent**-0.5, w_v_dtype, w_v_scale),
        w_v_scale=w_v_scale,
        gate=torch.randn(tokens, heads * value, generator=gen).to(torch.bfloat16),
    )


def ref_attn(batch: Batch, splits: int, mode: str):
    return ref.mla_attn(*batch.layout, splits, kv_scale=batch.kv_scale, latent_dim=batch.w_v.shape[-1], mode=mode)


def ref_back(batch: Batch, o, lse, mode: str):
    return ref.mla_back(o, lse, batch.w_v, batch.gate, w_v_scale=batch.w_v_scale, mode=mode)


def assert_within_budget(name, got, reference, oracle, floor=0.0):
    err, budget = error_and_budget(got, reference, oracle)
    budget += floor
    assert err <= budget, f"{name}: error {err:.3e} against the oracle, budget {budget:.3e}"


# -- the reference, by hand ----------------------------------------------------------------


def plain_attention(batch: Batch, token: int, request: int, visible: int):
    """softmax attention of one token over the first ``visible`` context rows, float64."""
    latent = batch.w_v.shape[-1]
    pages = batch.pages[batch.indptr[request] : batch.indptr[request + 1]]
    rows = ref.context_rows(batch.kv.double() * batch.kv_scale, pages, visible)
    scores = batch.q[token].double() @ rows.T * batch.scale
    return torch.softmax(scores, dim=-1) @ rows[:, :latent], torch.logsumexp(scores, dim=-1)


def test_one_split_is_plain_softmax_attention():
    batch = make_batch([1, 2], [21, 9])
    o, lse = ref_attn(batch, 1, "oracle")
    for token, request, visible in ((0, 0, 21), (1, 1, 8), (2, 1, 9)):
        want_o, want_lse = plain_attention(batch, token, request, visible)
        torch.testing.assert_close(o[0, token], want_o, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[0, token], want_lse, rtol=1e-12, atol=1e-12)


def test_combining_splits_equals_one_split():
    batch = make_batch([1, 2], [37, 9])
    whole_o, whole_lse = ref_attn(batch, 1, "oracle")
    o, lse = ref_attn(batch, 4, "oracle")
    torch.testing.assert_close(ref.combine_splits(o, lse), whole_o[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.logsumexp(lse, dim=0), whole_lse[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref_back(batch, o, lse, "oracle"), ref_back(batch, whole_o, whole_lse, "oracle"),
                               rtol=1e-12, atol=1e-12)


def test_an_empty_split_has_lse_minus_inf_and_weighs_nothing():
    batch = make_batch([1], [3])  # chunks of ceil(3 / 4) = 1 position: split 3 is empty
    o, lse = ref_attn(batch, 4, "oracle")
    assert lse[3].isneginf().all() and (o[3] == 0).all()
    assert lse[:3].isfinite().all()
    garbage = o.clone()
    garbage[3] = 1e3
    assert torch.equal(ref.combine_splits(garbage, lse), ref.combine_splits(o, lse))


def test_two_query_tokens_are_causal():
    batch = make_batch([2], [5])
    o, lse = ref_attn(batch, 1, "oracle")
    page = int(batch.pages[0])
    batch.kv[page, 4] = -3 * batch.kv[page, 4]  # position 4: only the second query token sees it
    moved_o, moved_lse = ref_attn(batch, 1, "oracle")
    assert torch.equal(moved_o[:, 0], o[:, 0]) and torch.equal(moved_lse[:, 0], lse[:, 0])
    assert not torch.equal(moved_o[:, 1], o[:, 1])
    split_o, split_lse = ref_attn(batch, 2, "oracle")  # chunks 0..2 and 3..4: token 0 sees only position 3 of split 1
    want_o, want_lse = plain_attention(batch, 0, 0, 4)
    torch.testing.assert_close(ref.combine_splits(split_o, split_lse)[0], want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.logsumexp(split_lse[:, 0], dim=0), want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale,mode", [(0.037, "bf16"), (0.0625, "oracle")])
def test_fp8_kv_is_its_bf16_dequantisation(scale, mode):
    """bf16 mode rounds fp32(kv) * scale to bf16; the oracle dequantises exactly (a
    power-of-two scale keeps the bf16 copy exact too)."""
    batch = make_batch([1, 2], [30, 7], kv_dtype=FP8)
    batch.kv_scale = scale
    dequantised = Batch(**{**vars(batch), "kv": (batch.kv.float() * scale).to(torch.bfloat16), "kv_scale": 1.0})
    for got, want in zip(ref_attn(batch, 3, mode), ref_attn(dequantised, 3, mode)):
        assert torch.equal(got, want)


# -- the kernels against the oracle ----------------------------------------------------------

ATTN_CASES = {
    # name: (query tokens a request, context lengths, page size, splits, widths, heads)
    "B1-q1-long-splits": ([1], [150], 16, 4, SMALL, 3),
    "B1-q2": ([2], [45], 8, 2, SMALL, 3),
    "B3-mixed-short": ([1, 2, 1], [70, 2, 37], 16, 4, SMALL, 3),
    "B3-real-widths": ([2, 1, 1], [19, 3, 70], 16, 2, REAL, 2),
    # pages of at least a step's positions (mla_attn._step_pages): steps that straddle two pages
    "B1-q1-page-of-a-step": ([1], [150], 32, 4, SMALL, 3),
    "B3-pages-over-a-step": ([1, 2, 1], [70, 2, 137], 64, 3, SMALL, 3),
    "B2-fp8-steps-over-pages": ([1, 2], [300, 171], 64, 2, SMALL, 3),  # splits of 2 and 3 fp8 steps
}


def run_attn_kernel(batch: Batch, splits: int):
    """launch_mla_attn into NaN-poisoned outputs."""
    device_batch = batch.to(DEVICE)
    tokens, heads, _ = batch.q.shape
    o = torch.full((splits, tokens, heads, batch.w_v.shape[-1]), float("nan"), device=DEVICE)
    lse = torch.full((splits, tokens, heads), float("nan"), device=DEVICE)
    launch_mla_attn(*device_batch.layout, o, lse, kv_scale=batch.kv_scale, **mla.attn_tile(batch.kv))
    return o.cpu(), lse.cpu()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_mla_attn_kernel_within_budget(case, kv_dtype):
    queries, lens, page_size, splits, widths, heads = ATTN_CASES[case]
    batch = make_batch(queries, lens, page_size=page_size, heads=heads, widths=widths, kv_dtype=kv_dtype)
    o, lse = run_attn_kernel(batch, splits)
    ref_o, ref_lse = ref_attn(batch, splits, "bf16")
    exact_o, exact_lse = ref_attn(batch, splits, "oracle")

    empty = exact_lse.isneginf()
    assert not o.isnan().any() and not lse.isnan().any(), "unwritten or NaN-polluted outputs"
    assert torch.equal(lse.isneginf(), empty), "empty splits differ"
    assert (o[empty] == 0).all(), "an empty split's o must be 0"
    assert_within_budget("o", o, ref_o, exact_o)
    assert_within_budget("lse", lse[~empty], ref_lse[~empty], exact_lse[~empty], floor=LSE_FLOOR)


@pytest.mark.parametrize("splits", [4, mla.BACK_PAIRS + 3, mla.BACK_SHORT_SPLITS + 1],
                         ids=["short", "short-ragged", "long-ragged"])
@pytest.mark.parametrize("w_v_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_mla_back_kernel_within_budget(w_v_dtype, splits):
    """From the bf16 reference's split outputs, empty splits included (context 2 of
    every split count); up to BACK_SHORT_SPLITS splits a token's combine steps over
    the latent, past it over the splits, BACK_PAIRS a step (the last only partly live)."""
    batch = make_batch([1, 2, 1], [70, 2, 37], w_v_dtype=w_v_dtype)
    o, lse = ref_attn(batch, splits, "bf16")
    assert lse.isneginf().any()
    core = torch.full(batch.gate.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
    launch_mla_back(o.to(DEVICE), lse.to(DEVICE), batch.w_v.to(DEVICE), batch.gate.to(DEVICE), core,
                    w_v_scale=batch.w_v_scale, **dict(mla.BACK_TILE, chunk=batch.w_v.shape[-1] // 2))
    assert not core.isnan().any()
    assert_within_budget("core", core.cpu(), ref_back(batch, o, lse, "bf16"), ref_back(batch, o, lse, "oracle"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_mla_decode_at_the_real_widths_within_budget(dtype):
    batch = make_batch([1, 2], [45, 7], heads=2, widths=REAL, kv_dtype=dtype, w_v_dtype=dtype)
    d = batch.to(DEVICE)
    core = mla.mla_decode(*d.layout, d.w_v, d.gate, kv_scale=d.kv_scale, w_v_scale=d.w_v_scale, splits=2)
    want = ref.mla_decode(*batch.layout, batch.w_v, batch.gate, 2, kv_scale=batch.kv_scale, w_v_scale=batch.w_v_scale)
    exact = ref.mla_decode(*batch.layout, batch.w_v, batch.gate, 2, kv_scale=batch.kv_scale,
                           w_v_scale=batch.w_v_scale, mode="oracle")
    assert_within_budget("core", core.cpu(), want, exact)


@triton.jit
def _ordered_sum_kernel(
    x_ptr,  # fp32 [ROWS, COLS]
    out_ptr,  # fp32 [COLS] out
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    LEVELS: tl.constexpr,
):
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    tl.store(out_ptr + cols, _ordered_sum(tl.load(x_ptr + rows[:, None] * COLS + cols[None, :]), LEVELS))


def test_m1b_sums_the_splits_in_a_fixed_pairwise_order():
    """M1b's sum over splits is the pairwise tree (rows 2i and 2i + 1 first, then
    their sums alike) bit for bit: the order that makes a folded M1b give the M1b
    kernel's bits whatever layouts the two builds choose (a tl.sum follows them)."""
    g = torch.Generator().manual_seed(7)
    rows, cols = 16, 4
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-7, 7, rows)[:, None]  # rounding order shows
    out = torch.full((cols,), float("nan"), device=DEVICE)
    _ordered_sum_kernel[(1,)](x.to(DEVICE), out, ROWS=rows, COLS=cols, LEVELS=rows.bit_length() - 1)
    want = x.clone()
    while want.shape[0] > 1:
        want = want[0::2] + want[1::2]
    assert torch.equal(out.cpu(), want[0])
    assert not torch.equal(want[0], x.cumsum(0)[-1]), "inputs too tame: sequential and tree sums agree"


@triton.jit
def _e4m3_pairs_kernel(
    pairs_ptr,  # [N] uint16: two e4m3 codes each
    even_ptr,  # [N] fp16 out
    odd_ptr,  # [N] fp16 out
    N: tl.constexpr,
):
    i = tl.arange(0, N)
    even, odd = e4m3_pairs_to_fp16(tl.load(pairs_ptr + i))
    tl.store(even_ptr + i, even)
    tl.store(odd_ptr + i, odd)


def test_e4m3_pairs_convert_exactly():
    """Every pair of e4m3 codes (NaN codes aside: a cache holds none) gives torch's
    e4m3 -> fp16 values bit for bit, the even column's code in the low byte."""
    codes = torch.arange(256, dtype=torch.int32)
    pairs = (codes[:, None] << 8 | codes[None, :]).flatten()  # the low byte varies fastest
    even = torch.full(pairs.shape, float("nan"), dtype=torch.float16, device=DEVICE)
    odd = torch.full_like(even, float("nan"))
    _e4m3_pairs_kernel[(1,)](pairs.to(torch.uint16).to(DEVICE), even, odd, N=pairs.numel())
    as_fp16 = codes.to(torch.uint8).view(FP8).to(torch.float16)
    want_even, want_odd = as_fp16.repeat(256), as_fp16.repeat_interleave(256)
    finite = want_even.isfinite() & want_odd.isfinite()
    assert finite.sum() == 254 * 254
    assert torch.equal(even.cpu()[finite].view(torch.int16), want_even[finite].view(torch.int16))
    assert torch.equal(odd.cpu()[finite].view(torch.int16), want_odd[finite].view(torch.int16))


# -- bad input -------------------------------------------------------------------------------

BAD = {
    "q-fp32": ("q", lambda b: b.q.float(), "dtype"),
    "q-2d": ("q", lambda b: b.q[:, 0], "shape"),
    "kv-width": ("kv", lambda b: b.kv[..., :-1], "shape"),
    "kv-fp16": ("kv", lambda b: b.kv.half(), "dtype"),
    "w_v-heads": ("w_v", lambda b: b.w_v[:1], "shape"),
    "w_v-fp32": ("w_v", lambda b: b.w_v.float(), "dtype"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_named_before_any_launch(case, monkeypatch):
    name, corrupt, what = BAD[case]
    launches = []
    monkeypatch.setattr(mla, "launch_mla_attn", lambda *a, **k: launches.append("M1c"))
    monkeypatch.setattr(mla, "launch_mla_back", lambda *a, **k: launches.append("M1b"))
    batch = make_batch([1], [20])
    setattr(batch, name, corrupt(batch))
    with pytest.raises(K3InputError, match=rf"^{name}: .*{what}"):
        mla.mla_decode(*batch.layout, batch.w_v, batch.gate, kv_scale=batch.kv_scale, splits=2)
    assert launches == []


def test_fp8_cache_rows_at_odd_bytes_are_refused():
    """The fp8 latent columns are read two bytes at a time: a row at an odd byte is named."""
    batch = make_batch([1], [20], kv_dtype=FP8)
    pages, page_size, dqk = batch.kv.shape
    wider = torch.zeros(pages, page_size, dqk + 1, dtype=FP8)
    wider[..., :dqk] = batch.kv
    batch.kv = wider[..., :dqk]  # row stride dqk + 1, odd
    o, lse = (t.fill_(float("nan")) for t in mla.split_outputs(batch.q, 2, batch.w_v.shape[-1]))
    with pytest.raises(K3InputError, match=r"^kv: an fp8 cache's rows must start at even bytes"):
        launch_mla_attn(*batch.layout, o, lse, kv_scale=batch.kv_scale, **mla.attn_tile(batch.kv))
    assert o.isnan().all() and lse.isnan().all(), "nothing may be written"


def test_a_positional_width_below_two_dot_halves_is_refused():
    """M1c takes the rope columns in two halves, each a dot's K: 16 of them are named, nothing written."""
    batch = make_batch([1], [20], widths=(32, 16, 16))
    o, lse = (t.fill_(float("nan")) for t in mla.split_outputs(batch.q, 2, batch.w_v.shape[-1]))
    with pytest.raises(K3InputError, match=r"^q: expected DQK - DL \(the positional width\) a power of two >= 32, "
                                           r"got 16"):
        launch_mla_attn(*batch.layout, o, lse, kv_scale=batch.kv_scale, **mla.attn_tile(batch.kv))
    assert o.isnan().all() and lse.isnan().all(), "nothing may be written"


def test_bf16_kv_with_a_scale_is_refused():
    batch = make_batch([1], [20])
    with pytest.raises(K3InputError, match=r"^kv_scale: "):
        mla.mla_decode(*batch.layout, batch.w_v, batch.gate, kv_scale=0.5, splits=2)


def test_bench_inputs_are_valid_requests_and_the_floor_counts_their_bytes():
    from k3mono.bench_mla import PAGE_SIZE, make_inputs
    from k3mono.reference.mla import check_requests

    for kv_dtype, itemsize in (("fp8", 1), ("bf16", 2)):
        inputs = make_inputs(3, 2 * PAGE_SIZE + 5, kv_dtype, "cpu", seed=1, heads=2)
        check_requests(inputs.q, inputs.kv, inputs.qsl, inputs.seq_lens, inputs.pages, inputs.indptr)
        assert sorted(inputs.pages.tolist()) == list(range(9)) and inputs.pages.tolist() != list(range(9))
        assert inputs.cache_bytes == 3 * (2 * PAGE_SIZE + 5) * 576 * itemsize
        small = 3 * 2 * 576 * 2 + 2 * 128 * 512 * 2 + 3 * 2 * 128 * 2
        assert inputs.floor_bytes == inputs.cache_bytes + small


def test_bench_calls_compute_what_mla_decode_computes():
    """The benchmark's fixed-buffer calls (captured in CUDA graphs there) are the staged path."""
    from k3mono.bench_mla import attn_call, back_call, make_inputs
    from k3mono.mla import mla_decode

    inputs = make_inputs(2, 70, "fp8", "cpu", seed=2, heads=2, page_size=16)
    attn, o, lse = attn_call(inputs, splits=4)
    back, core = back_call(inputs, o, lse)
    core.fill_(float("nan"))
    attn()
    back()
    want = mla_decode(inputs.q, inputs.kv, inputs.qsl, inputs.seq_lens, inputs.pages, inputs.indptr, inputs.scale,
                      inputs.w_v, inputs.gate, kv_scale=inputs.kv_scale, splits=4)
    assert torch.equal(core.view(torch.int16), want.view(torch.int16))


def test_bench_m1b_runners_run_rank_0_with_m1b_folded_in():
    """What bench --mla replays: rank 0's loopback launch with M1b first, on inputs
    m1b_inputs made; here run once under the interpreter."""
    from k3mono.bench_mla import m1b_runners
    from k3mono.config import preset
    from k3mono.synthetic import random_shard

    cfg = preset("tiny")
    (runner,) = m1b_runners(cfg, 2, 1, [random_shard(cfg, 2, seed=0, device="cpu")], layer=13)
    assert runner.compiled.table.tasks[0].kind.name == "M1B"
    runner.poison()
    runner.launch(0)
    runner.check_health()
    assert torch.isfinite(runner.result(0).moe_out.float()).all()


def test_bench_fused_mla_calls_run_the_three_ways_to_the_same_outputs():
    """What bench --mla times for an MLA layer: M1c, M1b and the plain launch
    separately; M1c then the launch with M1b folded in; the launch with both
    folded in. Run once each under the interpreter: the same bits out, the
    fields given set on every way (the M1C tasks' stages on the third's)."""
    from k3mono.bench_mla import mla_fused_calls
    from k3mono.config import preset
    from k3mono.synthetic import random_shard

    cfg = preset("tiny")
    calls = mla_fused_calls(cfg, 1, 2, 70, "fp8", random_shard(cfg, 1, seed=0, device="cpu"), layer=13,
                            folded_tile=True, fields={"ctas_per_sm": 3, "m1c_stages": 3})
    assert [runner.key.options.ctas_per_sm for runner in calls["runners"]] == [3, 3, 3]  # given: every way's
    assert calls["runners"][2].compiled.table.geometry.m1c.stages == 3
    outs = []
    for name, runner in zip(("separate", "m1b", "m1c"), calls["runners"]):
        runner.poison()
        calls[name]()
        runner.check_health()
        outs.append(runner.result(0).moe_out)
    assert torch.isfinite(outs[0].float()).all()
    assert all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])


_M1B_MEMORY_ORDER = textwrap.dedent(
    """
    from k3mono import mla, offline

    compiled, _ = offline.m1b_build(1, mla.BACK_TILE["short_splits"])
    ops = [op for op, _ in offline.memory_order(compiled)]
    first_wait = min(ops.index("STS"), ops.index("LDG"))  # a shared store, or the lse the weights wait for
    assert ops[:first_wait].count("LDGSTS") >= mla.BACK_TILE["stages"] - 1, ops
    print("ok")
    """
)


def test_m1b_short_combine_copies_its_first_steps_before_any_wait(run_compiled):
    """The short combine's pipeline, built offline for Hopper (no GPU): the
    cp.async copies of its first STAGES - 1 latent steps are all issued before
    the lse loads (the split weights wait for them) and before the first shared
    store, the places where a thread would first wait on a load.
    Runs in a child process: the interpreter, on in this one, cannot compile."""
    run_compiled(_M1B_MEMORY_ORDER, timeout=300)


_M1C_COPIES_IN_FLIGHT = textwrap.dedent(
    """
    from k3mono import offline
    from k3mono.config import MAX_TOKENS, preset
    from k3mono.mono import default_ctas_per_sm
    from k3mono.planner import attn_steps

    for kv in ("bf16", "fp8"):
        block_n, stages = attn_steps(kv == "fp8")
        compiled, _ = offline.m1c_build(kv, 4, 66, 4096, dict(block_n=block_n, stages=stages))
        assert offline.copies_left_in_flight(compiled) > 0, kv
    cfg = preset("kimi-k3")
    for kv in ("fp8", "bf16"):
        compiled, _ = offline.mono_build(cfg, 8, MAX_TOKENS, loopback=True, mla="m1c", kv=kv)
        fits = offline.ctas_per_sm(offline.resource_usage(compiled), compiled.metadata.num_warps)
        assert fits >= default_ctas_per_sm(MAX_TOKENS, m1c_folded=True), (kv, fits)
    print("ok")
    """
)


def test_m1c_keeps_copies_in_flight_and_its_fold_fits_the_planned_ctas(run_compiled):
    """Built offline for Hopper (no GPU): M1c's context loop launched alone, at
    either cache's tile, leaves copies in flight at its wait (the page ids a
    step ahead, kernels/mla_attn.py _page_pair), and the mono launch with M1c
    folded in over either cache fits the CTAs a SM planned at MAX_TOKENS (the
    tasks' shared memory, planner.ATTN_FOLDED_STAGES).
    Runs in a child process: the interpreter, on in this one, cannot compile."""
    run_compiled(_M1C_COPIES_IN_FLIGHT, timeout=900)
