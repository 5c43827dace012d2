"""The AttnRes seam: score the candidates, mix them, and the pre-MLP RMSNorm.

Shapes: S tokens, H hidden, nb AttnRes blocks (nb + 1 <= CANDS candidates),
SC = geom.seam_cols columns a chunk, CH = ceil(H / SC) chunks, SCORE_COLS =
geom.score_cols columns a score chunk, PCH = ceil(H / SCORE_COLS) score chunks,
CP >= CANDS the partials' candidate extent (layout.scratch_layout: the model's
widest seam).

    V      = [blocks[s, 0], .., blocks[s, nb-1], P[s]]     (fp32 of bf16)
    r_i    = rsqrt(mean(V_i^2) + eps)
    score_i = sum_d V_i[d] * r_i * q[d],   q = ares_norm * ares_proj   (fp32)
    a      = softmax(score)
    h      = bf16(sum_i a_i * V_i)                         (candidates added in order)
    x      = bf16(post_norm * bf16(h * rsqrt(mean(h^2) + eps)))

The scores need all of H before any mixing, and the norm all of h: one token
is three steps, each a task per chunk of columns, so the seam spreads over
CTAs instead of one (the mono launch's trace had it at 14 us on one CTA):

    score (s, c): per candidate, the score chunk's sum of V^2 and V . q  -> part[s, c]
    mix   (s, c): every score chunk's partials, summed in one fixed order, give
                  the scores (score_i = r_i * (V_i . q): the reference scales
                  before the dot, the two differ by fp32 rounding only); h of
                  the chunk, rounded               -> h[s, chunk], hsq[s, c]
    norm  (s, c): the chunks' h^2 sums give the norm  -> x[s, chunk]

A score chunk is a reduce tile of AR1 (planner.REDUCE_TILE_COLS): the mono
launch scores a tile in the REDUCE1 task that has just summed P there
(``score_partials`` on P in registers, its block rows loaded with the AR1
partials, before the prefix store they could alias), one dependent step less
on its critical path; the staged path runs the same functions on P read back.
Every task of a step computes its token's sums from the same partials in the
same order, so all chunks agree bit for bit, and the staged launches (a kernel
per step) and the mono launch's tasks (the same functions) give the same bits.
x, h and the partials are rank-local, so the tasks store them directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import expect_tensor
from ..planner import next_pow2
from .common import as_f32, rms_value, rsqrt_rn, to_bf16

PARTS = tl.constexpr(2)  # a chunk's partials per candidate: sum of V^2, V . q


@triton.jit
def _candidate_row(
    i,
    s,
    nb,
    blocks_ptr,  # bf16 [S, nb_max, H]
    stride_bs,
    stride_bn,
    prefix_ptr,  # bf16 [S, H]
    stride_ps,
):
    """Pointer to candidate i of token s: the blocks first, P last."""
    if i < nb:
        row = blocks_ptr + s * stride_bs + i * stride_bn
    else:
        row = prefix_ptr + s * stride_ps
    return row


@triton.jit
def _chunk_cols(chunk, H: tl.constexpr, SC: tl.constexpr):
    cols = chunk * SC + tl.arange(0, SC)
    return cols, cols < H


@triton.jit
def seam_query(
    ares_norm_ptr,  # bf16 [H]
    ares_proj_ptr,  # bf16 [H]
    cols,  # [n] int32 columns
    m,  # [n] bool: cols < H
):
    """q = ares_norm * ares_proj at cols, [n] fp32."""
    return as_f32(tl.load(ares_norm_ptr + cols, mask=m, other=0.0)) * as_f32(tl.load(ares_proj_ptr + cols, mask=m,
                                                                                      other=0.0))


@triton.jit
def block_rows(
    s,  # token
    cols,  # [n] int32 columns
    m,  # [n] bool: cols < H
    blocks_ptr,  # bf16 [S, nb_max, H]
    stride_bs,
    stride_bn,
    nb,
    CANDS: tl.constexpr,
):
    """[CANDS, n] fp32: the candidates' block rows at cols (0 from row nb on)."""
    cand = tl.arange(0, CANDS)
    ptrs = blocks_ptr + s * stride_bs + cand[:, None] * stride_bn + cols[None, :]
    return as_f32(tl.load(ptrs, mask=(cand < nb)[:, None] & m[None, :], other=0.0))


@triton.jit
def score_partials(
    s,  # token
    chunk,  # score chunk: columns chunk * SCORE_COLS ..
    p,  # [n] fp32: P[s, cols] (candidate nb)
    rows,  # [CANDS, n] fp32: block_rows at the same cols
    q,  # [n] fp32: seam_query at the same cols
    nb,
    part_ptr,  # fp32 [S, PCH, PARTS, CP] out
    H: tl.constexpr,
    CANDS: tl.constexpr,
    CP: tl.constexpr,
    SCORE_COLS: tl.constexpr,
):
    """part[s, chunk]: per candidate, the sums over the columns of V^2 and V . q."""
    PCH: tl.constexpr = triton.cdiv(H, SCORE_COLS)
    cand = tl.arange(0, CANDS)
    v = tl.where((cand == nb)[:, None], p[None, :], rows)
    part = part_ptr + (s * PCH + chunk) * (PARTS * CP)
    tl.store(part + cand, tl.sum(v * v, axis=1))
    tl.store(part + CP + cand, tl.sum(v * q[None, :], axis=1))


@triton.jit
def seam_score_task(
    s,  # token
    chunk,  # score chunk
    prefix_ptr,  # bf16 [S, H]: P, already updated by AR1
    stride_ps,
    blocks_ptr,  # bf16 [S, nb_max, H]
    stride_bs,
    stride_bn,
    nb,
    ares_norm_ptr,  # bf16 [H]
    ares_proj_ptr,  # bf16 [H]
    part_ptr,  # fp32 [S, PCH, PARTS, CP] out
    H: tl.constexpr,
    CANDS: tl.constexpr,
    CP: tl.constexpr,
    SCORE_COLS: tl.constexpr,
):
    """score_partials of P read back from prefix (the staged path's score step)."""
    cols, m = _chunk_cols(chunk, H, SCORE_COLS)
    q = seam_query(ares_norm_ptr, ares_proj_ptr, cols, m)
    rows = block_rows(s, cols, m, blocks_ptr, stride_bs, stride_bn, nb, CANDS)
    p = as_f32(tl.load(prefix_ptr + s * stride_ps + cols, mask=m, other=0.0))
    score_partials(s, chunk, p, rows, q, nb, part_ptr, H, CANDS, CP, SCORE_COLS)


@triton.jit
def _mix_weights(
    s,
    nb,
    part_ptr,  # fp32 [S, PCH, PARTS, CP]
    eps,
    H: tl.constexpr,
    CANDS: tl.constexpr,
    CP: tl.constexpr,
    SCORE_COLS: tl.constexpr,
):
    """softmax of the scores, [CANDS] (0 past the nb + 1 candidates)."""
    PCH: tl.constexpr = triton.cdiv(H, SCORE_COLS)
    PCHP: tl.constexpr = triton.next_power_of_2(PCH)
    cand = tl.arange(0, CANDS)
    chunks = tl.arange(0, PCHP)
    part = part_ptr + s * (PCH * PARTS * CP) + chunks[:, None] * (PARTS * CP) + cand[None, :]
    live = (chunks < PCH)[:, None]
    sumsq = tl.sum(tl.load(part, mask=live, other=0.0), axis=0)
    qdot = tl.sum(tl.load(part + CP, mask=live, other=0.0), axis=0)
    score = rsqrt_rn(sumsq / H + eps) * qdot
    score = tl.where(cand <= nb, score, float("-inf"))
    e = tl.exp(score - tl.max(score, axis=0))
    return e / tl.sum(e, axis=0)


@triton.jit
def seam_mix_task(
    s,  # token
    chunk,
    prefix_ptr,  # bf16 [S, H]
    stride_ps,
    blocks_ptr,  # bf16 [S, nb_max, H]
    stride_bs,
    stride_bn,
    nb,
    part_ptr,  # fp32 [S, PCH, PARTS, CP]: every score chunk's score_partials
    eps,
    h_ptr,  # bf16 [S, H] out
    hsq_ptr,  # fp32 [S, CH] out
    H: tl.constexpr,
    CANDS: tl.constexpr,
    CP: tl.constexpr,
    SC: tl.constexpr,
    SCORE_COLS: tl.constexpr,
):
    CH: tl.constexpr = triton.cdiv(H, SC)
    cand = tl.arange(0, CANDS)
    a = _mix_weights(s, nb, part_ptr, eps, H, CANDS, CP, SCORE_COLS)
    cols, m = _chunk_cols(chunk, H, SC)
    h = tl.zeros([SC], dtype=tl.float32)
    for i in tl.static_range(CANDS):
        row = _candidate_row(i, s, nb, blocks_ptr, stride_bs, stride_bn, prefix_ptr, stride_ps)
        a_i = tl.sum(tl.where(cand == i, a, 0.0), axis=0)  # 0 past the candidates: adds +0
        h += a_i * as_f32(tl.load(row + cols, mask=m & (i <= nb), other=0.0))
    hb = to_bf16(h)
    tl.store(h_ptr + s * H + cols, hb, mask=m)
    hf = as_f32(hb)
    tl.store(hsq_ptr + s * CH + chunk, tl.sum(tl.where(m, hf * hf, 0.0), axis=0))


@triton.jit
def seam_scale(
    s,  # token
    hsq_ptr,  # fp32 [S, CH]: every chunk's seam_mix_task
    eps,
    H: tl.constexpr,
    SC: tl.constexpr,
):
    """rsqrt(mean(h^2) + eps) of token s, the chunks' sums added in chunk order:
    every task that normalises h (the norm's, and the mono launch's single-token
    router, kernels/router.py) computes it alike, so all get x's bits."""
    CH: tl.constexpr = triton.cdiv(H, SC)
    total = tl.load(hsq_ptr + s * CH)
    for c in tl.static_range(1, CH):
        total += tl.load(hsq_ptr + s * CH + c)
    return rsqrt_rn(total / H + eps)


@triton.jit
def seam_norm_task(
    s,  # token
    chunk,
    h_ptr,  # bf16 [S, H]: every chunk's seam_mix_task
    hsq_ptr,  # fp32 [S, CH]: the same
    post_norm_ptr,  # bf16 [H]
    eps,
    x_ptr,  # bf16 [S, H] out
    stride_xs,
    H: tl.constexpr,
    SC: tl.constexpr,
):
    r = seam_scale(s, hsq_ptr, eps, H, SC)
    cols, m = _chunk_cols(chunk, H, SC)
    h = as_f32(tl.load(h_ptr + s * H + cols, mask=m, other=0.0))
    w = as_f32(tl.load(post_norm_ptr + cols, mask=m, other=0.0))
    tl.store(x_ptr + s * stride_xs + cols, rms_value(h, w, r), mask=m)


@triton.jit
def _seam_score_kernel(
    prefix_ptr,  # bf16 [S, H]
    stride_ps,
    blocks_ptr,  # bf16 [S, nb_max, H]
    stride_bs,
    stride_bn,
    nb,
    ares_norm_ptr,  # bf16 [H]
    ares_proj_ptr,  # bf16 [H]
    part_ptr,  # fp32 [S, PCH, PARTS, CP] out
    H: tl.constexpr,
    CANDS: tl.constexpr,
    CP: tl.constexpr,
    SCORE_COLS: tl.constexpr,
):
    seam_score_task(tl.program_id(0), tl.program_id(1), prefix_ptr, stride_ps, blocks_ptr, stride_bs, stride_bn, nb,
                    ares_norm_ptr, ares_proj_ptr, part_ptr, H, CANDS, CP, SCORE_COLS)


@triton.jit
def _seam_mix_kernel(
    prefix_ptr,  # bf16 [S, H]
    stride_ps,
    blocks_ptr,  # bf16 [S, nb_max, H]
    stride_bs,
    stride_bn,
    nb,
    part_ptr,  # fp32 [S, PCH, PARTS, CP]
    eps,
    h_ptr,  # bf16 [S, H] out
    hsq_ptr,  # fp32 [S, CH] out
    H: tl.constexpr,
    CANDS: tl.constexpr,
    CP: tl.constexpr,
    SC: tl.constexpr,
    SCORE_COLS: tl.constexpr,
):
    seam_mix_task(tl.program_id(0), tl.program_id(1), prefix_ptr, stride_ps, blocks_ptr, stride_bs, stride_bn, nb,
                  part_ptr, eps, h_ptr, hsq_ptr, H, CANDS, CP, SC, SCORE_COLS)


@triton.jit
def _seam_norm_kernel(
    h_ptr,  # bf16 [S, H]
    hsq_ptr,  # fp32 [S, CH]
    post_norm_ptr,  # bf16 [H]
    eps,
    x_ptr,  # bf16 [S, H] out
    stride_xs,
    H: tl.constexpr,
    SC: tl.constexpr,
):
    seam_norm_task(tl.program_id(0), tl.program_id(1), h_ptr, hsq_ptr, post_norm_ptr, eps, x_ptr, stride_xs, H, SC)


def num_candidates_pad(nb: int) -> int:
    """CANDS: the nb blocks and P, rounded up to a power of two."""
    return next_pow2(nb + 1)


def launch_attnres(prefix, blocks, nb, ares_norm, ares_proj, post_norm, eps, x_out, seam, geom) -> None:
    """x_out [S, H] bf16 = rms(AttnRes mix of [blocks[:, :nb], prefix], post_norm):
    three launches (score, mix, norm) of a program per (token, chunk).

    prefix [S, H] bf16; blocks [S, nb_max, H] bf16 (its strides are used; only
    the first nb blocks are read); the three norm vectors [H] bf16; ``seam``
    the steps' scratch (layout.scratch_layout's regions): seam_part [S, PCH, 2, CP]
    fp32, seam_h [S, H] bf16, seam_hsq [S, CH] fp32.
    """
    S, H = prefix.shape
    if blocks.dim() != 3 or blocks.shape[0] != S or blocks.shape[2] != H or not 1 <= nb <= blocks.shape[1]:
        raise ValueError(f"launch_attnres: blocks {list(blocks.shape)} with nb={nb} for prefix {list(prefix.shape)}")
    if tuple(x_out.shape) != (S, H):
        raise ValueError(f"launch_attnres: x_out {list(x_out.shape)}, expected {[S, H]}")
    for name, t in (("prefix", prefix), ("blocks", blocks), ("x_out", x_out), ("ares_norm", ares_norm),
                    ("ares_proj", ares_proj), ("post_norm", post_norm)):
        if t.stride(-1) != 1:
            raise ValueError(f"launch_attnres: {name} needs unit stride along its last dim")
    cands, sc, score_cols = num_candidates_pad(nb), geom.seam_cols, geom.score_cols
    part, h, hsq = seam["seam_part"], seam["seam_h"], seam["seam_hsq"]
    chunks, score_chunks, cp = triton.cdiv(H, sc), triton.cdiv(H, score_cols), part.shape[-1]
    if cp < cands:
        raise ValueError(f"launch_attnres: seam_part holds {cp} candidates, nb={nb} needs {cands}")
    expect_tensor("seam_part", part, (S, score_chunks, PARTS.value, cp), torch.float32)
    expect_tensor("seam_h", h, (S, H), torch.bfloat16)
    expect_tensor("seam_hsq", hsq, (S, chunks), torch.float32)
    grid, warps = (S, chunks), geom.vector_warps
    _seam_score_kernel[(S, score_chunks)](
        prefix, prefix.stride(0), blocks, blocks.stride(0), blocks.stride(1), nb, ares_norm, ares_proj, part,
        H=H, CANDS=cands, CP=cp, SCORE_COLS=score_cols, num_warps=warps,
    )
    _seam_mix_kernel[grid](
        prefix, prefix.stride(0), blocks, blocks.stride(0), blocks.stride(1), nb, part, float(eps), h, hsq,
        H=H, CANDS=cands, CP=cp, SC=sc, SCORE_COLS=score_cols, num_warps=warps,
    )
    _seam_norm_kernel[grid](h, hsq, post_norm, float(eps), x_out, x_out.stride(0), H=H, SC=sc, num_warps=warps)
