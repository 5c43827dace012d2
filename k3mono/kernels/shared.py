"""Shared experts, gate and up projections (column-parallel), fused with SiTU.

Shapes: S tokens, H hidden, SI shared intermediate, T ranks, SI/T the rank's rows.

    gate = bf16(x [S, H] @ shared_gate_r [SI/T, H].T)
    up   = bf16(x [S, H] @ shared_up_r [SI/T, H].T)
    shared_act [S, SI/T] bf16 = bf16(BETA*tanh(gate/BETA)*sigmoid(gate) * LB*tanh(up/LB))

A task owns ``geom.shared_gate_up.rows`` intermediate rows of both weights (the
activation needs gate and up of the same row). shared_act is rank-local (only
this rank's shared-down reads it), so the task stores it directly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import common
from .common import as_f32, situ, to_bf16
from .gemv import check_rows_contiguous, even_k, gemv_tile, num_tasks, store_rows


@triton.jit
def shared_gate_up_task(
    task,
    x_ptr,  # [S, H] bf16
    stride_xs,
    gate_ptr,  # [SI/T, H] bf16
    stride_gn,
    up_ptr,  # [SI/T, H] bf16
    stride_un,
    act_ptr,  # [S, SI/T] bf16 out
    stride_as,
    S: tl.constexpr,
    N: tl.constexpr,  # SI/T
    K: tl.constexpr,  # H
    BETA: tl.constexpr,
    LINEAR_BETA: tl.constexpr,
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    row0 = task * ROWS
    gate = to_bf16(gemv_tile(x_ptr, stride_xs, gate_ptr, stride_gn, row0, S, N, K, SP, ROWS, BLOCK_K, USE_DOT, EVEN_K,
                             UPCAST))
    up = to_bf16(gemv_tile(x_ptr, stride_xs, up_ptr, stride_un, row0, S, N, K, SP, ROWS, BLOCK_K, USE_DOT, EVEN_K,
                           UPCAST))
    act = to_bf16(situ(as_f32(gate), as_f32(up), BETA, LINEAR_BETA))
    store_rows(act_ptr, stride_as, act, row0, 0, S, N, SP, ROWS)


@triton.jit
def _shared_gate_up_kernel(
    x_ptr,  # [S, H] bf16
    stride_xs,
    gate_ptr,  # [SI/T, H] bf16
    stride_gn,
    up_ptr,  # [SI/T, H] bf16
    stride_un,
    act_ptr,  # [S, SI/T] bf16
    stride_as,
    S: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    BETA: tl.constexpr,
    LINEAR_BETA: tl.constexpr,
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    shared_gate_up_task(
        tl.program_id(0), x_ptr, stride_xs, gate_ptr, stride_gn, up_ptr, stride_un, act_ptr, stride_as, S, N, K,
        BETA, LINEAR_BETA, SP, ROWS, BLOCK_K, USE_DOT, EVEN_K, UPCAST,
    )


def launch_shared_gate_up(x, gate_r, up_r, shared_act, geom, cfg) -> None:
    """shared_act [S, SI/T] bf16 = situ(bf16(x @ gate_r.T), bf16(x @ up_r.T)); x [S, H] bf16,
    gate_r / up_r [SI/T, H] bf16."""
    S, K = x.shape
    N = gate_r.shape[0]
    if tuple(gate_r.shape) != (N, K) or tuple(up_r.shape) != (N, K) or tuple(shared_act.shape) != (S, N) or S != geom.tokens:
        raise ValueError(
            f"launch_shared_gate_up: x {list(x.shape)}, gate_r {list(gate_r.shape)}, up_r {list(up_r.shape)}, "
            f"shared_act {list(shared_act.shape)}"
        )
    for name, t in (("x", x), ("gate_r", gate_r), ("up_r", up_r), ("shared_act", shared_act)):
        check_rows_contiguous(name, t)
    tile = geom.shared_gate_up
    _shared_gate_up_kernel[(num_tasks(N, tile.rows),)](
        x, x.stride(0), gate_r, gate_r.stride(0), up_r, up_r.stride(0), shared_act, shared_act.stride(0),
        S=S, N=N, K=K, BETA=float(cfg.situ_beta), LINEAR_BETA=float(cfg.situ_linear_beta),
        SP=geom.tokens_pad, ROWS=tile.rows, BLOCK_K=tile.block_k, USE_DOT=geom.use_dot,
        EVEN_K=even_k(K, tile.block_k), UPCAST=common.UPCAST_DOT, num_warps=tile.warps,
    )
