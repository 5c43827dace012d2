"""AR2 and the routed-expert norm: the summed latent, weighted, in the rank's columns, and its scale.

Shapes: T ranks, S tokens, L latent, L_R = L / T the rank's columns (the input
of its latent up-projection, FINAL), PC = geom.latent_part columns a part,
PL = ceil(L / PC) parts.

    acc    = ar2[0] + ar2[1] + ... + ar2[T-1]        fp32, rank order (tp.py)
    a      = bf16(acc)
    k3-math: latent = bf16(latent_norm * bf16(a * rsqrt(mean(a^2) + eps)))

The norm's scale rsqrt(mean(a^2) + eps) is one number a token, which needs all
of L; the weighted latent needs only a's own columns. So the scale is not
applied here but in FINAL, after its latent up-projection's dot (kernels/final.py):

    part (s, p): the ranks summed over part p's PC columns, rounded, squared and
                 summed                                          -> sq [S, PL] fp32
                 and, in the rank's columns among them,
                 bf16(latent_norm * a)                           -> latent [S, L_R] bf16
    FINAL:       rsqrt(sum_p sq[s, p] / L + eps) * (latent[s] @ latent_up_r.T)

The parts sit on the launch's critical path (the last token's), where what
counts is the number of dependent steps, each a poll hop and a memory round
trip: one CTA summing the ranks over all of L (T * L * 4 bytes) took 5.3 us at
S = 1, a norm step after the parts 2.0 us more (docs/PERF.md). Deferring the
scale leaves one step. It rounds once where k3-math rounds twice (a * scale is
not rounded before the weight's product): the same function with one rounding
fewer, within the error budget of the bf16 reference (tests/test_staged.py,
tests/test_mono.py). The staged launch and the mono launch's tasks run the
same functions: the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..errors import expect_tensor
from .common import as_f32, rsqrt_rn, to_bf16
from .reduce import sum_ranks


@triton.jit
def latent_part_task(
    s,  # token
    part,  # its columns start at part * PC
    rank,  # this rank: its L_R columns start at rank * L_R
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    norm_ptr,  # [L] bf16
    sq_ptr,  # [S, PL] fp32 out
    out_ptr,  # [S, L_R] bf16 out: the rank's columns of the weighted latent
    stride_os,
    T: tl.constexpr,
    L: tl.constexpr,
    L_R: tl.constexpr,
    PC: tl.constexpr,
    PL: tl.constexpr,
):
    cols = part * PC + tl.arange(0, PC)
    in_l = cols < L
    a = as_f32(to_bf16(sum_ranks(ar2_ptr, stride_at, stride_as, s, cols, in_l, T)))
    local = cols - rank * L_R
    mine = in_l & (local >= 0) & (local < L_R)
    w = as_f32(tl.load(norm_ptr + cols, mask=mine, other=0.0))
    tl.store(sq_ptr + s * PL + part, tl.sum(a * a, axis=0))
    tl.store(out_ptr + s * stride_os + local, to_bf16(w * a), mask=mine)


@triton.jit
def latent_scale(
    sq_ptr,  # [S, PL] fp32: the parts' sums of a^2
    eps,
    S: tl.constexpr,
    SP: tl.constexpr,
    L: tl.constexpr,
    PL: tl.constexpr,
):
    """[SP] fp32: rsqrt(mean(a^2) + eps) a token, the parts' sums added in part
    order (tokens at or past S: rsqrt(eps), never stored)."""
    tok = tl.arange(0, SP)
    real = tok < S
    total = tl.load(sq_ptr + tok * PL, mask=real, other=0.0)
    for p in tl.static_range(1, PL):
        total += tl.load(sq_ptr + tok * PL + p, mask=real, other=0.0)
    return rsqrt_rn(total / L + eps)


@triton.jit
def _latent_part_kernel(
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    norm_ptr,  # [L] bf16
    sq_ptr,  # [S, PL] fp32 out
    out_ptr,  # [S, L_R] bf16 out
    stride_os,
    rank,
    T: tl.constexpr,
    L: tl.constexpr,
    L_R: tl.constexpr,
    PC: tl.constexpr,
    PL: tl.constexpr,
):
    latent_part_task(tl.program_id(0), tl.program_id(1), rank, ar2_ptr, stride_at, stride_as, norm_ptr, sq_ptr,
                     out_ptr, stride_os, T, L, L_R, PC, PL)


def launch_latent_parts(ar2, latent_norm, latent_sq, latent_out, rank, geom) -> None:
    """latent_out [S, L/T] bf16 = the rank's columns of bf16(latent_norm * bf16(sum_t ar2[t])),
    latent_sq [S, PL] fp32 = each part's sum of bf16(sum_t ar2[t])^2 (FINAL's scale;
    layout.scratch_layout); ar2 [T, S, L] fp32, latent_norm [L] bf16."""
    T, S, L = ar2.shape
    if tuple(latent_out.shape) != (S, L // T) or tuple(latent_norm.shape) != (L,) or L % T or not 0 <= rank < T:
        raise ValueError(
            f"launch_latent_parts: ar2 {list(ar2.shape)}, latent_norm {list(latent_norm.shape)}, "
            f"out {list(latent_out.shape)} (expected [{S}, {L // T}]), rank {rank}"
        )
    parts = triton.cdiv(L, geom.latent_part)
    expect_tensor("latent_sq", latent_sq, (S, parts), ar2.dtype)
    for name, t in (("ar2", ar2), ("latent_norm", latent_norm), ("latent_out", latent_out)):
        if t.stride(-1) != 1:
            raise ValueError(f"launch_latent_parts: {name} needs unit stride along its last dim")
    if not latent_sq.is_contiguous():
        raise ValueError("launch_latent_parts: latent_sq must be contiguous")
    _latent_part_kernel[(S, parts)](ar2, ar2.stride(0), ar2.stride(1), latent_norm, latent_sq, latent_out,
                                    latent_out.stride(0), rank, T=T, L=L, L_R=L // T, PC=geom.latent_part, PL=parts,
                                    num_warps=geom.vector_warps)
