"""The rank's AR3 operand: its latent up-projection columns plus its shared down.

Shapes: S tokens, H hidden, L latent, SI shared intermediate, T ranks, PL
latent parts (kernels/latent_norm.py).

    partial [S, H] fp32 = scale[s] * (latent_r [S, L/T] @ latent_up_r [H, L/T].T)
                        + shared_act [S, SI/T] @ shared_down_r [H, SI/T].T      (both unrounded)
    scale [S] = rsqrt(sum_p latent_sq[s, p] / L + eps)        the latent norm's, deferred to here

latent_r is the weighted latent bf16(routed_expert_norm * a) without the norm's
scale (kernels/latent_norm.py: the scale needs all of L, the weighted latent
only its columns, so the norm is one step and the scale a number a token here).

A task owns ``geom.final.rows`` rows of H and runs both GEMVs into them (the
two terms are added complete, as tp.py adds r_t + s_t). The partial is pushed
to every rank's ar3 slot r, so ``final_task`` returns the register tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import expect_tensor
from . import common
from .gemv import check_rows_contiguous, even_k, gemv_tile, num_tasks, store_rows
from .latent_norm import latent_scale


@triton.jit
def final_sum(
    routed,  # [SP, ROWS] fp32: latent_r @ latent_up_r.T of the tile's rows
    scale,  # [SP] fp32: the latent norm's scale a token (latent_norm.latent_scale)
    shared,  # [SP, ROWS] fp32: the tile's shared down-projection
):
    """[SP, ROWS] fp32: the two terms of the partial, each complete, added (the
    mono launch computes them apart: one function, so both paths give its bits)."""
    return routed * scale[:, None] + shared


@triton.jit
def final_task(
    task,
    latent_ptr,  # [S, L/T] bf16: the rank's columns of the weighted latent
    stride_ls,
    sq_ptr,  # [S, PL] fp32: the latent parts' sums of squares
    eps,
    up_ptr,  # [H, L/T] bf16
    stride_un,
    act_ptr,  # [S, SI/T] bf16
    stride_as,
    down_ptr,  # [H, SI/T] bf16
    stride_dn,
    S: tl.constexpr,
    H: tl.constexpr,
    L: tl.constexpr,
    PL: tl.constexpr,
    K_LATENT: tl.constexpr,  # L/T
    K_SHARED: tl.constexpr,  # SI/T
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K_LATENT: tl.constexpr,
    EVEN_K_SHARED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """[SP, ROWS] fp32: rows task*ROWS .. of the partial."""
    row0 = task * ROWS
    routed = gemv_tile(latent_ptr, stride_ls, up_ptr, stride_un, row0, S, H, K_LATENT, SP, ROWS, BLOCK_K, USE_DOT,
                       EVEN_K_LATENT, UPCAST)
    shared = gemv_tile(act_ptr, stride_as, down_ptr, stride_dn, row0, S, H, K_SHARED, SP, ROWS, BLOCK_K, USE_DOT,
                       EVEN_K_SHARED, UPCAST)
    return final_sum(routed, latent_scale(sq_ptr, eps, S, SP, L, PL), shared)


@triton.jit
def _final_kernel(
    latent_ptr,  # [S, L/T] bf16 (column slice)
    stride_ls,
    sq_ptr,  # [S, PL] fp32
    eps,
    up_ptr,  # [H, L/T] bf16
    stride_un,
    act_ptr,  # [S, SI/T] bf16
    stride_as,
    down_ptr,  # [H, SI/T] bf16
    stride_dn,
    out_ptr,  # [S, H] fp32: ar3[rank]
    stride_os,
    S: tl.constexpr,
    H: tl.constexpr,
    L: tl.constexpr,
    PL: tl.constexpr,
    K_LATENT: tl.constexpr,
    K_SHARED: tl.constexpr,
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K_LATENT: tl.constexpr,
    EVEN_K_SHARED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    task = tl.program_id(0)
    tile = final_task(
        task, latent_ptr, stride_ls, sq_ptr, eps, up_ptr, stride_un, act_ptr, stride_as, down_ptr, stride_dn, S, H,
        L, PL, K_LATENT, K_SHARED, SP, ROWS, BLOCK_K, USE_DOT, EVEN_K_LATENT, EVEN_K_SHARED, UPCAST,
    )
    store_rows(out_ptr, stride_os, tile, task * ROWS, 0, S, H, SP, ROWS)


def launch_final_partial(latent_r, latent_sq, eps, latent_up_r, shared_act, shared_down_r, partial_out, geom,
                         latent_width) -> None:
    """partial_out [S, H] fp32 = scale * (latent_r @ latent_up_r.T) + shared_act @ shared_down_r.T.

    latent_r [S, L/T] bf16 (the rank's columns of the weighted latent), latent_sq
    [S, PL] fp32 (the latent parts' sums of squares: scale = rsqrt(sum / L + eps),
    L = latent_width), latent_up_r [H, L/T] bf16, shared_act [S, SI/T] bf16,
    shared_down_r [H, SI/T] bf16.
    """
    S, KL = latent_r.shape
    H = latent_up_r.shape[0]
    KS = shared_down_r.shape[1]
    if (
        tuple(latent_up_r.shape) != (H, KL) or shared_down_r.shape[0] != H
        or tuple(shared_act.shape) != (S, KS) or tuple(partial_out.shape) != (S, H) or S != geom.tokens
    ):
        raise ValueError(
            f"launch_final_partial: latent_r {list(latent_r.shape)}, latent_up_r {list(latent_up_r.shape)}, "
            f"shared_act {list(shared_act.shape)}, shared_down_r {list(shared_down_r.shape)}, out {list(partial_out.shape)}"
        )
    for name, t in (("latent_r", latent_r), ("latent_up_r", latent_up_r), ("shared_act", shared_act),
                    ("shared_down_r", shared_down_r), ("partial_out", partial_out)):
        check_rows_contiguous(name, t)
    parts = triton.cdiv(latent_width, geom.latent_part)
    expect_tensor("latent_sq", latent_sq, (S, parts), torch.float32)
    if not latent_sq.is_contiguous():
        raise ValueError("launch_final_partial: latent_sq must be contiguous")
    tile = geom.final
    _final_kernel[(num_tasks(H, tile.rows),)](
        latent_r, latent_r.stride(0), latent_sq, float(eps), latent_up_r, latent_up_r.stride(0), shared_act,
        shared_act.stride(0), shared_down_r, shared_down_r.stride(0), partial_out, partial_out.stride(0),
        S=S, H=H, L=latent_width, PL=parts, K_LATENT=KL, K_SHARED=KS, SP=geom.tokens_pad, ROWS=tile.rows,
        BLOCK_K=tile.block_k, USE_DOT=geom.use_dot,
        EVEN_K_LATENT=even_k(KL, tile.block_k), EVEN_K_SHARED=even_k(KS, tile.block_k),
        UPCAST=common.UPCAST_DOT, num_warps=tile.warps,
    )
