"""M1b: the MLA decode back-end: combine the splits, the absorbed V projection, the output gate.

Shapes: S tokens, HEADS this rank's heads, SPLITS (SPLITS_P padded) context
splits of M1c, D_LATENT the latent width (a combine step reads whole rows of o:
PAIRS splits' of one token), D_V the head's value width (v_head_dim: 128 in
Kimi-K3; BLOCK_DV a program); the token's row is padded to TOKEN_ROWS for tl.dot.

Program, or mono task (``mla_back_task``: kernels/mono.py runs it as the M1B
tasks of an MLA layer's launch): (h, block of BLOCK_DV value rows d, token s):

    lse_all = log(sum_k exp(lse[k, s, h]))                 fp32; empty splits (-inf) add 0
    o_c     = bf16(sum_k exp(lse[k, s, h] - lse_all) * o[k, s, h, :])   [D_LATENT]
    y[d]    = o_c . w_v[h, d, :]                           fp32 (fp8 w_v: bf16(fp32(w_v) * w_v_scale))
    core[s, h*D_V + d] = bf16(y[d] * sigmoid(gate[s, h*D_V + d]))

These are reference/mla.py's bf16-mode roundings (the sum over splits in another
association: fp32 rounding of the same terms). A program a token: one for all
S tokens combined their splits one token after another (at S = 16, 32 steps in
a row: the fold cost 59.2 us on an H100, a program a token 33.0 on the same
one; docs/PERF.md, twenty-sixth session), while the token's w_v tile (the one
large read, heads x 128 x 512 bf16, 1.5 MB a rank at TP8) comes from HBM for
the first token's programs and from L2 for the others. D_LATENT and D_V are
powers of two (tl.arange, tl.dot), so nothing needs a mask.
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

TOKEN_ROWS = tl.constexpr(DOT_MIN)  # a program's one token, padded to tl.dot's smallest M


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
    lse_ptr,  # [SPLITS] fp32: the token's lse of one head, stride stride_lk
    stride_lk,
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    """fp32 scalar: log-sum-exp over the splits, the sum a fixed pairwise tree (_ordered_sum)."""
    LEVELS: tl.constexpr = SPLITS_P.bit_length() - 1
    split = tl.arange(0, SPLITS_P)
    lse = tl.load(lse_ptr + split * stride_lk, mask=split < SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)  # finite: split 0 sees position 0; a max has no order
    return top + tl.log(tl.sum(_ordered_sum(tl.exp(lse - top)[:, None], LEVELS), axis=0))


@triton.jit
def _split_weights(
    lse_ptr,  # [SPLITS] fp32: the token's lse of one head, stride stride_lk
    stride_lk,
    SPLITS: tl.constexpr,
):
    """SPLITS fp32 scalars (a tuple): exp(lse[k] - lse_all), with lse_all the
    log-sum-exp of lse. Every thread sums the splits itself, in split order, so
    nothing crosses threads: no barrier holds back a load (_total_lse's
    reductions would), and no layout sets the order."""
    lse = ()
    for k in tl.static_range(SPLITS):
        lse = lse + (tl.load(lse_ptr + k * stride_lk),)
    top = lse[0]
    for k in tl.static_range(1, SPLITS):
        top = tl.maximum(top, lse[k])  # finite: split 0 sees position 0
    total = tl.exp(lse[0] - top)
    for k in tl.static_range(1, SPLITS):
        total += tl.exp(lse[k] - top)
    lse_all = top + tl.log(total)
    weights = ()
    for k in tl.static_range(SPLITS):
        weights = weights + (tl.exp(lse[k] - lse_all),)  # empty splits (lse -inf) weigh 0
    return weights


@triton.jit
def _short_back(
    o_ptr,  # [SPLITS, D_LATENT] fp32: the token's rows of o of one head, stride stride_ok, unit along D_LATENT
    stride_ok,
    lse_ptr,  # [SPLITS] fp32: the token's lse of that head, stride stride_lk
    stride_lk,
    w_ptr,  # [BLOCK_DV, D_LATENT] bf16 or fp8 e4m3: the task's rows of w_v, stride stride_wd, unit along D_LATENT
    stride_wd,
    w_v_scale,  # fp32
    SPLITS: tl.constexpr,
    D_LATENT: tl.constexpr,
    CHUNK: tl.constexpr,  # latent columns a step
    STAGES: tl.constexpr,  # steps in flight
    BLOCK_DV: tl.constexpr,
    W_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """[TOKEN_ROWS, BLOCK_DV] fp32, row 0 the token's y (the others 0): a short
    combine and the dot, CHUNK latent columns a step. A step's loads (every
    split's columns of o, w_v's) are copied to shared memory asynchronously, STAGES
    steps in flight, so none waits for another: loaded into registers, w_v's
    shared-memory copy (the dot's operand) waited for its load first and ptxas
    put the combine's loads behind it. The split weights are worked out inside the
    loop's first step, which the pipeliner places after the copies of the first
    STAGES - 1 steps: before the loop, or as loop-invariant code inside it (Triton
    hoists that), their wait for the lse held those copies back (offline sm_90a
    builds, offline.memory_order)."""
    weights = (0.0,) * SPLITS
    pad = tl.arange(0, TOKEN_ROWS)[:, None]
    dv = tl.arange(0, BLOCK_DV)[:, None]
    y = tl.zeros([TOKEN_ROWS, BLOCK_DV], dtype=tl.float32)
    for step in tl.range(0, D_LATENT // CHUNK, num_stages=STAGES):
        if step == 0:
            weights = _split_weights(lse_ptr, stride_lk, SPLITS)
        lat = step * CHUNK + tl.arange(0, CHUNK)
        row = weights[0] * tl.load(o_ptr + lat)
        for k in tl.static_range(1, SPLITS):
            row += weights[k] * tl.load(o_ptr + k * stride_ok + lat)
        w = tl.load(w_ptr + dv * stride_wd + lat[None, :])
        o_c = to_bf16(tl.where(pad == 0, row[None, :], 0.0))
        y = dot_acc(o_c, tl.trans(dequant_operand(w, w_v_scale, W_FP8)), y, UPCAST)
    return y


@triton.jit
def _weighed_rows(
    first,  # the first of PAIRS splits
    o_ptr,  # [SPLITS, D_LATENT] fp32: the token's rows of o of one head, stride stride_ok, unit along D_LATENT
    stride_ok,
    lse_ptr,  # [SPLITS] fp32: the token's lse of that head, stride stride_lk
    stride_lk,
    lse_all,  # fp32 scalar
    SPLITS: tl.constexpr,
    D_LATENT: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """[D_LATENT] fp32: the rows of o of splits first .. first + PAIRS, weighed by exp(lse - lse_all).
    The rows are added one by one in split order (a sum over a loaded [PAIRS, D_LATENT]
    tile would take the order of its layout, which differs between builds)."""
    lat = tl.arange(0, D_LATENT)
    row = tl.zeros([D_LATENT], dtype=tl.float32)
    for i in tl.static_range(PAIRS):
        live = first + i < SPLITS
        split = tl.minimum(first + i, SPLITS - 1)  # a dead split reads a live address, weighed 0
        lse = tl.load(lse_ptr + split * stride_lk)
        o_row = tl.load(o_ptr + split * stride_ok + lat)
        # empty splits (lse -inf) and dead ones weigh 0
        row += tl.where(live, tl.exp(lse - lse_all), 0.0) * o_row
    return row


@triton.jit
def _combined_row(
    o_ptr,  # [SPLITS, D_LATENT] fp32: the token's rows of o of one head, stride stride_ok, unit along D_LATENT
    stride_ok,
    lse_ptr,  # [SPLITS] fp32: the token's lse of that head, stride stride_lk
    stride_lk,
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    D_LATENT: tl.constexpr,
    PAIRS: tl.constexpr,  # splits a step
    STAGES: tl.constexpr,  # steps in flight
):
    """[D_LATENT] fp32: sum_k exp(lse[k] - lse_all) * o[k, :], a long combine.

    A step reads PAIRS splits' whole rows of o, STAGES steps in flight.
    Reading a split at a time per latent block waited out 8 x 16 loads in a row
    (about 90 us folded into the launch on the H200)."""
    lse_all = _total_lse(lse_ptr, stride_lk, SPLITS, SPLITS_P)
    row = tl.zeros([D_LATENT], dtype=tl.float32)
    # num_stages always given: without it the loads are not pipelined at all
    # (plain LDG in an offline sm_90a build; cp.async with it above 1)
    for step in tl.range(0, triton.cdiv(SPLITS, PAIRS), num_stages=STAGES):
        row += _weighed_rows(step * PAIRS, o_ptr, stride_ok, lse_ptr, stride_lk, lse_all, SPLITS, D_LATENT, PAIRS)
    return row


@triton.jit
def mla_back_task(
    h,  # this rank's head
    dv_block,  # which BLOCK_DV value rows of the head
    s,  # the token
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
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_V: tl.constexpr,
    SHORT_SPLITS: tl.constexpr,  # at most this many splits: the short combine
    CHUNK: tl.constexpr,  # latent columns a short combine's step
    PAIRS: tl.constexpr,  # splits' rows of o a long combine's step
    STAGES: tl.constexpr,  # steps in flight
    BLOCK_DV: tl.constexpr,
    W_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """core[s, h*D_V + dv_block*BLOCK_DV ...] (the module docstring's program).

    A folded M1b is on every o_proj task's path, so its loads must not wait in
    a row. The gate's accumulator-layout copy goes through shared memory right
    after its load, which waits for it: the gate is asked into L2 first and read
    last. A short combine (_short_back) steps over the latent, a long one
    (_combined_row) over the splits with w_v asked into L2 and read after them;
    the two sum lse_all in different orders, and SPLITS alone picks one, so every
    launch of a shape takes the same."""
    o_row = o_ptr + s * stride_os + h * stride_oh
    lse_row = lse_ptr + s * stride_ls + h
    first_col = h * D_V + dv_block * BLOCK_DV
    w_rows = w_v_ptr + h * stride_wh + dv_block * BLOCK_DV * stride_wd
    prefetch_l2(gate_ptr + s * stride_gs + first_col, gate_ptr + s * stride_gs + first_col + BLOCK_DV)
    pad = tl.arange(0, TOKEN_ROWS)[:, None]  # the token is row 0
    if SPLITS <= SHORT_SPLITS:
        y = _short_back(o_row, stride_ok, lse_row, stride_lk, w_rows, stride_wd, w_v_scale, SPLITS, D_LATENT, CHUNK,
                        STAGES, BLOCK_DV, W_FP8, UPCAST)
    else:
        prefetch_l2(w_rows, w_rows + BLOCK_DV * stride_wd)
        row = _combined_row(o_row, stride_ok, lse_row, stride_lk, SPLITS, SPLITS_P, D_LATENT, PAIRS, STAGES)
        w = tl.load(w_rows + tl.arange(0, BLOCK_DV)[:, None] * stride_wd + tl.arange(0, D_LATENT)[None, :])
        o_c = to_bf16(tl.where(pad == 0, row[None, :], 0.0))
        y = dot_acc(o_c, tl.trans(dequant_operand(w, w_v_scale, W_FP8)),
                    tl.zeros([TOKEN_ROWS, BLOCK_DV], dtype=tl.float32), UPCAST)
    cols = first_col + tl.arange(0, BLOCK_DV)[None, :]
    gate = as_f32(tl.load(gate_ptr + (s + pad) * stride_gs + cols, mask=pad == 0, other=0.0))
    tl.store(core_ptr + (s + pad) * stride_cs + cols, to_bf16(y * sigmoid(gate)), mask=pad == 0)


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
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_V: tl.constexpr,
    SHORT_SPLITS: tl.constexpr,  # at most this many splits: the short combine
    CHUNK: tl.constexpr,  # latent columns a short combine's step
    PAIRS: tl.constexpr,  # splits' rows of o a long combine's step
    STAGES: tl.constexpr,  # steps in flight
    BLOCK_DV: tl.constexpr,
    W_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    mla_back_task(tl.program_id(0), tl.program_id(1), tl.program_id(2), o_ptr, stride_ok, stride_os, stride_oh,
                  lse_ptr, stride_lk, stride_ls, w_v_ptr, stride_wh, stride_wd, w_v_scale, gate_ptr, stride_gs,
                  core_ptr, stride_cs, SPLITS, SPLITS_P, D_LATENT, D_V, SHORT_SPLITS, CHUNK, PAIRS, STAGES, BLOCK_DV,
                  W_FP8, UPCAST)


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


def launch_mla_back(o, lse, w_v, gate, core, *, w_v_scale=1.0, short_splits, chunk, pairs, stages, block_dv) -> None:
    """M1b into core [S, heads * DV] bf16. o [splits, S, heads, DL] fp32 and lse
    [splits, S, heads] fp32 from M1c; w_v [heads, DV, DL] bf16 or fp8 e4m3 (w_v_scale);
    gate [S, heads * DV] bf16. At most short_splits splits take the short combine
    (chunk latent columns a step), more the long one (pairs rows of o a step);
    stages: steps in flight; block_dv is capped at DV."""
    check_mla_back_args(o, lse, w_v, gate, core, w_v_scale)
    splits, tokens, heads, latent = o.shape
    value = w_v.shape[1]
    block_dv = min(block_dv, value)
    _mla_back_kernel[(heads, value // block_dv, tokens)](
        o, o.stride(0), o.stride(1), o.stride(2), lse, lse.stride(0), lse.stride(1),
        w_v, w_v.stride(0), w_v.stride(1), float(w_v_scale), gate, gate.stride(0), core, core.stride(0),
        SPLITS=splits, SPLITS_P=next_pow2(splits), D_LATENT=latent, D_V=value, SHORT_SPLITS=short_splits,
        CHUNK=min(chunk, latent), PAIRS=pairs, STAGES=stages, BLOCK_DV=block_dv, W_FP8=w_v.dtype == FP8,
        UPCAST=common.UPCAST_DOT,
    )
