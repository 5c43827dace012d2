"""The MoE stage kernels (route, expert gate/up, expert down) and the MXFP4
register dequantisation against the reference (bf16 mode) and mxfp4.dequantize.

Every output starts poisoned (NaN, ids -1) inside a larger poisoned buffer:
an element the kernel skips stays poisoned, a write outside its region spoils
poison that must survive.

Tolerances, and why a real bug still fails them:

* Dequantisation and routing ids are exact. Ids go through the same fp32
  sigmoid + bias on both sides up to an ulp of the sigmoid, far below the
  gaps between random scores; exact ties are constructed, not left to chance.
* Route weights: 1e-6 relative (a sigmoid ulp is 6e-8; a wrong or missing
  renormalisation is off by percents).
* Expert activations (bf16): g and u are fp32 dots summed in another order
  than torch's, so a value next to a bf16 rounding boundary may round the
  other way, and situ carries the flip on. At most 1 % (+1) of the elements
  may differ, each by at most CHAINED_ULPS bf16 steps (one flip of g or u
  moves act by about one step, more where situ is steep), or by less than
  1e-5 of the row's RMS (a value that cancelled to near zero, whose ulp is
  far below the fp32 error of its terms). Observed: 0.07 % of the elements,
  1 step except on such near-zero values. Any indexing error (nibble order, scale,
  expert, row, token) moves nearly every element by many steps; a missing or
  truncating bf16 rounding moves a third to a half of them.
* Latent partial (fp32, unrounded): against a float64 sum of the same terms,
  each element within 1e-5 of sum_j |w_j| (|act_j| @ |w2_j|.T), the size of
  its terms: fp32 reordering stays near 1e-7 of it, while one wrong, missing
  or doubled term (a slot, a group, a scale) is about 1 / (K * I/T) of it or
  more, above 1e-5 at these sizes.
* The chained check against reference.stages.routed_experts (the tp.py spec
  with round_outputs=False) adds the exact effect of the act differences
  above: sum_j |w_j| (|act_kernel - act_ref|_j @ |w2_j|.T).

Run time: the interpreter's cost is per program, so the S = 16 cases run
with eight times the rows per task: fewer, larger
programs, the same code with other constexprs. Every other case runs the
planner's geometry.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
import zlib

import pytest
import torch
import triton

from k3mono import mxfp4
from k3mono.config import MXFP4_GROUP, preset
from k3mono.errors import K3InputError
from k3mono.kernels.experts import (
    launch_expert_down,
    launch_expert_down_mma,
    launch_expert_gate_up,
    launch_expert_gate_up_mma,
)
from k3mono.kernels import experts as experts_mod
from k3mono.kernels.mxfp4 import DEQUANT_F16, DEQUANT_IMAD, DEQUANT_SHIFT, launch_dequant
from k3mono.kernels.route import launch_route
from k3mono.layout import ROUTE_PART_ROWS
from k3mono.planner import TileChoice, expert_step_groups, next_pow2, stage_geometry
from k3mono.reference import BF16, ORACLE
from k3mono.reference import stages as st
from k3mono.runner import rel_err
from k3mono.synthetic import random_layer
from k3mono.weights import shard

TPS = (1, 2, 4)
TOKENS = (1, 3, 16)
NAN = float("nan")
GUARD = 64  # poisoned elements on each side of an output
ROUTE_REL = 1e-6
PARTIAL_REL = 1e-5
CANCEL_REL = 1e-5
ROUNDED_FRACTION = 0.01
CHAINED_ULPS = 2
COARSE_ROWS = 8  # rows-per-task multiplier for the interpreter-heavy cases (masks rows too)


# -- helpers ---------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The references are many small torch ops: with intra-op threads they slow
    down a hundredfold whenever another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def layer_weights(name: str):
    return random_layer(preset(name), seed=0)


def seed_of(*parts) -> int:
    """A fresh but reproducible seed per test case (hash() of a str varies per process)."""
    return zlib.crc32(repr(parts).encode())


def rank_weights(name: str, tp: int):
    """The last rank's shard: a nonzero rank for tp > 1, so slicing errors show."""
    cfg = preset(name)
    return cfg, shard(layer_weights(name), cfg, tp, tp - 1)


def poisoned(shape, dtype, fill):
    """A view of ``shape`` inside a flat buffer of ``fill`` with GUARD extra on both ends."""
    n = 1
    for d in shape:
        n *= d
    flat = torch.full((n + 2 * GUARD,), fill, dtype=dtype)
    return flat, flat[GUARD : GUARD + n].view(shape)


def assert_guards(flat: torch.Tensor, fill, name: str) -> None:
    for part in (flat[:GUARD], flat[-GUARD:]):
        ok = torch.isnan(part.float()).all() if fill != fill else (part == fill).all()
        assert ok, f"{name}: written outside its region"


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (sign-magnitude bits made monotone)."""

    def key(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        mag = bits & 0x7FFF
        return torch.where(bits < 0, -mag, mag)

    return (key(a) - key(b)).abs()


def random_routes(cfg, tokens: int, seed: int):
    """Reference routes (ids [S, K] int64, weights [S, K] fp32) of random logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, cfg.num_experts, generator=g)
    bias = torch.randn(cfg.num_experts, generator=g) * 0.05
    return st.route(BF16, logits, bias, cfg.num_experts_per_token, cfg.routed_scaling_factor)


def experts_geometry(cfg, tp: int, tokens: int, coarse: bool):
    geom = stage_geometry(cfg, tp, tokens)
    if not coarse:
        return geom
    more = lambda tile: dataclasses.replace(tile, rows=tile.rows * COARSE_ROWS)  # noqa: E731
    return dataclasses.replace(geom, expert_gate_up=more(geom.expert_gate_up), expert_down=more(geom.expert_down))


def dequant(packed, scale, expert: int) -> torch.Tensor:
    return mxfp4.dequantize(packed[expert], scale[expert])


# -- MXFP4 in registers ------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 6 * 2^127 is inf, as in the reference
@pytest.mark.parametrize("dequant", [DEQUANT_SHIFT, DEQUANT_IMAD, DEQUANT_F16])
def test_dequant_every_scale_byte_exact(dequant):
    g = torch.Generator().manual_seed(11)
    rows, groups = 254, 3  # 3 groups: a masked fourth column in the kernel
    scale = torch.stack([torch.randperm(254, generator=g) + 1 for _ in range(groups)], dim=1).to(torch.uint8)
    assert set(scale[:, 0].tolist()) == set(range(1, 255))
    packed = torch.randint(0, 256, (rows, groups * 16), generator=g, dtype=torch.uint8)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every byte: every nibble in both halves
    flat, out = poisoned((rows, groups * 32), torch.float32, NAN)
    launch_dequant(mxfp4.f16_order(packed) if dequant == DEQUANT_F16 else packed, scale, out, dequant)
    want = mxfp4.dequantize(packed, scale)
    # Bitwise: -0 (nibble 8), the subnormal 2^-127 (0.5 at byte 1) and the inf
    # of 6 * 2^127 must all match.
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert_guards(flat, NAN, "dequant")


# -- route -----------------------------------------------------------------------------


def route_keys(cfg, geom) -> torch.Tensor:
    """The route parts' keys and scores (layout.scratch_layout's route_keys), poisoned."""
    parts = -(-cfg.num_experts // geom.route_chunk)
    shape = (geom.tokens, parts, ROUTE_PART_ROWS, triton.next_power_of_2(cfg.num_experts_per_token))
    return torch.full(shape, -1, dtype=torch.int64)


def run_route(cfg, logits, bias):
    S, K = logits.shape[0], cfg.num_experts_per_token
    ids_flat, ids = poisoned((S, K), torch.int32, -1)
    w_flat, w = poisoned((S, K), torch.float32, NAN)
    geom = stage_geometry(cfg, 1, S)
    launch_route(logits, bias, ids, w, route_keys(cfg, geom), geom, cfg)
    assert_guards(ids_flat, -1, "route_ids")
    assert_guards(w_flat, NAN, "route_w")
    return ids, w


def check_route(cfg, logits, bias):
    ids, w = run_route(cfg, logits, bias)
    want_ids, want_w = st.route(BF16, logits, bias, cfg.num_experts_per_token, cfg.routed_scaling_factor)
    assert torch.equal(ids.long(), want_ids), "route ids differ from the reference"
    assert torch.isfinite(w).all()
    rel = ((w.double() - want_w.double()).abs() / want_w.double().abs()).max().item()
    assert rel <= ROUTE_REL, f"route weights off by {rel:.3g} relative"
    return ids


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("name", ["tiny", "small", "kimi-k3"])
def test_route_random(name, tokens):
    cfg = preset(name)
    g = torch.Generator().manual_seed(seed_of("route", name, tokens))
    logits = torch.randn(tokens, cfg.num_experts, generator=g) * 2
    bias = torch.randn(cfg.num_experts, generator=g) * 0.05
    check_route(cfg, logits, bias)


@pytest.mark.parametrize("name", ["tiny", "kimi-k3"])
def test_route_exact_tie_at_the_boundary(name):
    """Two experts with equal biased scores in places K and K+1: the lower id is in."""
    cfg = preset(name)
    K, S = cfg.num_experts_per_token, 4
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(S, cfg.num_experts, generator=g)
    bias = torch.randn(cfg.num_experts, generator=g) * 0.05
    pairs = []
    for s in range(S):
        order = torch.argsort(torch.sigmoid(logits[s]) + bias, descending=True)
        inside, outside = int(order[K - 1]), int(order[K])
        # Alternate which of the two carried the higher score before the tie.
        low, high = sorted((inside, outside))
        keep, copy = (high, low) if s % 2 else (low, high)
        logits[s, copy] = logits[s, keep]
        bias[copy] = bias[keep]  # shared by every token: later tokens re-check their own pair
        pairs.append((low, high))
    for s, (low, high) in enumerate(pairs):
        scores = torch.sigmoid(logits[s]) + bias
        assert scores[low] == scores[high]
    ids = check_route(cfg, logits, bias)
    for s, (low, high) in enumerate(pairs):
        scores = torch.sigmoid(logits[s]) + bias
        above = int((scores > scores[low]).sum())
        if above == K - 1:  # the pair still straddles the boundary
            assert low in ids[s].tolist() and high not in ids[s].tolist()


def test_route_all_equal_scores_pick_the_lowest_ids():
    cfg = preset("small")
    S = 2
    logits = torch.zeros(S, cfg.num_experts)
    bias = torch.zeros(cfg.num_experts)
    ids = check_route(cfg, logits, bias)
    assert ids.tolist() == [list(range(cfg.num_experts_per_token))] * S


def test_route_negative_scores_multiway_ties_and_zero():
    """The packed keys (kernels/route.py) of both signs:
    biased scores below zero, a run of eight equal scores straddling the K
    boundary (three in, the rest out, by id), and a tie at exactly zero."""
    cfg = preset("kimi-k3")
    K, E, S = cfg.num_experts_per_token, cfg.num_experts, 3
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(S, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.05 - 2.0  # every biased score negative
    # token 1: the 8 best biased scores set equal to the 14th best: places 14..21 tie
    order = torch.argsort(torch.sigmoid(logits[1]) + bias, descending=True)
    logits[1, order[13:21]] = logits[1, order[13]].clone()
    bias[order[13:21]] = bias[order[13]].clone()
    # token 2: six biased scores of exactly 0.0 at the boundary (sigmoid(0) = 0.5, bias -0.5)
    logits[2] = -8.0
    ids0 = torch.arange(K - 2, K + 4) * 7
    logits[2, ids0] = 0.0
    bias[ids0] = -0.5
    zeros = torch.sigmoid(logits[2, ids0]) + bias[ids0]
    assert (zeros == 0).all()
    logits[2, : K - 2] = 4.0  # K - 2 clear winners: two of the six zeros get in, the lowest ids
    bias[: K - 2] = 0.0
    ids, _ = run_route(cfg, logits, bias)
    check_route(cfg, logits, bias)
    assert ids[2].tolist() == sorted(list(range(K - 2)) + ids0[:2].tolist())


# -- experts ---------------------------------------------------------------------------


def run_experts(cfg, w, geom, z, ids, route_w, tp: int):
    S, K, L = z.shape[0], cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    I_r = cfg.moe_intermediate_size // tp
    act_flat, act = poisoned((S, K, I_r), torch.bfloat16, NAN)
    launch_expert_gate_up(z, ids, w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, act, geom, cfg)
    assert_guards(act_flat, NAN, "expert_act")
    # The partial lands in one rank's slot of an AR2-shaped buffer, as in the staged driver.
    ar2 = torch.full((tp + 1, S, L), NAN)
    launch_expert_down(act, ids, route_w, w.w2_packed, w.w2_scale, ar2[tp - 1], geom, cfg)
    others = [t for t in range(tp + 1) if t != tp - 1]
    assert torch.isnan(ar2[others]).all(), "latent_partial: written outside its slot"
    return act, ar2[tp - 1]


def reference_act(cfg, w, z, ids) -> torch.Tensor:
    S, K = ids.shape
    out = torch.empty(S, K, w.w1_packed.shape[1])
    for s in range(S):
        for j in range(K):
            e = int(ids[s, j])
            w1, w3 = dequant(w.w1_packed, w.w1_scale, e), dequant(w.w3_packed, w.w3_scale, e)
            out[s, j] = st.expert_hidden(BF16, z[s : s + 1].float(), w1, w3, cfg)[0]
    return out


def down_terms(w, ids, route_w, act):
    """(float64 sum_j w_j act_j @ w2_j.T, sum_j |w_j| |act_j| @ |w2_j|.T), each [S, L]."""
    S, K = ids.shape
    exact = torch.zeros(S, w.w2_packed.shape[1], dtype=torch.float64)
    size = torch.zeros_like(exact)
    for s in range(S):
        for j in range(K):
            w2 = dequant(w.w2_packed, w.w2_scale, int(ids[s, j])).double()
            a = act[s, j].double()
            exact[s] += float(route_w[s, j]) * (a @ w2.T)
            size[s] += abs(float(route_w[s, j])) * (a.abs() @ w2.abs().T)
    return exact, size


def assert_act(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got.float()).all(), "expert_act: unwritten elements"
    want = want.to(torch.bfloat16)
    ulps = bf16_ulps(got, want)
    off = int((ulps > 0).sum())
    assert off <= 1 + ROUNDED_FRACTION * got.numel(), f"expert_act: {off} of {got.numel()} elements off"
    rms = want.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    far = (got.float() - want.float()).abs() > CANCEL_REL * rms
    worst = int(ulps[far].max()) if far.any() else 0
    assert worst <= CHAINED_ULPS, f"expert_act: an element {worst} bf16 ulps off"


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, name: str) -> None:
    assert torch.isfinite(got).all(), f"{name}: unwritten elements"
    err = (got.double() - want.double()).abs()
    worst = (err / (bound + 1e-30)).max().item()
    assert worst <= 1.0, f"{name}: error {worst:.3g} x the bound"


EXPERT_CASES = [(name, tp, s, s == 16) for name in ("tiny", "small") for tp in TPS for s in TOKENS]
# The other MXFP4 placement (the default is mxfp4.DEFAULT_DEQUANT) on a few cases.
OTHER_PLACEMENT_CASES = [("tiny", 2, 3, False), ("small", 4, 1, False)]


@pytest.mark.parametrize("name,tp,tokens,coarse", OTHER_PLACEMENT_CASES)
def test_experts_other_placement(name, tp, tokens, coarse, monkeypatch):
    other = DEQUANT_SHIFT if experts_mod.EXPERT_DEQUANT == DEQUANT_IMAD else DEQUANT_IMAD
    monkeypatch.setattr(experts_mod, "EXPERT_DEQUANT", other)
    test_experts(name, tp, tokens, coarse)


@pytest.mark.parametrize("name,tp,tokens,coarse", EXPERT_CASES)
def test_experts(name, tp, tokens, coarse):
    cfg, _ = rank_weights(name, tp)
    check_experts(name, tp, tokens, experts_geometry(cfg, tp, tokens, coarse))


@pytest.mark.parametrize("name,tp,tokens", [("tiny", 2, 3), ("small", 1, 16), ("small", 4, 8)])
def test_experts_with_wide_down_steps(name, tp, tokens):
    """TileChoice.down_rows 64 and down_step_kb 16: twice the rows and twice the
    bytes a down step (the released dims are too large for the interpreter here;
    gpu_check runs them)."""
    cfg, _ = rank_weights(name, tp)
    geom = stage_geometry(cfg, tp, tokens, tiles=TileChoice(down_rows=64, down_step_kb=16))
    L, columns = cfg.routed_expert_hidden_size, cfg.num_experts_per_token * cfg.moe_intermediate_size // tp
    assert geom.expert_down.rows == min(64, next_pow2(L))
    assert geom.expert_down.block_k == min(expert_step_groups(64, 2) * 32, next_pow2(columns))
    check_experts(name, tp, tokens, geom)


def check_experts(name, tp, tokens, geom):
    """Both expert stages at ``geom`` against the reference's act and the float64 down sum."""
    cfg, w = rank_weights(name, tp)
    seed = seed_of("experts", name, tp, tokens)
    ids, route_w = random_routes(cfg, tokens, seed)
    g = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(tokens, cfg.routed_expert_hidden_size, generator=g).to(torch.bfloat16)

    act, partial = run_experts(cfg, w, geom, z, ids.to(torch.int32), route_w, tp)

    # gate/up + situ against the reference expert_hidden on the rank's slice.
    want_act = reference_act(cfg, w, z, ids)
    assert_act(act, want_act)

    # down: the same act in, float64 sum of the same terms.
    exact, size = down_terms(w, ids, route_w, act.float())
    assert_within(partial, exact, PARTIAL_REL * size, "latent_partial")

    # The chain against the spec: reference.tp's per-rank routed_experts (no rounding).
    spec = st.routed_experts(BF16, z.float(), ids, route_w, w, cfg, round_outputs=False)
    _, act_gap = down_terms(w, ids, route_w, act.float() - want_act)
    assert_within(partial, spec.double(), PARTIAL_REL * size + act_gap * (1 + PARTIAL_REL), "latent_partial vs spec")


MMA_CASES = [("tiny", 2, 3), ("tiny", 4, 1), ("small", 4, 2), ("small", 1, 1)]
PRESCALE = 2.0**63  # kernels/mxfp4.py ACT_PRESCALE: the tensor-core stages' activations


def prescaled(t: torch.Tensor) -> torch.Tensor:
    return (t.double() * PRESCALE).to(torch.bfloat16)  # exact: a power of two


@pytest.mark.parametrize("name,tp,tokens", MMA_CASES)
def test_experts_on_tensor_cores(name, tp, tokens):
    """The tensor-core stages (weights in mma order, activations times 2^63)
    against the FMA stages' references: act within the same chained rounding,
    the partial within the float64 sum's bound. tiny's L (3 groups) and I/T
    (1 or 2 groups) leave most of a step's group columns empty."""
    cfg, w = rank_weights(name, tp)
    S, K, L = tokens, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    I_r = cfg.moe_intermediate_size // tp
    seed = seed_of("experts-mma", name, tp, tokens)
    ids, route_w = random_routes(cfg, tokens, seed)
    g = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(tokens, L, generator=g).to(torch.bfloat16)
    words = {n: mxfp4.mma_order(getattr(w, f"{n}_packed")) for n in ("w1", "w3", "w2")}

    act_flat, act = poisoned((S, K, I_r), torch.bfloat16, NAN)
    launch_expert_gate_up_mma(prescaled(z), ids.to(torch.int32), words["w1"], w.w1_scale, words["w3"], w.w3_scale,
                              act, S, cfg)
    assert_guards(act_flat, NAN, "act_prescaled")
    unscaled = (act.double() / PRESCALE).to(torch.bfloat16)
    assert_act(unscaled, reference_act(cfg, w, z, ids))

    partial_flat, partial = poisoned((S, L), torch.float32, NAN)
    launch_expert_down_mma(act, ids.to(torch.int32), route_w, words["w2"], w.w2_scale, partial, S, cfg)
    assert_guards(partial_flat, NAN, "latent_partial")
    exact, size = down_terms(w, ids, route_w, unscaled.float())
    assert_within(partial, exact, PARTIAL_REL * size, "latent_partial")


F16_CASES = [("tiny", 2, 3), ("tiny", 1, 1), ("small", 4, 2), ("small", 1, 16)]
F16_UNIT = 2.0**-11  # f16's unit roundoff
F16_ROUNDINGS = 7  # on a product's way to its group's fp32 sum: 4 HFMA2 in its word, up to 3 HADD2 across words
F16_ACT_BUDGET = 4.0
"""Times the bf16 reference's own error against float64 that act may err with
its g and u summed in f16. f16 sums err absolutely, by about 2^-11 of their
terms' size; the reference's bf16 rounding of g and u relatively, by up to 2^-9
of g and u. On O(1) inputs the f16 path's act error is within 1.1x of the
reference's (interpreter, tiny preset); on a token of z times 300 situ
saturates, which removes most of the reference's error but not the f16 sums'
error on elements whose u cancels to near zero: 3.1x there. A wrong nibble,
scale, pair or token scale moves act by whole units of its size. The layer
runs are held to runner.BUDGET_FACTOR (tests/test_mono.py, test_staged.py)."""


def oracle_act(cfg, w, z, ids) -> torch.Tensor:
    """act in float64 from the bf16 z (the oracle of the stage; no rounding)."""
    S, K = ids.shape
    out = torch.empty(S, K, w.w1_packed.shape[1], dtype=torch.float64)
    for s in range(S):
        for j in range(K):
            e = int(ids[s, j])
            w1, w3 = dequant(w.w1_packed, w.w1_scale, e).double(), dequant(w.w3_packed, w.w3_scale, e).double()
            out[s, j] = st.expert_hidden(ORACLE, z[s : s + 1].double(), w1, w3, cfg)[0]
    return out


@pytest.mark.parametrize("name,tp,tokens", F16_CASES)
def test_experts_summing_in_f16(name, tp, tokens):
    """Weights in f16 order (TileChoice.expert_f16): each group summed in f16.
    act is held to F16_ACT_BUDGET times the bf16 reference's own error against
    float64, each token's z scaled by its own power of two: a z of large (300)
    or small (1e-3) magnitude must neither overflow f16 nor lose precision. The partial, on
    the kernel's own act, is within the f16 rounding bound of its terms
    (F16_ROUNDINGS unit roundoffs of sum_j |w_j| |act_j| @ |w2_j|.T), and
    its typical error far below it: a wrong or missing term (a nibble, a
    scale, a pair's activation) is off by a whole term on every element."""
    cfg, w = rank_weights(name, tp)
    S, K, L = tokens, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    seed = seed_of("experts-f16", name, tp, tokens)
    ids, route_w = random_routes(cfg, tokens, seed)
    g = torch.Generator().manual_seed(seed + 1)
    z = (torch.randn(tokens, L, generator=g) * torch.tensor([1.0, 300.0, 1e-3])[torch.arange(tokens) % 3, None])
    z = z.to(torch.bfloat16)
    f16 = {n: mxfp4.f16_order(getattr(w, f"{n}_packed")) for n in ("w1", "w3", "w2")}
    geom = stage_geometry(cfg, tp, tokens)

    act_flat, act = poisoned((S, K, cfg.moe_intermediate_size // tp), torch.bfloat16, NAN)
    launch_expert_gate_up(z, ids.to(torch.int32), f16["w1"], w.w1_scale, f16["w3"], w.w3_scale, act, geom, cfg)
    assert_guards(act_flat, NAN, "expert_act")
    exact = oracle_act(cfg, w, z, ids)
    for s in range(S):  # each token against its own scale of error
        ref_err = rel_err(reference_act(cfg, w, z[s : s + 1], ids[s : s + 1]), exact[s : s + 1])
        err = rel_err(act[s : s + 1], exact[s : s + 1])
        assert err <= F16_ACT_BUDGET * ref_err, f"token {s}: act error {err:.3g}, budget {F16_ACT_BUDGET * ref_err:.3g}"

    partial_flat, partial = poisoned((S, L), torch.float32, NAN)
    launch_expert_down(act, ids.to(torch.int32), route_w, f16["w2"], w.w2_scale, partial, geom, cfg)
    assert_guards(partial_flat, NAN, "latent_partial")
    want, size = down_terms(w, ids, route_w, act.float())
    assert_within(partial, want, F16_ROUNDINGS * F16_UNIT * size, "latent_partial")
    typical = ((partial.double() - want).norm() / size.norm()).item()
    assert typical <= F16_UNIT, f"latent_partial: typical error {typical:.3g} of its terms' size"


def test_f16_order_is_named_where_it_is_missing_or_unasked():
    """Bytes in f16 order are int8: a launch told DEQUANT_F16 refuses the
    checkpoint's bytes, one told another placement refuses int8, and w1 and
    w3 must come in one order."""
    cfg, w = rank_weights("tiny", 2)
    S, K, L = 1, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    geom = stage_geometry(cfg, 2, S)
    ids = torch.zeros(S, K, dtype=torch.int32)
    act = torch.zeros(S, K, cfg.moe_intermediate_size // 2, dtype=torch.bfloat16)
    z = torch.zeros(S, L, dtype=torch.bfloat16)
    w1, w2 = mxfp4.f16_order(w.w1_packed), mxfp4.f16_order(w.w2_packed)
    with pytest.raises(K3InputError, match="w1_packed: dequant DEQUANT_F16 needs int8"):
        launch_expert_gate_up(z, ids, w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, act, geom, cfg,
                              dequant=DEQUANT_F16)
    with pytest.raises(K3InputError, match="w2_packed: int8 bytes in f16 order need dequant DEQUANT_F16"):
        launch_expert_down(act, ids, torch.zeros(S, K), w2, w.w2_scale, torch.zeros(S, L), geom, cfg,
                           dequant=DEQUANT_IMAD)
    with pytest.raises(K3InputError, match="w3_packed: expected torch.int8"):
        launch_expert_gate_up(z, ids, w1, w.w1_scale, w.w3_packed, w.w3_scale, act, geom, cfg)
    with pytest.raises(K3InputError, match="f16_order: expected uint8"):
        mxfp4.f16_order(w1)


def test_tensor_core_launchers_want_weights_in_mma_order():
    cfg, w = rank_weights("tiny", 2)
    S, K, L = 1, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    ids = torch.zeros(S, K, dtype=torch.int32)
    act = torch.zeros(S, K, cfg.moe_intermediate_size // 2, dtype=torch.bfloat16)
    z = torch.zeros(S, L, dtype=torch.bfloat16)
    with pytest.raises(K3InputError, match="w1_packed.*int32"):  # the checkpoint's bytes, not mma order
        launch_expert_gate_up_mma(z, ids, w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, act, S, cfg)
    w2 = mxfp4.mma_order(w.w2_packed)
    with pytest.raises(K3InputError, match="w2_scale"):
        launch_expert_down_mma(act, ids, torch.zeros(S, K), w2, w.w1_scale, torch.zeros(S, L), S, cfg)
    with pytest.raises(K3InputError, match="w2_packed"):  # mma order to the FMA stage
        launch_expert_down(act, ids, torch.zeros(S, K), w2, w.w2_scale, torch.zeros(S, L), stage_geometry(cfg, 2, S),
                           cfg)


LOOKAHEAD_STEP_GROUPS = 2
"""MXFP4 groups an expert step loads in the lookahead test: the presets' loops
then run several steps (tiny's gate/up 2, the last one ragged; small's 4 and 16)."""


@pytest.mark.parametrize("name,tp,tokens", [("tiny", 2, 3), ("small", 4, 2)])
def test_expert_lookahead_changes_no_bits(name, tp, tokens):
    """Loading a step ahead moves the loads, not the sums: the same bits, over
    loops of several steps whose last lookahead loads nothing."""
    cfg, w = rank_weights(name, tp)
    seed = seed_of("lookahead", name, tp, tokens)
    ids, route_w = random_routes(cfg, tokens, seed)
    g = torch.Generator().manual_seed(seed + 1)
    z = torch.randn(tokens, cfg.routed_expert_hidden_size, generator=g).to(torch.bfloat16)
    short = lambda tile: dataclasses.replace(tile, block_k=LOOKAHEAD_STEP_GROUPS * MXFP4_GROUP)  # noqa: E731
    runs = []
    for ahead in (False, True):
        geom = stage_geometry(cfg, tp, tokens, tiles=TileChoice(expert_lookahead=ahead))
        assert geom.expert_gate_up.lookahead == geom.expert_down.lookahead == ahead
        geom = dataclasses.replace(geom, expert_gate_up=short(geom.expert_gate_up), expert_down=short(geom.expert_down))
        runs.append(run_experts(cfg, w, geom, z, ids.to(torch.int32), route_w, tp))
    (act, partial), (act_ahead, partial_ahead) = runs
    assert torch.equal(act.view(torch.int16), act_ahead.view(torch.int16))
    assert torch.equal(partial.view(torch.int32), partial_ahead.view(torch.int32))


def test_expert_launchers_check_their_inputs():
    cfg, w = rank_weights("tiny", 2)
    S, K, L = 1, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    geom = stage_geometry(cfg, 2, S)
    ids = torch.zeros(S, K, dtype=torch.int32)
    act = torch.zeros(S, K, cfg.moe_intermediate_size // 2, dtype=torch.bfloat16)
    with pytest.raises(K3InputError, match="z"):
        launch_expert_gate_up(
            torch.zeros(S, L), ids, w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, act, geom, cfg
        )
    with pytest.raises(K3InputError, match="w2_scale"):
        launch_expert_down(act, ids, torch.zeros(S, K), w.w2_packed, w.w1_scale, torch.zeros(S, L), geom, cfg)
    with pytest.raises(K3InputError, match="route_ids"):
        launch_route(torch.zeros(S, cfg.num_experts), w.router_bias, ids.long(), torch.zeros(S, K), route_keys(cfg, geom),
                     geom, cfg)
    with pytest.raises(K3InputError, match="route_keys"):
        launch_route(torch.zeros(S, cfg.num_experts), w.router_bias, ids, torch.zeros(S, K),
                     route_keys(cfg, geom)[:, 1:], geom, cfg)


_SM90_BUILDS = textwrap.dedent(
    r"""
    from k3mono import offline
    from k3mono.config import MAX_TOKENS, preset
    from k3mono.mono import DEFAULT_CTAS_PER_SM, default_ctas_per_sm

    cfg = preset("kimi-k3")
    for name, compiled, values in offline.expert_builds(cfg, 8, 1):
        usage = offline.resource_usage(compiled)
        assert usage["stack"] == 0, (name, usage)
        loop = max(offline.sass_loops(compiled), key=len)
        ops = offline.opcode_counts(loop)
        # the IMAD placement holds: one IMAD a value places the nibble (not a shift pair)
        assert ops["IMAD"] >= values and ops["SHF"] < values / 2, (name, ops.most_common(8))
        print(name, round(len(loop) / values, 2))
    fma_loops = {name: len(max(offline.sass_loops(compiled), key=len)) for name, compiled, _ in
                 offline.expert_builds(cfg, 8, 1)}
    for name, compiled, values in offline.expert_builds(cfg, 8, 1, f16=True):
        usage = offline.resource_usage(compiled)
        loop = max(offline.sass_loops(compiled), key=len)
        ops = offline.opcode_counts(loop)
        # one HFMA2 takes two products; the f16 loop issues at most 85 % of the fp32 loop's instructions
        assert usage["stack"] == 0 and 2 * ops["HFMA2"] >= values and ops["FFMA"] < values / 8, (name, ops.most_common(8))
        assert len(loop) <= 0.85 * fma_loops[name], (name, len(loop), fma_loops[name])
        print(name, "in f16", round(len(loop) / values, 2))
    for name, compiled, values in offline.expert_builds(cfg, 8, 1, mma=True):
        usage = offline.resource_usage(compiled)
        loop = max(offline.sass_loops(compiled), key=len)
        ops = offline.opcode_counts(loop)
        # the bf16 weight tile goes from registers to the warpgroup MMA, not through shared memory (16 B a store)
        assert usage["stack"] == 0 and ops["HGMMA"] > 0 and 8 * ops["STS"] < values, (name, usage, ops.most_common(8))
        print(name, "on tensor cores", round(len(loop) / values, 2))
    BULK = "cp.async.bulk.prefetch.L2.global"
    for mla in ("", "m1c"):  # a plain layer; an MLA layer with M1c and M1b folded in
        compiled, _ = offline.mono_build(cfg, 8, 1, loopback=False, mla=mla)
        fits = offline.ctas_per_sm(offline.resource_usage(compiled), compiled.metadata.num_warps)
        assert fits >= DEFAULT_CTAS_PER_SM, f"mono {mla}: {fits} CTAs fit a SM, the grid is planned for {DEFAULT_CTAS_PER_SM}"
        if not mla:
            plain_prefetches = compiled.asm["ptx"].count(BULK)  # PREFETCH_FINAL tasks only (prefetch mode 0)
    compiled, _ = offline.mono_build(cfg, 8, MAX_TOKENS, loopback=True)  # planned 3 CTAs a SM: the cap reaches ptxas
    usage = offline.resource_usage(compiled)
    assert offline.ctas_per_sm(usage, compiled.metadata.num_warps) == default_ctas_per_sm(MAX_TOKENS) == 3, usage
    step_loops = sorted(offline.sass_loops(compiled), key=len)[:-1]  # the longest is the task loop, once a task
    assert not any(op.startswith(("LDL", "STL")) for loop in step_loops for op in loop), "a step loop spills"
    compiled, grid = offline.m1c_build("fp8", 1, 264, 2048)  # M1c alone, as bench_mla launches it
    usage = offline.resource_usage(compiled)
    assert grid == (1, 264, 1) and usage["stack"] == 0 and offline.ctas_per_sm(usage, 4) >= 2, (grid, usage)
    ops = offline.opcode_counts(max(offline.sass_loops(compiled), key=len))
    # the fp8 tile reaches the dots as 16-bit pairs (ldmatrix), not by byte loads from shared memory
    assert ops["LDS"] < ops["LDSM"] and "cvt.rn.f16x2.e4m3x2" in compiled.asm["ptx"], ops.most_common(8)
    compiled, _ = offline.mono_build(cfg, 8, 1, loopback=True, trace=True, poll_sleep_ns=200, prefetch=2)
    ptx = compiled.asm["ptx"]  # k3mono/trace.py's readings; the pause between polls; every kind's prefetch
    assert "%globaltimer" in ptx and "%smid" in ptx and "nanosleep.u32" in ptx
    assert ptx.count(BULK) > plain_prefetches > 0, (ptx.count(BULK), plain_prefetches)
    print("ok")
    """
)


def test_sm90_builds_place_nibbles_with_imad_and_mono_fits_its_planned_ctas(run_compiled):
    """Offline Hopper builds (k3mono/offline.py, no GPU): the expert kernels' hot
    loops place each nibble with one IMAD and do not spill, and the tensor-core
    ones feed the warpgroup MMA from registers without spilling; the mono kernel
    compiles, plain and with M1c and M1b folded in, and its registers leave room
    for the CTAs a SM its grid is planned for (at S = 16, 3 under a register cap,
    no step loop spilling); M1c alone fits two programs a SM
    without spilling, its fp8 tile converted from e4m3 pairs and read by ldmatrix
    rather than by byte loads; a trace build reads the global timer, waits can pause
    between polls, and the prefetch modes ask the copy engine for each kind's
    weights (ptxas takes the bulk prefetch). Runs in a child process: the
    interpreter, on in this one, cannot compile."""
    run_compiled(_SM90_BUILDS)
