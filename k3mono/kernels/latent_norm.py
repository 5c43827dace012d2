"""AR2 and the routed-expert norm: the summed latent, normalised, in the rank's columns.

Shapes: T ranks, S tokens, L latent, L_R = L / T the rank's columns (the input
of its latent up-projection, FINAL), PC = geom.latent_part columns a part,
PL = ceil(L / PC) parts, VB = geom.vector_block columns per step.

    acc    = ar2[0] + ar2[1] + ... + ar2[T-1]        fp32, rank order (tp.py)
    a      = bf16(acc)
    latent [S, L_R] bf16 = bf16(latent_norm * bf16(a * rsqrt(mean(a^2) + eps)))[:, rank * L_R ...]

The norm needs all of L, and the task that does it sits on the launch's critical
path (the last token's), where what counts is the number of dependent memory
round trips, not bandwidth: one CTA summing the ranks over all of L (T * L * 4
bytes) took 5.3 us at S = 1. So a token is two steps, each one round trip:

    part (s, p): the ranks summed over part p's PC columns, rounded, squared and
                 summed                                         -> sq [S, PL] fp32
    norm (s):    the parts' sums added in part order give mean(a^2); the ranks
                 summed again over the rank's L_R columns (the same adds in the
                 same order: the same a) and normalised        -> latent [S, L_R]

The norm's sums of the ranks do not wait for its parts' sums, so both sets of
loads are in flight at once. The staged launches (a kernel per step) and the
mono launch's tasks run the same functions: the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..errors import expect_tensor
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
def latent_part_task(
    s,  # token
    part,  # its columns start at part * PC
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    sq_ptr,  # [S, PL] fp32 out
    T: tl.constexpr,
    L: tl.constexpr,
    PC: tl.constexpr,
    PL: tl.constexpr,
):
    cols = part * PC + tl.arange(0, PC)
    a = _rounded_sum(ar2_ptr, stride_at, stride_as, s, cols, cols < L, T)
    tl.store(sq_ptr + s * PL + part, tl.sum(a * a, axis=0))


@triton.jit
def latent_norm_task(
    s,  # token
    rank,  # this rank: its L_R columns start at rank * L_R
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    sq_ptr,  # [S, PL] fp32: the parts' sums of a^2
    norm_ptr,  # [L] bf16
    eps,
    out_ptr,  # [S, L_R] bf16: the rank's columns of the normalised latent
    stride_os,
    T: tl.constexpr,
    L: tl.constexpr,
    L_R: tl.constexpr,
    PL: tl.constexpr,
    VB: tl.constexpr,
):
    total = tl.load(sq_ptr + s * PL)
    for p in tl.static_range(1, PL):
        total += tl.load(sq_ptr + s * PL + p)
    r = rsqrt_rn(total / L + eps)
    offs = tl.arange(0, VB)
    for c0 in tl.static_range(0, L_R, VB):
        local = c0 + offs
        m = local < L_R
        cols = rank * L_R + local
        a = _rounded_sum(ar2_ptr, stride_at, stride_as, s, cols, m, T)
        w = as_f32(tl.load(norm_ptr + cols, mask=m, other=0.0))
        tl.store(out_ptr + s * stride_os + local, to_bf16(w * as_f32(to_bf16(a * r))), mask=m)


@triton.jit
def _latent_part_kernel(
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    sq_ptr,  # [S, PL] fp32 out
    T: tl.constexpr,
    L: tl.constexpr,
    PC: tl.constexpr,
    PL: tl.constexpr,
):
    latent_part_task(tl.program_id(0), tl.program_id(1), ar2_ptr, stride_at, stride_as, sq_ptr, T, L, PC, PL)


@triton.jit
def _latent_norm_kernel(
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    sq_ptr,  # [S, PL] fp32
    norm_ptr,  # [L] bf16
    eps,
    out_ptr,  # [S, L_R] bf16
    stride_os,
    rank,
    T: tl.constexpr,
    L: tl.constexpr,
    L_R: tl.constexpr,
    PL: tl.constexpr,
    VB: tl.constexpr,
):
    latent_norm_task(tl.program_id(0), rank, ar2_ptr, stride_at, stride_as, sq_ptr, norm_ptr, eps, out_ptr, stride_os,
                     T, L, L_R, PL, VB)


def launch_latent_norm(ar2, latent_norm, eps, latent_sq, latent_out, rank, geom) -> None:
    """latent_out [S, L/T] bf16 = the rank's columns of rms(bf16(sum_t ar2[t]), latent_norm);
    ar2 [T, S, L] fp32, latent_norm [L] bf16, latent_sq [S, PL] fp32 the parts' sums
    (layout.scratch_layout). Two launches: the parts, then the norm."""
    T, S, L = ar2.shape
    if tuple(latent_out.shape) != (S, L // T) or tuple(latent_norm.shape) != (L,) or L % T or not 0 <= rank < T:
        raise ValueError(
            f"launch_latent_norm: ar2 {list(ar2.shape)}, latent_norm {list(latent_norm.shape)}, "
            f"out {list(latent_out.shape)} (expected [{S}, {L // T}]), rank {rank}"
        )
    parts = triton.cdiv(L, geom.latent_part)
    expect_tensor("latent_sq", latent_sq, (S, parts), ar2.dtype)
    for name, t in (("ar2", ar2), ("latent_norm", latent_norm), ("latent_out", latent_out)):
        if t.stride(-1) != 1:
            raise ValueError(f"launch_latent_norm: {name} needs unit stride along its last dim")
    if not latent_sq.is_contiguous():
        raise ValueError("launch_latent_norm: latent_sq must be contiguous")
    _latent_part_kernel[(S, parts)](ar2, ar2.stride(0), ar2.stride(1), latent_sq, T=T, L=L, PC=geom.latent_part,
                                    PL=parts, num_warps=geom.vector_warps)
    _latent_norm_kernel[(S,)](
        ar2, ar2.stride(0), ar2.stride(1), latent_sq, latent_norm, float(eps), latent_out, latent_out.stride(0), rank,
        T=T, L=L, L_R=L // T, PL=parts, VB=geom.vector_block, num_warps=geom.latent_norm_warps,
    )
