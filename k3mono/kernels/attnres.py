"""The AttnRes seam: score the candidates, mix them, and the pre-MLP RMSNorm.

Shapes: S tokens, H hidden, nb AttnRes blocks (nb + 1 <= CANDS candidates),
VB = geom.vector_block columns per step.

    V      = [blocks[s, 0], .., blocks[s, nb-1], P[s]]     (fp32 of bf16)
    r_i    = rsqrt(mean(V_i^2) + eps)
    score_i = sum_d V_i[d] * r_i * q[d],   q = ares_norm * ares_proj   (fp32)
    a      = softmax(score)
    h      = bf16(sum_i a_i * V_i)                         (candidates added in order)
    x      = bf16(post_norm * bf16(h * rsqrt(mean(h^2) + eps)))

The scores need all of H before any mixing can start, and the norm needs all of
h, so a task is one token, in three sweeps over H, each unrolled over its
H / VB chunks so their loads are all in flight at once (the task is one CTA's
latency chain on the launch's critical path: what counts is the number of
dependent round trips, not bandwidth): (1) the squared sums and the q-dot of
every candidate in one read, the blocks as one [NBP, VB] tile a chunk (rows
past nb masked, costing no memory traffic) and P as one row, reduced
block-wide once at the end; score_i = r_i * (V_i . q) (the reference scales
before the dot; the two differ by fp32 rounding only); (2) mix (re-reading the
candidates from L1 / L2), round h and stage it in x_out while summing h^2;
(3) normalise x_out in place. x is rank-local, so the task stores it directly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..planner import next_pow2
from .common import as_f32, rsqrt_rn, to_bf16


@triton.jit
def attnres_task(
    s,  # token
    prefix_ptr,  # [S, H] bf16: P, already updated by AR1
    stride_ps,
    blocks_ptr,  # [S, nb_max, H] bf16
    stride_bs,
    stride_bn,
    nb,
    ares_norm_ptr,  # [H] bf16
    ares_proj_ptr,  # [H] bf16
    post_norm_ptr,  # [H] bf16
    eps,
    x_ptr,  # [S, H] bf16 out
    stride_xs,
    H: tl.constexpr,
    CANDS: tl.constexpr,
    VB: tl.constexpr,
    NBP: tl.constexpr = 0,  # block rows of a tile: a power of two >= nb (0: CANDS, always enough)
):
    ROWS: tl.constexpr = CANDS if NBP == 0 else NBP
    blk = tl.arange(0, ROWS)
    offs = tl.arange(0, VB)[None, :]  # [1, VB]: the 1-row vectors share the tile's layout
    blk_on = blk < nb
    blk_rows = blocks_ptr + s * stride_bs + blk[:, None] * stride_bn  # [ROWS, 1]
    p_row = prefix_ptr + s * stride_ps
    x_row = x_ptr + s * stride_xs

    # (1) every candidate's sum of V^2 and V . q in one read. The blocks are a
    # [ROWS, VB] tile a step (rows past nb masked: no memory traffic), P its
    # own row; the chunk loop is unrolled, so the loads of all chunks and all
    # candidates can be in flight together. Partials stay elementwise until one
    # block-wide reduction at the end.
    ss_b = tl.zeros([ROWS, VB], dtype=tl.float32)
    qd_b = tl.zeros([ROWS, VB], dtype=tl.float32)
    ss_p = tl.zeros([1, VB], dtype=tl.float32)
    qd_p = tl.zeros([1, VB], dtype=tl.float32)
    for c0 in tl.static_range(0, H, VB):
        cols = c0 + offs
        m = cols < H
        v = as_f32(tl.load(blk_rows + cols, mask=blk_on[:, None] & m, other=0.0))
        p = as_f32(tl.load(p_row + cols, mask=m, other=0.0))
        q = as_f32(tl.load(ares_norm_ptr + cols, mask=m, other=0.0)) * as_f32(
            tl.load(ares_proj_ptr + cols, mask=m, other=0.0)
        )
        ss_b += v * v
        qd_b += v * q
        ss_p += p * p
        qd_p += p * q
    sumsq_b, qdot_b = tl.reduce((ss_b, qd_b), 1, _add2)
    sumsq_p, qdot_p = tl.reduce((tl.reshape(ss_p, [VB]), tl.reshape(qd_p, [VB])), 0, _add2)

    score_b = tl.where(blk_on, rsqrt_rn(sumsq_b / H + eps) * qdot_b, float("-inf"))
    score_p = rsqrt_rn(sumsq_p / H + eps) * qdot_p
    top = tl.maximum(tl.max(score_b, axis=0), score_p)
    e_b = tl.exp(score_b - top)
    e_p = tl.exp(score_p - top)
    denom = tl.sum(e_b, axis=0) + e_p
    a_b = e_b / denom
    a_p = e_p / denom

    # (2) h = bf16(sum_i a_i V_i), staged in x_out; sum of h^2 for the norm.
    # The re-read of the candidates hits L1 / L2 (read in (1) just before).
    hsq = tl.zeros([1, VB], dtype=tl.float32)
    for c0 in tl.static_range(0, H, VB):
        cols = c0 + offs
        m = cols < H
        v = as_f32(tl.load(blk_rows + cols, mask=blk_on[:, None] & m, other=0.0))
        p = as_f32(tl.load(p_row + cols, mask=m, other=0.0))
        h = tl.sum(a_b[:, None] * v, axis=0, keep_dims=True) + a_p * p
        hb = to_bf16(h)
        tl.store(x_row + cols, hb, mask=m)
        hf = as_f32(hb)
        hsq += tl.where(m, hf * hf, 0.0)

    # Sweep 3 reads what other threads of this program stored in sweep 2.
    tl.debug_barrier()

    # (3) x = rms(h, post_norm), in place.
    r = rsqrt_rn(tl.sum(tl.reshape(hsq, [VB]), axis=0) / H + eps)
    for c0 in tl.static_range(0, H, VB):
        cols = c0 + offs
        m = cols < H
        h = as_f32(tl.load(x_row + cols, mask=m, other=0.0))
        w = as_f32(tl.load(post_norm_ptr + cols, mask=m, other=0.0))
        x = to_bf16(w * as_f32(to_bf16(h * r)))
        tl.store(x_row + cols, x, mask=m)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _attnres_kernel(
    prefix_ptr,  # [S, H] bf16
    stride_ps,
    blocks_ptr,  # [S, nb_max, H] bf16
    stride_bs,
    stride_bn,
    nb,
    ares_norm_ptr,  # [H] bf16
    ares_proj_ptr,  # [H] bf16
    post_norm_ptr,  # [H] bf16
    eps,
    x_ptr,  # [S, H] bf16
    stride_xs,
    H: tl.constexpr,
    CANDS: tl.constexpr,
    VB: tl.constexpr,
    NBP: tl.constexpr = 0,
):
    attnres_task(
        tl.program_id(0), prefix_ptr, stride_ps, blocks_ptr, stride_bs, stride_bn, nb,
        ares_norm_ptr, ares_proj_ptr, post_norm_ptr, eps, x_ptr, stride_xs, H, CANDS, VB, NBP,
    )


def num_candidates_pad(nb: int) -> int:
    """CANDS: the nb blocks and P, rounded up to a power of two."""
    return next_pow2(nb + 1)


def launch_attnres(prefix, blocks, nb, ares_norm, ares_proj, post_norm, eps, x_out, geom) -> None:
    """x_out [S, H] bf16 = rms(AttnRes mix of [blocks[:, :nb], prefix], post_norm).

    prefix [S, H] bf16; blocks [S, nb_max, H] bf16 (its strides are used; only
    the first nb blocks are read); the three norm vectors [H] bf16.
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
    _attnres_kernel[(S,)](
        prefix, prefix.stride(0), blocks, blocks.stride(0), blocks.stride(1), nb,
        ares_norm, ares_proj, post_norm, float(eps), x_out, x_out.stride(0),
        H=H, CANDS=num_candidates_pad(nb), VB=geom.vector_block, NBP=next_pow2(nb), num_warps=geom.attnres_warps,
    )
