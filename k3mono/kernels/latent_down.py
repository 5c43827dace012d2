"""Latent down-projection, split by latent rows: rank r's columns of the AG1 z.

Shapes: S tokens, H hidden, L latent, T ranks, L/T the rank's latent rows.

    z[:, r*L/T : (r+1)*L/T] [S, L/T] bf16 = bf16(x [S, H] @ latent_down_r [L/T, H].T)

A task owns ``geom.latent_down.rows`` latent rows of ``geom.x_group`` tokens (all
S, or a group: kernels/gemv.py group_window). The slice is gathered by every
rank, so ``latent_down_task`` returns the rounded register tile; its caller
stores it into each destination's z columns. On the tl.dot path K may be cut
into PARTS (planner.X_K_PARTS), as the router's (kernels/router.py): z is
rounded once, after the parts' sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import common
from .common import to_bf16
from .gemv import check_rows_contiguous, even_k, gemv_parts_tile, gemv_tile, group_window, num_tasks, store_rows


@triton.jit
def latent_down_task(
    task,
    window,  # the first x row of the task's G tokens (group_window)
    x_ptr,  # [S, H] bf16
    stride_xs,
    w_ptr,  # [L/T, H] bf16
    stride_wn,
    G: tl.constexpr,  # tokens a task: S, or a group's
    N: tl.constexpr,  # L/T
    K: tl.constexpr,  # H
    GP: tl.constexpr,  # G padded (the tile's token extent)
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """[GP, ROWS] bf16: z of tokens window .. window + G - 1, columns task*ROWS .. of this rank's slice."""
    acc = gemv_tile(x_ptr + window * stride_xs, stride_xs, w_ptr, stride_wn, task * ROWS, G, N, K, GP, ROWS, BLOCK_K,
                    USE_DOT, EVEN_K, UPCAST)
    return to_bf16(acc)


@triton.jit
def _latent_down_kernel(
    x_ptr,  # [S, H] bf16
    stride_xs,
    w_ptr,  # [L/T, H] bf16
    stride_wn,
    z_ptr,  # [S, L/T] bf16: a column slice of z [S, L]
    stride_zs,
    S: tl.constexpr,
    G: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    GP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,  # of a part's K
    UPCAST: tl.constexpr,
    PARTS: tl.constexpr,  # parts of K (tl.dot, all S tokens a program)
):
    task = tl.program_id(0)
    window, skip = group_window(tl.program_id(1) * G, S, G)
    if PARTS > 1:
        tile = to_bf16(gemv_parts_tile(x_ptr, stride_xs, w_ptr, stride_wn, task * ROWS, S, N, K // PARTS, GP, ROWS,
                                       BLOCK_K, PARTS, EVEN_K, UPCAST))
    else:
        tile = latent_down_task(task, window, x_ptr, stride_xs, w_ptr, stride_wn, G, N, K, GP, ROWS, BLOCK_K, USE_DOT,
                                EVEN_K, UPCAST)
    store_rows(z_ptr + window * stride_zs, stride_zs, tile, task * ROWS, skip, G, N, GP, ROWS)


def launch_latent_down(x, w, z_out, geom) -> None:
    """z_out [S, L/T] bf16 (a column slice of the [S, L] z; its row stride is
    used) = bf16(x [S, H] bf16 @ w [L/T, H] bf16 .T)."""
    S, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or tuple(z_out.shape) != (S, N) or S != geom.tokens:
        raise ValueError(f"launch_latent_down: x {list(x.shape)}, w {list(w.shape)}, z_out {list(z_out.shape)}")
    for name, t in (("x", x), ("w", w), ("z_out", z_out)):
        check_rows_contiguous(name, t)
    tile = geom.latent_down
    _latent_down_kernel[(num_tasks(N, tile.rows), geom.x_groups)](
        x, x.stride(0), w, w.stride(0), z_out, z_out.stride(0),
        S=S, G=geom.x_group, N=N, K=K, GP=geom.x_group_pad, ROWS=tile.rows, BLOCK_K=tile.block_k,
        USE_DOT=geom.x_group_dot,
        EVEN_K=even_k(K // geom.x_parts, tile.block_k), UPCAST=common.UPCAST_DOT, PARTS=geom.x_parts,
        num_warps=tile.warps,
    )
