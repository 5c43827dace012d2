"""o_proj, row-parallel: rank r's partial of o (the AR1 operand).

Shapes: S tokens, H hidden, C core width, T ranks, C/T the rank's heads.

    partial [S, H] fp32 = core_r [S, C/T] @ w_o_r [H, C/T].T      (unrounded)

A task owns ``geom.oproj.rows`` output rows (H / rows tasks). The partial is
pushed to every rank's ar1 slot r, so ``oproj_task`` returns the register tile
and its caller stores it (the staged kernel into the rank's own slot; the mono
launch into each peer's).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import common
from .gemv import check_rows_contiguous, even_k, gemv_tile, num_tasks, store_rows


@triton.jit
def oproj_task(
    task,
    core_ptr,  # [S, C/T] bf16, row stride stride_cs
    stride_cs,
    w_ptr,  # [H, C/T] bf16, row stride stride_wn
    stride_wn,
    S: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,  # C/T
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """[SP, ROWS] fp32: the partial's rows task*ROWS .. (store with store_rows)."""
    return gemv_tile(core_ptr, stride_cs, w_ptr, stride_wn, task * ROWS, S, H, K, SP, ROWS, BLOCK_K, USE_DOT, EVEN_K,
                     UPCAST)


@triton.jit
def _oproj_kernel(
    core_ptr,  # [S, C/T] bf16
    stride_cs,
    w_ptr,  # [H, C/T] bf16
    stride_wn,
    out_ptr,  # [S, H] fp32: ar1[rank]
    stride_os,
    S: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    task = tl.program_id(0)
    tile = oproj_task(task, core_ptr, stride_cs, w_ptr, stride_wn, S, H, K, SP, ROWS, BLOCK_K, USE_DOT, EVEN_K, UPCAST)
    store_rows(out_ptr, stride_os, tile, task * ROWS, 0, S, H, SP, ROWS)


def launch_oproj(core_r, w_o, partial_out, geom) -> None:
    """partial_out [S, H] fp32 = core_r [S, C/T] bf16 @ w_o [H, C/T] bf16 .T.

    ``core_r`` may be a column slice of the whole core (its row stride is used).
    """
    S, K = core_r.shape
    H = w_o.shape[0]
    if w_o.shape[1] != K or tuple(partial_out.shape) != (S, H) or S != geom.tokens:
        raise ValueError(f"launch_oproj: core_r {list(core_r.shape)}, w_o {list(w_o.shape)}, out {list(partial_out.shape)}")
    for name, t in (("core_r", core_r), ("w_o", w_o), ("partial_out", partial_out)):
        check_rows_contiguous(name, t)
    tile = geom.oproj
    _oproj_kernel[(num_tasks(H, tile.rows),)](
        core_r, core_r.stride(0), w_o, w_o.stride(0), partial_out, partial_out.stride(0),
        S=S, H=H, K=K, SP=geom.tokens_pad, ROWS=tile.rows, BLOCK_K=tile.block_k, USE_DOT=geom.use_dot,
        EVEN_K=even_k(K, tile.block_k), UPCAST=common.UPCAST_DOT, num_warps=tile.warps,
    )
