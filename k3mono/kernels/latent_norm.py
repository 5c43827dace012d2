"""AR2 and the routed-expert norm: the summed latent, normalised, in the rank's columns.

Shapes: T ranks, S tokens, L latent, L_R = L / T the rank's columns (the input
of its latent up-projection, FINAL), VB = geom.vector_block columns per step.

    acc    = ar2[0] + ar2[1] + ... + ar2[T-1]        fp32, rank order (tp.py)
    a      = bf16(acc)
    latent [S, L_R] bf16 = bf16(latent_norm * bf16(a * rsqrt(mean(a^2) + eps)))[:, rank * L_R ...]

The norm needs all of L, so a task is one token, in two sweeps: the first sums
the ranks over all L and sums a^2; the second sums them again over the rank's
L_R columns only (the same adds in the same order: the same a) and normalises.
Neither sweep reads what the other wrote, so all their loads can be in flight
at once (the chunk loops are unrolled): the task is one CTA's latency chain (the
last token's is on the launch's critical path), so what counts is the number of
dependent memory round trips, not bandwidth. Staging a in the output and
normalising all of L took two round trips and a CTA barrier, for the 1 / T of
the latent this rank's up-projection reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import as_f32, rsqrt_rn, to_bf16
from .reduce import sum_ranks


@triton.jit
def _rounded_sum(
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    s,  # token
    cols,  # [VB] column indices
    mask,  # [VB]
    T: tl.constexpr,
):
    """[VB] fp32: a = bf16(the ranks' sum) at cols (0 where masked)."""
    return as_f32(to_bf16(sum_ranks(ar2_ptr, stride_at, stride_as, s, cols, mask, T)))


@triton.jit
def latent_norm_task(
    s,  # token
    rank,  # this rank: its L_R columns start at rank * L_R
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    norm_ptr,  # [L] bf16
    eps,
    out_ptr,  # [S, L_R] bf16: the rank's columns of the normalised latent
    stride_os,
    T: tl.constexpr,
    L: tl.constexpr,
    L_R: tl.constexpr,
    VB: tl.constexpr,
):
    offs = tl.arange(0, VB)
    sq = tl.zeros([VB], dtype=tl.float32)
    for c0 in tl.static_range(0, L, VB):
        cols = c0 + offs
        a = _rounded_sum(ar2_ptr, stride_at, stride_as, s, cols, cols < L, T)
        sq += a * a
    r = rsqrt_rn(tl.sum(sq, axis=0) / L + eps)
    for c0 in tl.static_range(0, L_R, VB):
        local = c0 + offs
        m = local < L_R
        cols = rank * L_R + local
        a = _rounded_sum(ar2_ptr, stride_at, stride_as, s, cols, m, T)
        w = as_f32(tl.load(norm_ptr + cols, mask=m, other=0.0))
        tl.store(out_ptr + s * stride_os + local, to_bf16(w * as_f32(to_bf16(a * r))), mask=m)


@triton.jit
def _latent_norm_kernel(
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    norm_ptr,  # [L] bf16
    eps,
    out_ptr,  # [S, L_R] bf16
    stride_os,
    rank,
    T: tl.constexpr,
    L: tl.constexpr,
    L_R: tl.constexpr,
    VB: tl.constexpr,
):
    latent_norm_task(tl.program_id(0), rank, ar2_ptr, stride_at, stride_as, norm_ptr, eps, out_ptr, stride_os, T, L,
                     L_R, VB)


def launch_latent_norm(ar2, latent_norm, eps, latent_out, rank, geom) -> None:
    """latent_out [S, L/T] bf16 = the rank's columns of rms(bf16(sum_t ar2[t]), latent_norm);
    ar2 [T, S, L] fp32, latent_norm [L] bf16."""
    T, S, L = ar2.shape
    if tuple(latent_out.shape) != (S, L // T) or tuple(latent_norm.shape) != (L,) or L % T or not 0 <= rank < T:
        raise ValueError(
            f"launch_latent_norm: ar2 {list(ar2.shape)}, latent_norm {list(latent_norm.shape)}, "
            f"out {list(latent_out.shape)} (expected [{S}, {L // T}]), rank {rank}"
        )
    for name, t in (("ar2", ar2), ("latent_norm", latent_norm), ("latent_out", latent_out)):
        if t.stride(-1) != 1:
            raise ValueError(f"launch_latent_norm: {name} needs unit stride along its last dim")
    _latent_norm_kernel[(S,)](
        ar2, ar2.stride(0), ar2.stride(1), latent_norm, float(eps), latent_out, latent_out.stride(0), rank,
        T=T, L=L, L_R=L // T, VB=geom.vector_block, num_warps=geom.latent_norm_warps,
    )
