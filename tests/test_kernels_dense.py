"""Each dense stage kernel against its reference stage function (bf16 mode).

Every output buffer starts poisoned with NaN, and sits inside a larger NaN
buffer where the stage writes only a slot or a column slice: a kernel that
skips an element leaves a NaN, one that writes past its region spoils a NaN
that must survive.

Tolerances, and why they still catch real bugs:

* The reduces (AR1 + prefix, AR3, AR2 into the weighted latent, whose bf16
  product is exact in fp32) do the reference's fp32 additions in the
  reference's order with one rounding each: bit-exact.
* fp32 partials (o_proj, router logits, the AR3 operand) sum the same products
  in another order. Each element may differ by 1e-5 of sum_k |x_k w_k| (the
  size of the terms, not of the possibly cancelled result): fp32 reordering
  stays orders of magnitude below that at these K, while one wrong or missing
  term (a bad mask, a wrong row or column) is about 1/K of it, above 1e-5.
* Rounded outputs (x, z, shared_act) come from fp32 values that
  differ from the reference's in the last fp32 bits, so a value next to a bf16
  rounding boundary may round the other way: at most 1 % of the elements (plus
  one, for tiny outputs) may differ, each by 1 bf16 ulp (2 where a second
  rounding follows the first: situ of the rounded gate/up, the seam norm's
  bf16(w * bf16(.))), or by less than 1e-5 of the row's RMS (a value that
  cancelled to near zero, whose ulp is far below the fp32 error of its
  terms). The observed rate is about 0.1 %. A wrong element is many ulps and
  far more than 1e-5 of the RMS off; a missing or wrong-mode rounding (e.g.
  the interpreter's truncating cast) moves a third to a half of the elements.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import textwrap

import pytest
import torch

from k3mono.config import preset
from k3mono.planner import X_GROUP_TOKENS, TileChoice, seam_candidates_max, stage_geometry
from k3mono.reference import BF16
from k3mono.reference import stages as st
from k3mono.reference.tp import combine, core_slice, latent_slice
from k3mono.synthetic import random_inputs, random_layer
from k3mono.weights import shard

import triton
import triton.language as tl

from k3mono.kernels.attnres import launch_attnres, seam_scale
from k3mono.kernels.common import as_f32, to_bf16
from k3mono.kernels.final import launch_final_partial
from k3mono.kernels.latent_down import launch_latent_down
from k3mono.kernels.latent_norm import launch_latent_parts
from k3mono.kernels.oproj import launch_oproj
from k3mono.kernels.reduce import launch_final_reduce, launch_reduce_prefix
from k3mono.kernels.gemv import even_k, store_rows
from k3mono.kernels.router import launch_router, router_task
from k3mono.kernels.shared import launch_shared_gate_up

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TPS = (1, 2, 4)
TOKENS = (1, 3, 16)
GEMV_TOKENS = (1, 3, 5, 16)  # 5: the tl.dot path with padded tokens
NAN = float("nan")

ROUNDED_FRACTION = 0.01
CANCEL_REL = 1e-5
PARTIAL_REL = 1e-5
CHAINED_ULPS = 2  # two roundings in a row (situ of rounded gate/up; the norms' two roundings)


# -- comparison helpers ----------------------------------------------------------------


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between two bf16 tensors (sign-magnitude bits made monotone)."""

    def key(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        mag = bits & 0x7FFF
        return torch.where(bits < 0, -mag, mag)

    return (key(a) - key(b)).abs()


def assert_rounded(got: torch.Tensor, want: torch.Tensor, name: str, max_ulps: int = 1) -> None:
    """At most 1 % (+1) of the elements off the bf16 reference, each by at most
    ``max_ulps`` bf16 steps, or by less than CANCEL_REL of its row's RMS (a
    result that cancelled to near zero has tiny ulps, but fp32 reordering
    errors the size of its terms)."""
    got, want = got.cpu(), want.cpu().to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape, name
    assert torch.isfinite(got).all(), f"{name}: non-finite (unwritten) elements"
    ulps = bf16_ulps(got, want)
    off = int((ulps > 0).sum())
    assert off <= 1 + ROUNDED_FRACTION * got.numel(), f"{name}: {off} of {got.numel()} elements off"
    rms = want.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    far = (got.float() - want.float()).abs() > CANCEL_REL * rms
    worst = int(ulps[far].max()) if far.any() else 0
    assert worst <= max_ulps, f"{name}: an element {worst} bf16 ulps off"


def assert_exact(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    got, want = got.cpu(), want.cpu().to(got.dtype)
    assert torch.isfinite(got).all(), f"{name}: non-finite (unwritten) elements"
    assert torch.equal(got, want), f"{name}: {int((got != want).sum())} of {got.numel()} elements differ"


def assert_partial(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """|got - want| <= PARTIAL_REL * scale elementwise, scale = sum_k |x_k w_k|."""
    got = got.cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape, name
    assert torch.isfinite(got).all(), f"{name}: non-finite (unwritten) elements"
    err = (got.double() - want.double()).abs()
    bound = PARTIAL_REL * scale.double() + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{name}: error {worst:.3g} x the bound"


def abs_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float().abs() @ w.float().abs().T


def assert_nan(t: torch.Tensor, name: str) -> None:
    assert torch.isnan(t.float()).all(), f"{name}: written outside the stage's region"


# -- inputs --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def layer_weights(preset_name: str, seed: int = 0):
    return random_layer(preset(preset_name), seed)


def rank_shard(preset_name: str, tp: int, rank: int):
    cfg = preset(preset_name)
    return cfg, shard(layer_weights(preset_name), cfg, tp, rank)


def activations(shape, seed: int) -> torch.Tensor:
    """Unit-scale bf16 activations."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def partials(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, NAN, dtype=dtype, device=DEVICE)


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def narrow(geom):
    """The same geometry with short K steps and vector chunks, so the tiny preset
    runs the K loops over several steps with and without a K tail, and the vector
    stages over several chunks with a ragged last one."""
    def small(tile):
        return dataclasses.replace(tile, block_k=32 if geom.use_dot else 16)

    return dataclasses.replace(
        geom,
        oproj=small(geom.oproj),
        router=small(geom.router),
        latent_down=small(geom.latent_down),
        shared_gate_up=small(geom.shared_gate_up),
        final=small(geom.final),
        vector_block=64,
        seam_cols=128,
        score_cols=64,
        latent_part=32,
    )


def seam_scratch(cfg, S, geom) -> dict:
    """The seam steps' partials (layout.scratch_layout's regions), poisoned."""
    chunks = -(-cfg.hidden_size // geom.seam_cols)
    return {
        "seam_part": poisoned((S, -(-cfg.hidden_size // geom.score_cols), 2, seam_candidates_max(cfg)), torch.float32),
        "seam_h": poisoned((S, cfg.hidden_size), torch.bfloat16),
        "seam_hsq": poisoned((S, chunks), torch.float32),
    }


GEOMETRIES = {"planned": lambda g: g, "narrow": narrow}

X_GROUP_CASES = [("tiny", 2, 6, "grouped"), ("tiny", 4, 16, "grouped"), ("small", 8, 9, "grouped"),
                 ("tiny", 2, 8, "grouped8"), ("tiny", 4, 7, "grouped8"), ("small", 8, 13, "grouped8")]
"""Token counts past FMA_MAX_TOKENS with the router and latent down by groups of
4 or 8 tokens (TileChoice.x_token_groups, x_group_tokens); 6, 9 and 13 end in a
group whose window shifts back; 7 and 8 are one group of 8 (every FMA
accumulator of the tile, 7 with a padding token)."""


X_PARTS_CASES = [("tiny", 2, 8, "parts7"), ("small", 8, 16, "parts4"), ("tiny", 1, 5, "parts14")]
"""Token counts past FMA_MAX_TOKENS (tl.dot) with each router and latent down tile
summed over parts of K (TileChoice.x_k_parts): 224 / 14 = 16 columns a part, and
448 / 4 = 112, not a power of two (the part's tail masked)."""


def x_geometry(cfg, tp: int, S: int, geo: str):
    """The geometry of the router and latent down cases: GEOMETRIES', by token groups, or by parts of K."""
    if geo.startswith("parts"):
        parts = int(geo.removeprefix("parts"))
        geom = stage_geometry(cfg, tp, S, tiles=TileChoice(x_k_parts=parts))
        assert geom.x_parts == parts and geom.x_group_dot
        return geom
    if not geo.startswith("grouped"):
        return GEOMETRIES[geo](stage_geometry(cfg, tp, S))
    group = int(geo.removeprefix("grouped") or X_GROUP_TOKENS)
    geom = stage_geometry(cfg, tp, S, tiles=TileChoice(x_token_groups=True, x_group_tokens=group))
    assert geom.x_group == min(S, group) and geom.x_groups == -(-S // group) and not geom.x_group_dot
    return geom


def cases(tokens=TOKENS):
    out = [("tiny", tp, s, "planned") for tp in TPS for s in tokens]
    out += [("tiny", 2, s, "narrow") for s in (3, 16)]
    return out


def case_id(case):
    return "-".join(str(p) for p in case)


# -- o_proj and the reduces ------------------------------------------------------------


@pytest.mark.parametrize("case", cases(GEMV_TOKENS) + [("small", 16, 3, "planned"), ("small", 8, 16, "planned")], ids=case_id)
def test_oproj(case):
    name, tp, S, geo = case
    rank = tp - 1
    cfg, w = rank_shard(name, tp, rank)
    geom = GEOMETRIES[geo](stage_geometry(cfg, tp, S))
    core = activations((S, cfg.core_width), seed=S)
    ar1 = poisoned((tp, S, cfg.hidden_size), torch.float32)
    launch_oproj(dev(core_slice(core, tp, rank)), dev(w.o_proj), ar1[rank], geom)
    x = core_slice(core, tp, rank)
    assert_partial(ar1[rank], st.linear(BF16, x, w.o_proj), abs_scale(x, w.o_proj), "o_proj partial")
    for t in range(tp):
        if t != rank:
            assert_nan(ar1[t], f"ar1[{t}]")


@pytest.mark.parametrize("case", cases() + [("small", 16, 16, "planned")], ids=case_id)
def test_reduce_prefix(case):
    name, tp, S, geo = case
    cfg = preset(name)
    geom = GEOMETRIES[geo](stage_geometry(cfg, tp, S))
    parts = partials((tp, S, cfg.hidden_size), seed=10 + S)
    prefix_in = activations((S, cfg.hidden_size), seed=11 + S)
    prefix = dev(prefix_in.clone())
    launch_reduce_prefix(dev(parts), prefix, geom)
    o = BF16.round(combine("sum", list(parts)))
    assert_exact(prefix, st.prefix_add(BF16, prefix_in, o), "prefix")


@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_final_reduce(case):
    name, tp, S, geo = case
    cfg = preset(name)
    geom = GEOMETRIES[geo](stage_geometry(cfg, tp, S))
    parts = partials((tp, S, cfg.hidden_size), seed=20 + S)
    out = poisoned((S, cfg.hidden_size), torch.bfloat16)
    launch_final_reduce(dev(parts), out, geom)
    assert_exact(out, BF16.round(combine("sum", list(parts))), "moe_out")


def order_sensitive_partials(tp: int, shape, seed: int) -> torch.Tensor:
    """Rank 0 and 1 cancel exactly (+-2^20 scale), the others are O(1): summed in
    rank order the small ones survive whole; in any other order they are added
    to 2^20 first and lose their low bits (an fp32 ulp there is 1/8)."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(shape, generator=g) * 2.0**20
    small = torch.randn((tp - 2, *shape), generator=g)
    return torch.cat([big[None], -big[None], small])


def test_reduces_add_in_rank_order():
    cfg, tp, S = preset("tiny"), 4, 3
    geom = stage_geometry(cfg, tp, S)
    H, L = cfg.hidden_size, cfg.routed_expert_hidden_size

    parts = order_sensitive_partials(tp, (S, H), seed=1)
    out = poisoned((S, H), torch.bfloat16)
    launch_final_reduce(dev(parts), out, geom)
    assert_exact(out, BF16.round(combine("sum", list(parts))), "moe_out")

    prefix_in = activations((S, H), seed=2)
    prefix = dev(prefix_in.clone())
    launch_reduce_prefix(dev(parts), prefix, geom)
    assert_exact(prefix, st.prefix_add(BF16, prefix_in, BF16.round(combine("sum", list(parts)))), "prefix")

    parts = order_sensitive_partials(tp, (S, L), seed=3)
    norm = layer_weights("tiny").latent_norm
    latent, _ = every_rank_latent(parts, norm, geom)
    assert_exact(latent, BF16.round(BF16.cast(norm) * BF16.round(combine("sum", list(parts)))), "latent")
    # the order matters at all for these inputs:
    reversed_sum = combine("sum", list(parts.flip(0)))
    assert not torch.equal(reversed_sum, combine("sum", list(parts)))


# -- the AttnRes seam ------------------------------------------------------------------


ATTNRES_CASES = [
    ("tiny", 1, S, "planned", layer) for S in TOKENS for layer in (1, 13, 92)
] + [("tiny", 1, 3, "narrow", 40), ("small", 1, 16, "planned", 60)]


@pytest.mark.parametrize("case", ATTNRES_CASES, ids=case_id)
def test_attnres(case):
    name, tp, S, geo, layer = case
    cfg = preset(name)
    w = layer_weights(name)
    geom = GEOMETRIES[geo](stage_geometry(cfg, tp, S))
    nb = cfg.num_blocks(layer)
    inputs = random_inputs(cfg, S, layer, seed=30 + S, nb_max=nb + 1)  # a padding block that must be ignored
    prefix, blocks = inputs["prefix"], inputs["blocks"]
    x = poisoned((S, cfg.hidden_size), torch.bfloat16)
    launch_attnres(dev(prefix), dev(blocks), nb, dev(w.ares_norm), dev(w.ares_proj), dev(w.post_norm), cfg.rms_norm_eps, x,
                   seam_scratch(cfg, S, geom), geom)

    cands = st.attnres_candidates(BF16, blocks, nb, prefix)
    scores = st.attnres_scores(BF16, cands, w.ares_norm, w.ares_proj, cfg.rms_norm_eps)
    h = st.attnres_mix(BF16, cands, scores)
    assert_rounded(x, st.rms(BF16, h, w.post_norm, cfg.rms_norm_eps), "x", CHAINED_ULPS)


def test_attnres_reads_blocks_through_strides():
    """blocks as a strided view (a bigger buffer's slice) give the same x."""
    cfg, layer, S = preset("tiny"), 25, 3
    w = layer_weights("tiny")
    geom = stage_geometry(cfg, 1, S)
    nb = cfg.num_blocks(layer)
    inputs = random_inputs(cfg, S, layer, seed=7, nb_max=nb)
    big = torch.full((S, 2 * nb + 1, cfg.hidden_size + 32), NAN, dtype=torch.bfloat16)
    big[:, 1 : 2 * nb + 1 : 2, 16 : 16 + cfg.hidden_size] = inputs["blocks"]
    view = big[:, 1 : 2 * nb + 1 : 2, 16 : 16 + cfg.hidden_size]
    outs = []
    for blocks in (inputs["blocks"], view):
        x = poisoned((S, cfg.hidden_size), torch.bfloat16)
        launch_attnres(dev(inputs["prefix"]), dev(blocks), nb, dev(w.ares_norm), dev(w.ares_proj), dev(w.post_norm),
                       cfg.rms_norm_eps, x, seam_scratch(cfg, S, geom), geom)
        outs.append(x.cpu())
    assert torch.isfinite(outs[0].float()).all() and torch.equal(outs[0], outs[1])


# -- the GEMV stages on x ------------------------------------------------------------------


@pytest.mark.parametrize("case", cases(GEMV_TOKENS) + [("small", 16, 16, "planned")] + X_GROUP_CASES + X_PARTS_CASES,
                         ids=case_id)
def test_router(case):
    name, tp, S, geo = case
    rank = tp - 1
    cfg, w = rank_shard(name, tp, rank)
    geom = x_geometry(cfg, tp, S, geo)
    E, n = cfg.num_experts, cfg.num_experts // tp
    x = activations((S, cfg.hidden_size), seed=40 + S)
    logits = poisoned((S, E), torch.float32)
    launch_router(dev(x), dev(w.router), logits[:, rank * n : (rank + 1) * n], geom)
    got = logits[:, rank * n : (rank + 1) * n]
    assert_partial(got, st.router_logits(BF16, x, w.router), abs_scale(x, w.router), "logits")
    assert_nan(logits[:, : rank * n], "logits left of the slice")
    assert_nan(logits[:, (rank + 1) * n :], "logits right of the slice")


@triton.jit
def _router_rms_kernel(
    h_ptr,  # [1, H] bf16: the seam's h
    hsq_ptr,  # [1, CH] fp32: its chunks' sums of squares
    norm_ptr,  # [H] bf16
    eps,
    w_ptr,  # [E/T, H] bf16
    out_ptr,  # [1, E/T] fp32 out
    H: tl.constexpr,
    SC: tl.constexpr,
    N: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The mono launch's single-token router task (kernels/mono.py router_push_task, ROUTER_RMS) as a grid."""
    task = tl.program_id(0)
    tile = router_task(task, 0, h_ptr, H, w_ptr, H, 1, N, H, 1, ROWS, BLOCK_K, False, EVEN_K, False, norm_ptr,
                       seam_scale(0, hsq_ptr, eps, H, SC), True)
    store_rows(out_ptr, N, tile, task * ROWS, 0, 1, N, 1, ROWS)


@pytest.mark.parametrize("name,tp,layer", [("tiny", 2, 13), ("small", 4, 60)])
def test_single_token_router_forms_the_norms_x(name, tp, layer):
    """S = 1: router tasks that form x from the seam's h (gemv X_RMS) give the
    logits of the router over the norm step's x, bit for bit."""
    rank = tp - 1
    cfg, w = rank_shard(name, tp, rank)
    geom = stage_geometry(cfg, tp, 1)
    assert geom.router_rms
    inputs = random_inputs(cfg, 1, layer, seed=45)
    nb, seam = cfg.num_blocks(layer), seam_scratch(cfg, 1, geom)
    x = poisoned((1, cfg.hidden_size), torch.bfloat16)
    launch_attnres(dev(inputs["prefix"]), dev(inputs["blocks"]), nb, dev(w.ares_norm), dev(w.ares_proj),
                   dev(w.post_norm), cfg.rms_norm_eps, x, seam, geom)
    n, tile = cfg.num_experts // tp, geom.router
    want = poisoned((1, n), torch.float32)
    launch_router(x, dev(w.router), want, geom)
    got = poisoned((1, n), torch.float32)
    _router_rms_kernel[(-(-n // tile.rows),)](
        seam["seam_h"], seam["seam_hsq"], dev(w.post_norm), cfg.rms_norm_eps, dev(w.router), got,
        H=cfg.hidden_size, SC=geom.seam_cols, N=n, ROWS=tile.rows, BLOCK_K=tile.block_k,
        EVEN_K=even_k(cfg.hidden_size, tile.block_k), num_warps=tile.warps)
    assert torch.isfinite(got).all() and torch.equal(got.cpu(), want.cpu()), "logits differ from the norm's x"


@pytest.mark.parametrize("case", cases(GEMV_TOKENS) + [("small", 16, 5, "planned")] + X_GROUP_CASES + X_PARTS_CASES,
                         ids=case_id)
def test_latent_down(case):
    name, tp, S, geo = case
    rank = tp - 1
    cfg, w = rank_shard(name, tp, rank)
    geom = x_geometry(cfg, tp, S, geo)
    L, n = cfg.routed_expert_hidden_size, cfg.routed_expert_hidden_size // tp
    x = activations((S, cfg.hidden_size), seed=50 + S)
    z = poisoned((S, L), torch.bfloat16)
    launch_latent_down(dev(x), dev(w.latent_down), z[:, rank * n : (rank + 1) * n], geom)
    assert_rounded(z[:, rank * n : (rank + 1) * n], st.latent_down(BF16, x, w.latent_down), "z")
    assert_nan(z[:, : rank * n], "z left of the slice")
    assert_nan(z[:, (rank + 1) * n :], "z right of the slice")


@pytest.mark.parametrize("case", cases(GEMV_TOKENS) + [("small", 4, 16, "planned")], ids=case_id)
def test_shared_gate_up(case):
    name, tp, S, geo = case
    rank = tp - 1
    cfg, w = rank_shard(name, tp, rank)
    geom = GEOMETRIES[geo](stage_geometry(cfg, tp, S))
    x = activations((S, cfg.hidden_size), seed=60 + S)
    act = poisoned((S, cfg.shared_intermediate // tp), torch.bfloat16)
    launch_shared_gate_up(dev(x), dev(w.shared_gate), dev(w.shared_up), act, geom, cfg)
    assert_rounded(act, st.shared_hidden(BF16, x, w.shared_gate, w.shared_up, cfg), "shared_act", CHAINED_ULPS)


# -- AR2 + latent norm, and the AR3 operand ------------------------------------------------


def every_rank_latent(parts, norm, geom):
    """([S, L], [S, PL]): each rank's latent parts launch (its L/T columns, into
    poisoned outputs) side by side: every column written once, by its rank; and
    the parts' sums of squares, which every rank computes alike (checked)."""
    tp, S, L = parts.shape
    slices, squares = [], []
    for rank in range(tp):
        latent_r = poisoned((S, L // tp), torch.bfloat16)
        squares.append(poisoned((S, -(-L // geom.latent_part)), torch.float32))
        launch_latent_parts(dev(parts), dev(norm), squares[-1], latent_r, rank, geom)
        slices.append(latent_r)
    for rank, sq in enumerate(squares[1:], start=1):
        assert torch.equal(sq.cpu(), squares[0].cpu()), f"rank {rank}'s latent_sq differs from rank 0's"
    return torch.cat(slices, dim=1), squares[0].cpu()


@pytest.mark.parametrize("case", cases() + [("small", 16, 3, "planned")], ids=case_id)
def test_latent_parts(case):
    """The weighted latent bf16(w * bf16(sum)) exactly (the ranks added in rank
    order, a bf16 product exact in fp32, one rounding), and the norm's scale FINAL
    takes from the parts' sums of squares: rsqrt(mean(bf16(sum)^2) + eps) to fp32
    reordering."""
    name, tp, S, geo = case
    cfg = preset(name)
    w = layer_weights(name)
    geom = GEOMETRIES[geo](stage_geometry(cfg, tp, S))
    L = cfg.routed_expert_hidden_size
    parts = partials((tp, S, L), seed=70 + S)
    latent, squares = every_rank_latent(parts, w.latent_norm, geom)
    rounded = BF16.round(combine("sum", list(parts)))
    assert_exact(latent, BF16.round(BF16.cast(w.latent_norm) * rounded), "latent")
    assert torch.isfinite(squares).all(), "latent_sq: unwritten parts"
    scale = torch.rsqrt(squares.double().sum(dim=1) / L + cfg.rms_norm_eps)
    want = torch.rsqrt(rounded.double().pow(2).mean(dim=1) + cfg.rms_norm_eps)
    assert torch.allclose(scale, want, rtol=PARTIAL_REL, atol=0), f"latent scale {scale} against {want}"


@pytest.mark.parametrize("case", cases(GEMV_TOKENS) + [("small", 16, 16, "planned")], ids=case_id)
def test_final_partial(case):
    name, tp, S, geo = case
    rank = tp - 1
    cfg, w = rank_shard(name, tp, rank)
    geom = GEOMETRIES[geo](stage_geometry(cfg, tp, S))
    L = cfg.routed_expert_hidden_size
    latent = activations((S, L), seed=80 + S)
    act = activations((S, cfg.shared_intermediate // tp), seed=81 + S)
    # the parts' sums of squares of an O(1) latent: a scale per token near 1, not 1
    squares = partials((S, -(-L // geom.latent_part)), seed=82 + S).abs() * (L / geom.latent_part)
    ar3 = poisoned((tp, S, cfg.hidden_size), torch.float32)
    lat = latent_slice(latent, tp, rank)
    launch_final_partial(dev(lat), dev(squares), cfg.rms_norm_eps, dev(w.latent_up), dev(act), dev(w.shared_down),
                         ar3[rank], geom, L)
    norm_scale = torch.rsqrt(squares.sum(dim=1, keepdim=True) / L + cfg.rms_norm_eps)
    want = norm_scale * st.linear(BF16, lat, w.latent_up) + st.linear(BF16, act, w.shared_down)
    scale = norm_scale * abs_scale(lat, w.latent_up) + abs_scale(act, w.shared_down)
    assert_partial(ar3[rank], want, scale, "AR3 partial")
    for t in range(tp):
        if t != rank:
            assert_nan(ar3[t], f"ar3[{t}]")


# -- the bf16 conversions every rounding goes through ----------------------------------------


@triton.jit
def _convert_kernel(
    x_ptr,  # [N] fp32
    y_ptr,  # [N] bf16 out: to_bf16(x)
    z_ptr,  # [N] fp32 out: as_f32(y)
    N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    y = to_bf16(tl.load(x_ptr + offs, mask=m))
    tl.store(y_ptr + offs, y, mask=m)
    tl.store(z_ptr + offs, as_f32(y), mask=m)


def test_bf16_conversions_match_torch():
    """Round to nearest even (ties, carries into the exponent, overflow to inf,
    subnormals, NaN) and the exact upcast, bit for bit against torch."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=g, dtype=torch.int32)
    ties = (torch.randint(0, 2**15, (2000,), generator=g, dtype=torch.int32) << 16) | 0x8000  # exactly half an ulp
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-40, -1e-45,
                             1.0 + 2**-8, 1.0 + 3 * 2**-8, 2.0 - 2**-9, 1.17e-38])
    x = torch.cat([bits.view(torch.float32), ties.view(torch.float32), torch.randn(5000, generator=g), specials])
    y = torch.empty(x.numel(), dtype=torch.bfloat16, device=DEVICE)
    z = torch.empty(x.numel(), dtype=torch.float32, device=DEVICE)
    block = 1024
    _convert_kernel[(triton.cdiv(x.numel(), block),)](dev(x), y, z, N=x.numel(), BLOCK=block)
    want = x.to(torch.bfloat16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y.cpu()), nan)
    assert torch.equal(y.cpu()[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(z.cpu()[~nan].view(torch.int32), want[~nan].float().view(torch.int32))


# -- the compiled (sm_90) form: compiles, and the hot loop streams 16-byte vectors -----------

_SM90_CHECK = textwrap.dedent(
    r"""
    import re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from k3mono.kernels import attnres, latent_norm, oproj, reduce, route

    def compile_sm90(fn, sig, consts):
        # pointers and strides divisible by 16, as a launch with aligned tensors specialises them
        full, attrs = {}, {}
        for i, a in enumerate(fn.arg_names):
            full[a] = "constexpr" if a in consts else sig[a]
            if a not in consts and (sig[a].startswith("*") or a.startswith("stride")):
                attrs[(i,)] = [["tt.divisibility", 16]]
        k = triton.compile(ASTSource(fn, full, consts, attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        return k.asm["ttgir"], k.asm["ptx"]

    gemv_sig = {"core_ptr": "*bf16", "stride_cs": "i32", "w_ptr": "*bf16", "stride_wn": "i32",
                "out_ptr": "*fp32", "stride_os": "i32"}
    for S, SP, dot, rows, bk in ((1, 1, False, 8, 512), (4, 4, False, 8, 512), (16, 16, True, 16, 256)):
        consts = dict(S=S, H=7168, K=1536, SP=SP, ROWS=rows, BLOCK_K=bk, USE_DOT=dot, EVEN_K=True, UPCAST=False)
        ttgir, ptx = compile_sm90(oproj._oproj_kernel, gemv_sig, consts)
        loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
        assert "convert_layout" not in loop, f"S={S}: a layout conversion inside the K loop"
        if dot:
            assert "async_copy_global_to_local" in loop and "mma" in ptx, "S=16: tl.dot not pipelined on the tensor cores"
        else:
            loads = re.findall(r"ld\.global\S*", ptx)
            assert loads and all(".v4." in l for l in loads), f"S={S}: loads not 16-byte vectors: {set(loads)}"
    candidates = {"prefix_ptr": "*bf16", "stride_ps": "i32", "blocks_ptr": "*bf16", "stride_bs": "i32",
                  "stride_bn": "i32", "nb": "i32"}
    compile_sm90(attnres._seam_score_kernel,
                 {**candidates, "ares_norm_ptr": "*bf16", "ares_proj_ptr": "*bf16", "part_ptr": "*fp32"},
                 dict(H=7168, CANDS=16, CP=16, SCORE_COLS=128))
    compile_sm90(attnres._seam_mix_kernel,
                 {**candidates, "part_ptr": "*fp32", "eps": "fp32", "h_ptr": "*bf16", "hsq_ptr": "*fp32"},
                 dict(H=7168, CANDS=16, CP=16, SC=512, SCORE_COLS=128))
    compile_sm90(attnres._seam_norm_kernel,
                 {"h_ptr": "*bf16", "hsq_ptr": "*fp32", "post_norm_ptr": "*bf16", "eps": "fp32", "x_ptr": "*bf16",
                  "stride_xs": "i32"},
                 dict(H=7168, SC=512))
    compile_sm90(latent_norm._latent_part_kernel,
                 {"ar2_ptr": "*fp32", "stride_at": "i32", "stride_as": "i32", "norm_ptr": "*bf16", "sq_ptr": "*fp32",
                  "out_ptr": "*bf16", "stride_os": "i32", "rank": "i32"},
                 dict(T=8, L=3584, L_R=448, PC=512, PL=7))
    compile_sm90(route._route_part_kernel, {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "keys_ptr": "*i64"},
                 dict(E=896, K=16, E_PAD=1024, RC=128))
    compile_sm90(route._route_merge_kernel,
                 {"logits_ptr": "*fp32", "keys_ptr": "*i64", "ids_ptr": "*i32", "weights_ptr": "*fp32", "scaling": "fp32"},
                 dict(E=896, K=16, E_PAD=1024, RC=128))
    compile_sm90(reduce._reduce_prefix_kernel,
                 {"ar1_ptr": "*fp32", "stride_at": "i32", "stride_as": "i32", "prefix_ptr": "*bf16", "stride_ps": "i32"},
                 dict(T=8, H=7168, VB=1024))
    print("ok")
    """
)


def test_kernels_compile_for_sm90(run_compiled):
    """The released shapes compile for Hopper (no GPU needed: PTX only), the FMA
    path's loads are 16-byte vectors with no layout conversion in the K loop,
    and the tl.dot path is pipelined onto the tensor cores. Runs in a child
    process: the interpreter, on in this one, cannot compile."""
    run_compiled(_SM90_CHECK)


# -- the tolerances themselves catch what they must ------------------------------------------


def test_rounded_tolerance_rejects_truncation():
    """A truncating bf16 cast (the interpreter's own .to(bf16)) fails assert_rounded."""
    v = partials((4096,), seed=3)
    truncated = (v.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        assert_rounded(truncated, v.to(torch.bfloat16), "truncated")


def test_partial_tolerance_rejects_a_missing_term():
    cfg, w = rank_shard("tiny", 1, 0)
    x = activations((3, cfg.hidden_size), seed=5)
    want = st.linear(BF16, x, w.router)
    dropped = st.linear(BF16, x[:, :-1], w.router[:, :-1])  # the last column lost, as a K-tail mask bug would
    with pytest.raises(AssertionError):
        assert_partial(dropped, want, abs_scale(x, w.router), "dropped")
