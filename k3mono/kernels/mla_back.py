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
from .common import as_f32, dot_acc, prefetch_l2, sigmoid, to_bf16
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
def _token_splits(
    o_ptr,  # [SPLITS, S, HEADS, D_LATENT] fp32, unit stride along D_LATENT
    stride_ok,
    stride_os,
    stride_oh,
    lse_ptr,  # [SPLITS, S, HEADS] fp32, unit stride along HEADS
    stride_lk,
    stride_ls,
    h,
    s,  # the token
    SPLITS: tl.constexpr,
    D_LATENT: tl.constexpr,
):
    """(lse, rows): token s's SPLITS lse values (fp32 scalars) and rows of o ([D_LATENT]
    fp32), a tuple each, loaded before any is used."""
    lat = tl.arange(0, D_LATENT)
    lse = ()
    rows = ()
    for k in tl.static_range(SPLITS):
        lse = lse + (tl.load(lse_ptr + k * stride_lk + s * stride_ls + h),)
        rows = rows + (tl.load(o_ptr + k * stride_ok + s * stride_os + h * stride_oh + lat),)
    return lse, rows


@triton.jit
def _token_combine(
    lse,  # SPLITS fp32 scalars
    rows,  # SPLITS [D_LATENT] fp32
    SPLITS: tl.constexpr,
):
    """[D_LATENT] fp32: sum_k exp(lse[k] - lse_all) * rows[k], with lse_all the
    log-sum-exp of lse. Every thread sums the splits itself, in split order, so
    nothing crosses threads: no barrier holds back a load (_total_lse's
    reductions would), and no layout sets the order."""
    top = lse[0]
    for k in tl.static_range(1, SPLITS):
        top = tl.maximum(top, lse[k])  # finite: split 0 sees position 0
    total = tl.exp(lse[0] - top)
    for k in tl.static_range(1, SPLITS):
        total += tl.exp(lse[k] - top)
    lse_all = top + tl.log(total)
    row = tl.exp(lse[0] - lse_all) * rows[0]  # empty splits (lse -inf) weigh 0
    for k in tl.static_range(1, SPLITS):
        row += tl.exp(lse[k] - lse_all) * rows[k]
    return row


@triton.jit
def _weighed_rows(
    s,  # the token
    first,  # the first of PAIRS splits
    o_ptr,  # [SPLITS, S, HEADS, D_LATENT] fp32, unit stride along D_LATENT
    stride_ok,
    stride_os,
    stride_oh,
    lse_ptr,  # [SPLITS, S, HEADS] fp32, unit stride along HEADS
    stride_lk,
    stride_ls,
    h,
    top,  # fp32 scalar: lse_all of token s
    SPLITS: tl.constexpr,
    D_LATENT: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """[D_LATENT] fp32: token s's rows of o of splits first .. first + PAIRS, weighed by exp(lse - top).
    The rows are added one by one in split order (a sum over a loaded [PAIRS, D_LATENT]
    tile would take the order of its layout, which differs between builds)."""
    lat = tl.arange(0, D_LATENT)
    row = tl.zeros([D_LATENT], dtype=tl.float32)
    for i in tl.static_range(PAIRS):
        live = first + i < SPLITS
        split = tl.minimum(first + i, SPLITS - 1)  # a dead split reads a live address, weighed 0
        lse = tl.load(lse_ptr + split * stride_lk + s * stride_ls + h)
        o_row = tl.load(o_ptr + split * stride_ok + s * stride_os + h * stride_oh + lat)
        # empty splits (lse -inf) and dead ones weigh 0
        row += tl.where(live, tl.exp(lse - top), 0.0) * o_row
    return row


@triton.jit
def _in_row(
    acc,  # [SP, D_LATENT] fp32
    row,  # [D_LATENT] fp32
    s,  # the token
    SP: tl.constexpr,
):
    """acc + row in token s's row (a layout change through shared memory, and a barrier)."""
    return acc + tl.where((tl.arange(0, SP) == s)[:, None], row[None, :], 0.0)


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
    S: tl.constexpr,
    SP: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    D_LATENT: tl.constexpr,
    PAIRS: tl.constexpr,  # splits a step
    STAGES: tl.constexpr,  # steps in flight
):
    """[SP, D_LATENT] fp32: sum_k exp(lse[k, s, h] - lse_all[s]) * o[k, s, h, :] (0 for padded tokens).

    A step reads PAIRS splits' whole rows of o for one token, and the steps
    (token, block of splits) are one loop, STAGES of them in flight.
    Reading a split at a time per latent block waited out 8 x 16 loads in a row
    (about 90 us folded into the launch on the H200)."""
    CHUNKS: tl.constexpr = triton.cdiv(SPLITS, PAIRS)
    tok = tl.arange(0, SP)
    acc = tl.zeros([SP, D_LATENT], dtype=tl.float32)
    lse_all = _total_lse(lse_ptr, stride_lk, stride_ls, h, S, SP, SPLITS, SPLITS_P)
    # num_stages always given: without it the loads are not pipelined at all
    # (plain LDG in an offline sm_90a build; cp.async with it above 1)
    for step in tl.range(0, S * CHUNKS, num_stages=STAGES):
        s = step // CHUNKS
        top = tl.sum(tl.where(tok == s, lse_all, 0.0), axis=0)  # one live term: exact in any order
        row = _weighed_rows(s, (step % CHUNKS) * PAIRS, o_ptr, stride_ok, stride_os, stride_oh, lse_ptr, stride_lk,
                            stride_ls, h, top, SPLITS, D_LATENT, PAIRS)
        acc = _in_row(acc, row, s, SP)
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
    w_rows = w_v_ptr + h * stride_wh + dv_block * BLOCK_DV * stride_wd
    w_tile = w_rows + tl.arange(0, BLOCK_DV)[:, None] * stride_wd + tl.arange(0, D_LATENT)[None, :]
    # A folded M1b is on every o_proj task's path, so its loads must not wait
    # in a row; but the dot's operand (w_v) and the accumulator-layout copy of
    # the gate each go through shared memory right after their load, which waits
    # for it. So the gate is asked into L2 first and read last, and w_v is read
    # after every load of a short combine has issued (so the three wait at once),
    # or asked into L2 too and read after a long combine.
    for s in tl.static_range(S):
        gate_row = gate_ptr + s * stride_gs + h * D_V + dv_block * BLOCK_DV
        prefetch_l2(gate_row, gate_row + BLOCK_DV)
    if STAGES == 1:
        acc = tl.zeros([SP, D_LATENT], dtype=tl.float32)
        loaded = ()
        for s in tl.static_range(S):
            loaded = loaded + (_token_splits(o_ptr, stride_ok, stride_os, stride_oh, lse_ptr, stride_lk, stride_ls,
                                             h, s, SPLITS, D_LATENT),)
        # ptxas would hoist w_v's loads (their shared-memory copy comes first)
        # above the combine's and wait for them first: the barrier waits for no
        # load, but nothing moves across it
        tl.debug_barrier()
        w = tl.load(w_tile)
        for s in tl.static_range(S):
            acc = _in_row(acc, _token_combine(loaded[s][0], loaded[s][1], SPLITS), s, SP)
    else:
        prefetch_l2(w_rows, w_rows + BLOCK_DV * stride_wd)
        acc = _combined_rows(o_ptr, stride_ok, stride_os, stride_oh, lse_ptr, stride_lk, stride_ls, h, S, SP,
                             SPLITS, SPLITS_P, D_LATENT, PAIRS, STAGES)
        w = tl.load(w_tile)
    y = dot_acc(to_bf16(acc), tl.trans(dequant_operand(w, w_v_scale, W_FP8)),
                tl.zeros([SP, BLOCK_DV], dtype=tl.float32), UPCAST)
    gate = as_f32(tl.load(gate_ptr + tok[:, None] * stride_gs + cols[None, :], mask=live[:, None], other=0.0))
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
