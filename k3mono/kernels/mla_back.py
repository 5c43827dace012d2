"""M1b: the MLA decode back-end: combine the splits, the absorbed V projection, the output gate.

Shapes: S tokens (SP: padded to a power of two, at least 16 for tl.dot),
HEADS this rank's heads, SPLITS (SPLITS_P padded) context splits of M1c,
D_LATENT the latent width (a combine step reads whole rows of o: PAIRS splits'
of one token), D_V the head's value width (v_head_dim: 128 in Kimi-K3; BLOCK_DV
a program).

Program, or mono task (``mla_back_task``: kernels/mono.py runs it as the M1B
tasks of an MLA layer's launch): (h, block of BLOCK_DV value rows d), for
every token s at once:

    lse_all[s] = log(sum_k exp(lse[k, s, h]))                fp32; empty splits (-inf) add 0
    o_c[s]     = bf16(sum_k exp(lse[k, s, h] - lse_all[s]) * o[k, s, h, :])   [D_LATENT]
    y[s, d]    = o_c[s] . w_v[h, d, :]                        fp32 (fp8 w_v: bf16(fp32(w_v) * w_v_scale))
    core[s, h*D_V + d] = bf16(y[s, d] * sigmoid(gate[s, h*D_V + d]))

These are reference/mla.py's bf16-mode roundings (the sum over splits in another
association: fp32 rounding of the same terms). All tokens share a
program so each w_v tile is read once for the launch (w_v is the one large
read of this stage: heads x 128 x 512 bf16, 1.5 MB a rank at TP8); the
split outputs o are small and come from L2. D_LATENT and D_V are powers of
two (tl.arange, tl.dot), so only the tokens need a mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import K3InputError, check_same_device, check_unit_stride, expect_tensor
from ..planner import next_pow2
from . import common
from .common import as_f32, dot_acc, sigmoid, to_bf16
from .mla_attn import (
    DOT_MIN,
    FP8,
    check_operand_scale,
    check_width,
    dequant_operand,
    shape_text,
)


@triton.jit
def _ordered_sum(x, LEVELS: tl.constexpr):
    """x [2^LEVELS, N] -> [N]: the sum over dim 0 as a fixed pairwise tree (rows 2i and
    2i + 1 first). tl.sum's order follows the layout the compiler gives x, which a
    kernel and the mono launch choose differently; this order is the same in both,
    so a folded M1b gives the separate launch's bits."""
    for _ in tl.static_range(LEVELS):
        even, odd = tl.split(tl.permute(tl.reshape(x, [x.shape[0] // 2, 2, x.shape[1]]), [0, 2, 1]))
        x = even + odd
    return tl.reshape(x, [x.shape[1]])


@triton.jit
def _total_lse(
    lse_ptr,  # [SPLITS, S, HEADS] fp32, unit stride along HEADS
    stride_lk,
    stride_ls,
    h,
    S: tl.constexpr,
    SP: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    """[SP] fp32: log-sum-exp over the splits of each token (0 for padded tokens)."""
    LEVELS: tl.constexpr = SPLITS_P.bit_length() - 1
    split = tl.arange(0, SPLITS_P)
    tok = tl.arange(0, SP)
    mask = (split < SPLITS)[:, None] & (tok < S)[None, :]
    lse = tl.load(lse_ptr + split[:, None] * stride_lk + tok[None, :] * stride_ls + h, mask=mask, other=0.0)
    lse = tl.where((split < SPLITS)[:, None], lse, float("-inf"))
    top = tl.max(lse, axis=0)  # finite: every token sees position 0, in split 0; a max has no order
    return top + tl.log(_ordered_sum(tl.exp(lse - top[None, :]), LEVELS))


@triton.jit
def _combine_step(
    acc,  # [SP, D_LATENT] fp32
    step,  # (token, block of PAIRS splits), token-major
    o_ptr,  # [SPLITS, S, HEADS, D_LATENT] fp32, unit stride along D_LATENT
    stride_ok,
    stride_os,
    stride_oh,
    lse_ptr,  # [SPLITS, S, HEADS] fp32, unit stride along HEADS
    stride_lk,
    stride_ls,
    h,
    lse_all,  # [SP] fp32
    SP: tl.constexpr,
    SPLITS: tl.constexpr,
    D_LATENT: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """acc + one token's PAIRS splits' rows of o, weighed by exp(lse - lse_all), in that token's row.
    The rows are added one by one in split order (a sum over a loaded [PAIRS, D_LATENT]
    tile would take the order of its layout, which differs between builds)."""
    CHUNKS: tl.constexpr = triton.cdiv(SPLITS, PAIRS)
    tok = tl.arange(0, SP)
    lat = tl.arange(0, D_LATENT)
    s = step // CHUNKS
    first = (step % CHUNKS) * PAIRS
    top = tl.sum(tl.where(tok == s, lse_all, 0.0), axis=0)  # lse_all[s]: one live term, exact in any order
    row = tl.zeros([D_LATENT], dtype=tl.float32)
    for i in tl.static_range(PAIRS):
        live = first + i < SPLITS
        split = tl.minimum(first + i, SPLITS - 1)  # a dead split reads a live address, weighed 0
        lse = tl.load(lse_ptr + split * stride_lk + s * stride_ls + h)
        o_row = tl.load(o_ptr + split * stride_ok + s * stride_os + h * stride_oh + lat)
        # empty splits (lse -inf) and dead ones weigh 0
        row += tl.where(live, tl.exp(lse - top), 0.0) * o_row
    return acc + tl.where((tok == s)[:, None], row[None, :], 0.0)


@triton.jit
def _combined_rows(
    o_ptr,  # [SPLITS, S, HEADS, D_LATENT] fp32, unit stride along D_LATENT
    stride_ok,
    stride_os,
    stride_oh,
    lse_ptr,  # [SPLITS, S, HEADS] fp32, unit stride along HEADS
    stride_lk,
    stride_ls,
    h,
    lse_all,  # [SP] fp32
    S: tl.constexpr,
    SP: tl.constexpr,
    SPLITS: tl.constexpr,
    D_LATENT: tl.constexpr,
    PAIRS: tl.constexpr,  # splits a step
    STAGES: tl.constexpr,  # steps in flight; 1: a short combine, unrolled
):
    """[SP, D_LATENT] fp32: sum_k exp(lse[k, s, h] - lse_all[s]) * o[k, s, h, :] (0 for padded tokens).

    A step reads PAIRS splits' whole rows of o for one token, and the steps
    (token, block of splits) are one loop, STAGES of them in flight.
    Reading a split at a time per latent block waited out 8 x 16 loads in a row
    (about 90 us folded into the launch on the H200). A short combine (STAGES
    1, planner.FOLD_UNPIPELINED_STEPS) is straight-line code, so its loads
    issue together instead of one after the other's use."""
    CHUNKS: tl.constexpr = triton.cdiv(SPLITS, PAIRS)
    acc = tl.zeros([SP, D_LATENT], dtype=tl.float32)
    if STAGES == 1:
        for step in tl.static_range(S * CHUNKS):
            acc = _combine_step(acc, step, o_ptr, stride_ok, stride_os, stride_oh, lse_ptr, stride_lk, stride_ls,
                                h, lse_all, SP, SPLITS, D_LATENT, PAIRS)
    else:
        # num_stages always given: without it the loads are not pipelined at all
        # (plain LDG in an offline sm_90a build; cp.async with it above 1)
        for step in tl.range(0, S * CHUNKS, num_stages=STAGES):
            acc = _combine_step(acc, step, o_ptr, stride_ok, stride_os, stride_oh, lse_ptr, stride_lk, stride_ls,
                                h, lse_all, SP, SPLITS, D_LATENT, PAIRS)
    return acc


@triton.jit
def mla_back_task(
    h,  # this rank's head
    dv_block,  # which BLOCK_DV value rows of the head
    o_ptr,  # [SPLITS, S, HEADS, D_LATENT] fp32, unit stride along D_LATENT
    stride_ok,
    stride_os,
    stride_oh,
    lse_ptr,  # [SPLITS, S, HEADS] fp32, unit stride along HEADS
    stride_lk,
    stride_ls,
    w_v_ptr,  # [HEADS, D_V, D_LATENT] bf16 or fp8 e4m3, unit stride along D_LATENT
    stride_wh,
    stride_wd,
    w_v_scale,  # fp32: fp8 dequantisation scale (1.0 for bf16)
    gate_ptr,  # [S, HEADS * D_V] bf16 output-gate logits, head-major, unit column stride
    stride_gs,
    core_ptr,  # [S, HEADS * D_V] bf16 out, unit column stride
    stride_cs,
    S: tl.constexpr,
    SP: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_V: tl.constexpr,
    PAIRS: tl.constexpr,  # splits' rows of o (one token) a combine step
    STAGES: tl.constexpr,  # combine steps in flight
    BLOCK_DV: tl.constexpr,
    W_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """core[:, h*D_V + dv_block*BLOCK_DV ...] for all S tokens (the module docstring's program)."""
    rows = dv_block * BLOCK_DV + tl.arange(0, BLOCK_DV)
    tok = tl.arange(0, SP)
    live = tok < S

    cols = h * D_V + rows
    # w_v and the gate do not wait on the combine: loaded first, their latency
    # hides behind its (a folded M1b is on every o_proj task's path).
    w = tl.load(w_v_ptr + h * stride_wh + rows[:, None] * stride_wd + tl.arange(0, D_LATENT)[None, :])
    gate = as_f32(tl.load(gate_ptr + tok[:, None] * stride_gs + cols[None, :], mask=live[:, None], other=0.0))
    lse_all = _total_lse(lse_ptr, stride_lk, stride_ls, h, S, SP, SPLITS, SPLITS_P)
    o_c = to_bf16(_combined_rows(o_ptr, stride_ok, stride_os, stride_oh, lse_ptr, stride_lk, stride_ls,
                                 h, lse_all, S, SP, SPLITS, D_LATENT, PAIRS, STAGES))
    y = dot_acc(o_c, tl.trans(dequant_operand(w, w_v_scale, W_FP8)), tl.zeros([SP, BLOCK_DV], dtype=tl.float32),
                UPCAST)
    tl.store(core_ptr + tok[:, None] * stride_cs + cols[None, :], to_bf16(y * sigmoid(gate)), mask=live[:, None])


@triton.jit
def _mla_back_kernel(
    o_ptr,  # [SPLITS, S, HEADS, D_LATENT] fp32
    stride_ok,
    stride_os,
    stride_oh,
    lse_ptr,  # [SPLITS, S, HEADS] fp32
    stride_lk,
    stride_ls,
    w_v_ptr,  # [HEADS, D_V, D_LATENT] bf16 or fp8 e4m3
    stride_wh,
    stride_wd,
    w_v_scale,  # fp32
    gate_ptr,  # [S, HEADS * D_V] bf16
    stride_gs,
    core_ptr,  # [S, HEADS * D_V] bf16 out
    stride_cs,
    S: tl.constexpr,
    SP: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_V: tl.constexpr,
    PAIRS: tl.constexpr,  # splits' rows of o (one token) a combine step
    STAGES: tl.constexpr,  # combine steps in flight
    BLOCK_DV: tl.constexpr,
    W_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    mla_back_task(tl.program_id(0), tl.program_id(1), o_ptr, stride_ok, stride_os, stride_oh, lse_ptr, stride_lk,
                  stride_ls, w_v_ptr, stride_wh, stride_wd, w_v_scale, gate_ptr, stride_gs, core_ptr, stride_cs,
                  S, SP, SPLITS, SPLITS_P, D_LATENT, D_V, PAIRS, STAGES, BLOCK_DV, W_FP8, UPCAST)


def check_w_v(w_v) -> tuple[int, int, int]:
    """(heads, DV, DL) of a bf16 or fp8 w_v [heads, DV, DL]."""
    if not isinstance(w_v, torch.Tensor) or w_v.dim() != 3:
        raise K3InputError(f"w_v: expected shape [heads, DV, DL], got {shape_text(w_v)}")
    if w_v.dtype not in (torch.bfloat16, FP8):
        raise K3InputError(f"w_v: expected dtype torch.bfloat16 or {FP8}, got {w_v.dtype}")
    return tuple(w_v.shape)


def check_mla_back_args(o, lse, w_v, gate, core, w_v_scale) -> None:
    """Shapes, dtypes, strides and devices of M1b's tensors."""
    if not isinstance(o, torch.Tensor) or o.dim() != 4:
        raise K3InputError(f"o: expected shape [splits, S, heads, DL], got {shape_text(o)}")
    splits, tokens, heads, latent = o.shape
    expect_tensor("o", o, (splits, tokens, heads, latent), torch.float32)
    expect_tensor("lse", lse, (splits, tokens, heads), torch.float32)
    if check_w_v(w_v) != (heads, w_v.shape[1], latent):
        raise K3InputError(f"w_v: expected shape [{heads}, DV, {latent}], got {shape_text(w_v)}")
    check_operand_scale("w_v", w_v, w_v_scale)
    value = w_v.shape[1]
    check_width("o", "DL (the latent width)", latent)
    check_width("w_v", "DV (the value width)", value)
    expect_tensor("gate", gate, (tokens, heads * value), torch.bfloat16)
    expect_tensor("core", core, (tokens, heads * value), torch.bfloat16)
    named = (("o", o), ("lse", lse), ("w_v", w_v), ("gate", gate), ("core", core))
    check_unit_stride(*named)
    check_same_device(*named)


def launch_mla_back(o, lse, w_v, gate, core, *, w_v_scale=1.0, pairs, stages, block_dv) -> None:
    """M1b into core [S, heads * DV] bf16. o [splits, S, heads, DL] fp32 and lse
    [splits, S, heads] fp32 from M1c; w_v [heads, DV, DL] bf16 or fp8 e4m3 (w_v_scale);
    gate [S, heads * DV] bf16. pairs: rows of o a combine step, stages: steps in flight;
    block_dv is capped at DV."""
    check_mla_back_args(o, lse, w_v, gate, core, w_v_scale)
    splits, tokens, heads, latent = o.shape
    value = w_v.shape[1]
    block_dv = min(block_dv, value)
    _mla_back_kernel[(heads, value // block_dv)](
        o, o.stride(0), o.stride(1), o.stride(2), lse, lse.stride(0), lse.stride(1),
        w_v, w_v.stride(0), w_v.stride(1), float(w_v_scale), gate, gate.stride(0), core, core.stride(0),
        S=tokens, SP=max(DOT_MIN, next_pow2(tokens)), SPLITS=splits, SPLITS_P=next_pow2(splits),
        D_LATENT=latent, D_V=value, PAIRS=pairs, STAGES=stages, BLOCK_DV=block_dv,
        W_FP8=w_v.dtype == FP8, UPCAST=common.UPCAST_DOT,
    )
