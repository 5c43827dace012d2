"""The all-reduces AR1 (with the prefix update) and AR3, on the rank's own peer slots.

Shapes: T ranks, S tokens, N the reduced width (H for both), VB = geom.vector_block.

    sum      = ar[0] + ar[1] + ... + ar[T-1]      fp32, in rank order (tp.py)
    AR1:  o  = bf16(sum(ar1));   prefix = bf16(prefix + o)      (in place)
    AR3:  out = bf16(sum(ar3))

Every element is independent: ``*_chunk`` reduces any column set of one token
(the mono launch's column tiles), and a staged task owns VB columns of one
token (task = token * ceil(N / VB) + chunk). The result is bit-exact against
the reference: the same fp32 additions in the same order, one rounding each.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import as_f32, to_bf16


@triton.jit
def sum_ranks(
    ar_ptr,  # [T, S, N] fp32: slot t is rank t's partial
    stride_at,
    stride_as,
    s,
    cols,  # [VB] column indices
    mask,  # [VB]
    T: tl.constexpr,
):
    """[VB] fp32: sum over t = 0 .. T-1 of ar[t, s, cols], added in rank order."""
    ptrs = ar_ptr + s * stride_as + cols
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for t in range(1, T):
        acc += tl.load(ptrs + t * stride_at, mask=mask, other=0.0)
    return acc


@triton.jit
def _chunk(task, N: tl.constexpr, VB: tl.constexpr):
    """(token, columns, mask) of a reduce task."""
    chunks = tl.cdiv(N, VB)
    s = task // chunks
    cols = (task % chunks) * VB + tl.arange(0, VB)
    return s, cols, cols < N


@triton.jit
def reduce_prefix_chunk(
    ar1_ptr,  # [T, S, H] fp32
    stride_at,
    stride_as,
    prefix_ptr,  # [S, H] bf16, updated in place
    stride_ps,
    s,  # token
    cols,  # [n] column indices
    mask,  # [n]
    T: tl.constexpr,
):
    """prefix[s, cols] = bf16(prefix + bf16(sum_t ar1[t, s, cols])): any column
    set of one token (the mono launch's column tiles call this per token).
    Returns the new prefix there, bf16 (the mono launch scores it at once)."""
    o = to_bf16(sum_ranks(ar1_ptr, stride_at, stride_as, s, cols, mask, T))
    ptrs = prefix_ptr + s * stride_ps + cols
    prefix = to_bf16(as_f32(tl.load(ptrs, mask=mask, other=0.0)) + as_f32(o))
    tl.store(ptrs, prefix, mask=mask)
    return prefix


@triton.jit
def final_reduce_chunk(
    ar3_ptr,  # [T, S, H] fp32
    stride_at,
    stride_as,
    out_ptr,  # [S, H] bf16
    stride_os,
    s,  # token
    cols,  # [n] column indices
    mask,  # [n]
    T: tl.constexpr,
):
    """out[s, cols] = bf16(sum_t ar3[t, s, cols])."""
    y = to_bf16(sum_ranks(ar3_ptr, stride_at, stride_as, s, cols, mask, T))
    tl.store(out_ptr + s * stride_os + cols, y, mask=mask)


@triton.jit
def reduce_prefix_task(
    task,
    ar1_ptr,  # [T, S, H] fp32
    stride_at,
    stride_as,
    prefix_ptr,  # [S, H] bf16, updated in place
    stride_ps,
    T: tl.constexpr,
    H: tl.constexpr,
    VB: tl.constexpr,
):
    s, cols, mask = _chunk(task, H, VB)
    reduce_prefix_chunk(ar1_ptr, stride_at, stride_as, prefix_ptr, stride_ps, s, cols, mask, T)


@triton.jit
def final_reduce_task(
    task,
    ar3_ptr,  # [T, S, H] fp32
    stride_at,
    stride_as,
    out_ptr,  # [S, H] bf16
    stride_os,
    T: tl.constexpr,
    H: tl.constexpr,
    VB: tl.constexpr,
):
    s, cols, mask = _chunk(task, H, VB)
    final_reduce_chunk(ar3_ptr, stride_at, stride_as, out_ptr, stride_os, s, cols, mask, T)


@triton.jit
def _reduce_prefix_kernel(
    ar1_ptr,  # [T, S, H] fp32
    stride_at,
    stride_as,
    prefix_ptr,  # [S, H] bf16
    stride_ps,
    T: tl.constexpr,
    H: tl.constexpr,
    VB: tl.constexpr,
):
    reduce_prefix_task(tl.program_id(0), ar1_ptr, stride_at, stride_as, prefix_ptr, stride_ps, T, H, VB)


@triton.jit
def _final_reduce_kernel(
    ar3_ptr,  # [T, S, H] fp32
    stride_at,
    stride_as,
    out_ptr,  # [S, H] bf16
    stride_os,
    T: tl.constexpr,
    H: tl.constexpr,
    VB: tl.constexpr,
):
    final_reduce_task(tl.program_id(0), ar3_ptr, stride_at, stride_as, out_ptr, stride_os, T, H, VB)


def _check(name, ar, out):
    T, S, H = ar.shape
    if tuple(out.shape) != (S, H) or ar.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"{name}: ar {list(ar.shape)} and out {list(out.shape)} must be [T, S, H] and [S, H], rows contiguous")
    return T, S, H


def num_reduce_tasks(tokens: int, width: int, geom) -> int:
    return tokens * triton.cdiv(width, geom.vector_block)


def launch_reduce_prefix(ar1, prefix, geom) -> None:
    """prefix [S, H] bf16 = bf16(prefix + bf16(sum_t ar1[t])), in place; ar1 [T, S, H] fp32."""
    T, S, H = _check("launch_reduce_prefix", ar1, prefix)
    _reduce_prefix_kernel[(num_reduce_tasks(S, H, geom),)](
        ar1, ar1.stride(0), ar1.stride(1), prefix, prefix.stride(0),
        T=T, H=H, VB=geom.vector_block, num_warps=geom.vector_warps,
    )


def launch_final_reduce(ar3, out, geom) -> None:
    """out [S, H] bf16 = bf16(sum_t ar3[t]); ar3 [T, S, H] fp32."""
    T, S, H = _check("launch_final_reduce", ar3, out)
    _final_reduce_kernel[(num_reduce_tasks(S, H, geom),)](
        ar3, ar3.stride(0), ar3.stride(1), out, out.stride(0),
        T=T, H=H, VB=geom.vector_block, num_warps=geom.vector_warps,
    )
