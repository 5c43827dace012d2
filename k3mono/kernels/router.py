"""Router logits, split by expert rows: rank r's columns of the AG1 logits.

Shapes: S tokens, H hidden, E experts, T ranks, E/T the rank's experts.

    logits[:, r*E/T : (r+1)*E/T] [S, E/T] fp32 = x [S, H] @ router_r [E/T, H].T   (unrounded)

A task owns ``geom.router.rows`` expert rows of ``geom.x_group`` tokens (all S,
or a group: kernels/gemv.py group_window). The slice is gathered by every rank,
so ``router_task`` returns the register tile; its caller stores it into each
destination's logits columns. The mono launch's single-token tasks may read the
seam's h instead and form x = rms(h, post_attention_layernorm) as their rows
stream (X_RMS; planner.ROUTER_RMS_MAX_TOKENS): the same x. On the tl.dot path
K may be cut into PARTS (planner.X_K_PARTS): the mono launch's tasks then take
a part each (kernels/gemv.py gemv_part) and the tile's last sums them; a staged
program sums the same parts in the same order (gemv_parts_tile).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import common
from .gemv import check_rows_contiguous, even_k, gemv_parts_tile, gemv_tile, group_window, num_tasks, store_rows


@triton.jit
def router_task(
    task,
    window,  # the first x row of the task's G tokens (group_window)
    x_ptr,  # [S, H] bf16
    stride_xs,
    w_ptr,  # [E/T, H] bf16
    stride_wn,
    G: tl.constexpr,  # tokens a task: S, or a group's
    N: tl.constexpr,  # E/T
    K: tl.constexpr,  # H
    GP: tl.constexpr,  # G padded (the tile's token extent)
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    norm_ptr=None,  # [H] bf16: post_attention_layernorm (X_RMS)
    x_scale=1.0,  # fp32: the norm's scale (X_RMS)
    X_RMS: tl.constexpr = False,  # x_ptr holds the seam's h: x formed as the rows stream (one token)
):
    """[GP, ROWS] fp32: logits of tokens window .. window + G - 1 for experts task*ROWS .. of this rank's slice."""
    return gemv_tile(x_ptr + window * stride_xs, stride_xs, w_ptr, stride_wn, task * ROWS, G, N, K, GP, ROWS, BLOCK_K,
                     USE_DOT, EVEN_K, UPCAST, norm_ptr, x_scale, X_RMS)


@triton.jit
def _router_kernel(
    x_ptr,  # [S, H] bf16
    stride_xs,
    w_ptr,  # [E/T, H] bf16
    stride_wn,
    out_ptr,  # [S, E/T] fp32: a column slice of logits [S, E]
    stride_os,
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
        tile = gemv_parts_tile(x_ptr, stride_xs, w_ptr, stride_wn, task * ROWS, S, N, K // PARTS, GP, ROWS, BLOCK_K,
                               PARTS, EVEN_K, UPCAST)
    else:
        tile = router_task(task, window, x_ptr, stride_xs, w_ptr, stride_wn, G, N, K, GP, ROWS, BLOCK_K, USE_DOT,
                           EVEN_K, UPCAST)
    store_rows(out_ptr + window * stride_os, stride_os, tile, task * ROWS, skip, G, N, GP, ROWS)


def launch_router(x, router_r, logits_out, geom) -> None:
    """logits_out [S, E/T] fp32 (a column slice of the [S, E] logits; its row
    stride is used) = x [S, H] bf16 @ router_r [E/T, H] bf16 .T."""
    S, K = x.shape
    N = router_r.shape[0]
    if router_r.shape[1] != K or tuple(logits_out.shape) != (S, N) or S != geom.tokens:
        raise ValueError(f"launch_router: x {list(x.shape)}, router_r {list(router_r.shape)}, out {list(logits_out.shape)}")
    for name, t in (("x", x), ("router_r", router_r), ("logits_out", logits_out)):
        check_rows_contiguous(name, t)
    tile = geom.router
    _router_kernel[(num_tasks(N, tile.rows), geom.x_groups)](
        x, x.stride(0), router_r, router_r.stride(0), logits_out, logits_out.stride(0),
        S=S, G=geom.x_group, N=N, K=K, GP=geom.x_group_pad, ROWS=tile.rows, BLOCK_K=tile.block_k,
        USE_DOT=geom.x_group_dot,
        EVEN_K=even_k(K // geom.x_parts, tile.block_k), UPCAST=common.UPCAST_DOT, PARTS=geom.x_parts,
        num_warps=tile.warps,
    )
