"""AR2 and the routed-expert norm: the summed latent, normalised.

Shapes: T ranks, S tokens, L latent, VB = geom.vector_block columns per step.

    acc    = ar2[0] + ar2[1] + ... + ar2[T-1]        fp32, rank order (tp.py)
    a      = bf16(acc)
    latent [S, L] bf16 = bf16(latent_norm * bf16(a * rsqrt(mean(a^2) + eps)))

The norm needs all of L, so a task is one token, in two sweeps: the first sums
the ranks (in rank order), rounds a, stages it in the output row and sums a^2;
the second normalises the staged row in place. Both sweeps are unrolled over
the L / VB chunks so all their loads are in flight at once: the task is one
CTA's latency chain (the last token's is on the launch's critical path), so
what counts is the number of dependent memory round trips (two, plus the
barrier between), not bandwidth. The latent is read only by this rank's
up-projection, so the task stores it directly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import as_f32, rsqrt_rn, to_bf16
from .reduce import sum_ranks


@triton.jit
def latent_norm_task(
    s,  # token
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    norm_ptr,  # [L] bf16
    eps,
    out_ptr,  # [S, L] bf16
    stride_os,
    T: tl.constexpr,
    L: tl.constexpr,
    VB: tl.constexpr,
):
    offs = tl.arange(0, VB)
    # (1) a = bf16(sum of the ranks), staged in out; sum of a^2. The chunk loop
    # is unrolled: every chunk's T rank loads are independent, so they are all
    # in flight together instead of one chunk's latency after another's.
    sq = tl.zeros([VB], dtype=tl.float32)
    for c0 in tl.static_range(0, L, VB):
        cols = c0 + offs
        m = cols < L
        a = to_bf16(sum_ranks(ar2_ptr, stride_at, stride_as, s, cols, m, T))
        tl.store(out_ptr + s * stride_os + cols, a, mask=m)
        af = as_f32(a)
        sq += af * af
    # Sweep 2 reads what other threads of this program stored in sweep 1.
    tl.debug_barrier()
    r = rsqrt_rn(tl.sum(sq, axis=0) / L + eps)
    # (2) normalise the staged row in place (L / 8 KB, from L1 / L2).
    for c0 in tl.static_range(0, L, VB):
        cols = c0 + offs
        m = cols < L
        a = as_f32(tl.load(out_ptr + s * stride_os + cols, mask=m, other=0.0))
        w = as_f32(tl.load(norm_ptr + cols, mask=m, other=0.0))
        tl.store(out_ptr + s * stride_os + cols, to_bf16(w * as_f32(to_bf16(a * r))), mask=m)


@triton.jit
def _latent_norm_kernel(
    ar2_ptr,  # [T, S, L] fp32
    stride_at,
    stride_as,
    norm_ptr,  # [L] bf16
    eps,
    out_ptr,  # [S, L] bf16
    stride_os,
    T: tl.constexpr,
    L: tl.constexpr,
    VB: tl.constexpr,
):
    latent_norm_task(tl.program_id(0), ar2_ptr, stride_at, stride_as, norm_ptr, eps, out_ptr, stride_os, T, L, VB)


def launch_latent_norm(ar2, latent_norm, eps, latent_out, geom) -> None:
    """latent_out [S, L] bf16 = rms(bf16(sum_t ar2[t]), latent_norm); ar2 [T, S, L] fp32, latent_norm [L] bf16."""
    T, S, L = ar2.shape
    if tuple(latent_out.shape) != (S, L) or tuple(latent_norm.shape) != (L,):
        raise ValueError(
            f"launch_latent_norm: ar2 {list(ar2.shape)}, latent_norm {list(latent_norm.shape)}, "
            f"out {list(latent_out.shape)}"
        )
    for name, t in (("ar2", ar2), ("latent_norm", latent_norm), ("latent_out", latent_out)):
        if t.stride(-1) != 1:
            raise ValueError(f"launch_latent_norm: {name} needs unit stride along its last dim")
    _latent_norm_kernel[(S,)](
        ar2, ar2.stride(0), ar2.stride(1), latent_norm, float(eps), latent_out, latent_out.stride(0),
        T=T, L=L, VB=geom.vector_block, num_warps=geom.latent_norm_warps,
    )
