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
h, so a task is one token, in three sweeps over H: (1) the squared sums and the
q-dot of every candidate in one read, score_i = r_i * (V_i . q) (the reference
scales before the dot; the two differ by fp32 rounding only); (2) mix, round h
and stage it in x_out while summing h^2; (3) normalise x_out in place.
x is rank-local, so the task stores it directly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..planner import next_pow2
from .common import as_f32, rsqrt_rn, to_bf16


@triton.jit
def _candidate_row(
    i,
    s,
    nb,
    blocks_ptr,  # [S, nb_max, H] bf16
    stride_bs,
    stride_bn,
    prefix_ptr,  # [S, H] bf16
    stride_ps,
):
    """Pointer to candidate i of token s: the blocks first, P last."""
    if i < nb:
        row = blocks_ptr + s * stride_bs + i * stride_bn
    else:
        row = prefix_ptr + s * stride_ps
    return row


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
):
    cand = tl.arange(0, CANDS)
    offs = tl.arange(0, VB)
    n_cand = nb + 1

    # (1) per candidate: sum V^2 and V . q in one read.
    sumsq = tl.zeros([CANDS], dtype=tl.float32)
    qdot = tl.zeros([CANDS], dtype=tl.float32)
    for i in range(CANDS):
        if i < n_cand:
            row = _candidate_row(i, s, nb, blocks_ptr, stride_bs, stride_bn, prefix_ptr, stride_ps)
            ss = tl.zeros([VB], dtype=tl.float32)
            qd = tl.zeros([VB], dtype=tl.float32)
            for c0 in range(0, H, VB):
                cols = c0 + offs
                m = cols < H
                v = as_f32(tl.load(row + cols, mask=m, other=0.0))
                q = as_f32(tl.load(ares_norm_ptr + cols, mask=m, other=0.0)) * as_f32(
                    tl.load(ares_proj_ptr + cols, mask=m, other=0.0)
                )
                ss += v * v
                qd += v * q
            sumsq = tl.where(cand == i, tl.sum(ss, axis=0), sumsq)
            qdot = tl.where(cand == i, tl.sum(qd, axis=0), qdot)

    score = rsqrt_rn(sumsq / H + eps) * qdot
    score = tl.where(cand < n_cand, score, float("-inf"))
    e = tl.exp(score - tl.max(score, axis=0))
    a = e / tl.sum(e, axis=0)

    # (2) h = bf16(sum_i a_i V_i), staged in x_out; sum of h^2 for the norm.
    hsq = tl.zeros([VB], dtype=tl.float32)
    for c0 in range(0, H, VB):
        cols = c0 + offs
        m = cols < H
        h = tl.zeros([VB], dtype=tl.float32)
        for i in range(CANDS):
            if i < n_cand:
                row = _candidate_row(i, s, nb, blocks_ptr, stride_bs, stride_bn, prefix_ptr, stride_ps)
                a_i = tl.sum(tl.where(cand == i, a, 0.0), axis=0)
                h += a_i * as_f32(tl.load(row + cols, mask=m, other=0.0))
        hb = to_bf16(h)
        tl.store(x_ptr + s * stride_xs + cols, hb, mask=m)
        hf = as_f32(hb)
        hsq += tl.where(m, hf * hf, 0.0)

    # Sweep 3 reads what other threads of this program stored in sweep 2.
    tl.debug_barrier()

    # (3) x = rms(h, post_norm), in place.
    r = rsqrt_rn(tl.sum(hsq, axis=0) / H + eps)
    for c0 in range(0, H, VB):
        cols = c0 + offs
        m = cols < H
        h = as_f32(tl.load(x_ptr + s * stride_xs + cols, mask=m, other=0.0))
        w = as_f32(tl.load(post_norm_ptr + cols, mask=m, other=0.0))
        x = to_bf16(w * as_f32(to_bf16(h * r)))
        tl.store(x_ptr + s * stride_xs + cols, x, mask=m)


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
):
    attnres_task(
        tl.program_id(0), prefix_ptr, stride_ps, blocks_ptr, stride_bs, stride_bn, nb,
        ares_norm_ptr, ares_proj_ptr, post_norm_ptr, eps, x_ptr, stride_xs, H, CANDS, VB,
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
        H=H, CANDS=num_candidates_pad(nb), VB=geom.vector_block, num_warps=geom.vector_warps,
    )
