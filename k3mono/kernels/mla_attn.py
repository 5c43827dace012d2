"""M1c: absorbed MLA decode attention over a paged latent KV cache, split along the context.

Shapes: S query tokens, B requests (BP: B rounded up to a power of two),
HEADS this rank's heads (BLOCK_H a program), SPLITS chunks of each request's
context, PAGE_SIZE cache rows a page, D_LATENT latent dims (the value width
too) and D_ROPE positional dims after them (DQK = D_LATENT + D_ROPE, 576 in
Kimi-K3), BLOCK_N context positions a step.

Program, or mono task (``mla_attn_task``: kernels/mono.py runs it as the
M1C tasks of an MLA layer's launch): (s, k, head block); b the request of
token s, j = s - qsl[b] its place among the request's n query tokens,
L = seq_lens[b]:

    lo = k * ceil(L / SPLITS),  hi = min(lo + ceil(L / SPLITS), L - n + j + 1)   causal end
    score[h, t] = scale * (q[s, h, :] . kv[t, :])             t in lo .. hi - 1, all DQK dims
    online softmax over BLOCK_N positions a step, m the running max:
        m' = max(m, max_t score);  p = bf16(exp(score - m'))
        l  = l * exp(m - m') + sum_t p;  acc = acc * exp(m - m') + p @ kv[t, :D_LATENT]
    o[k, s, h] = acc / l;  lse[k, s, h] = m + log(l)              fp32; 0 and -inf if hi <= lo

Position t of request b is row t % PAGE_SIZE of page pages[indptr[b] + t // PAGE_SIZE].
The numerics are reference/mla.py's bf16 mode for a bf16 cache: q, kv and p
are the dots' bf16 operands, everything else fp32. p is rounded against the
running max, the reference's against the split's max: other last bits, the
same size of error. An fp8 (e4m3) cache is not dequantised per element: every
e4m3 value is exactly an fp16, so the dots take the cache tile converted to
fp16 (no multiply or rounding a value), q as fp16(q * kv_scale) once a task and p
as fp16, and o is scaled by kv_scale at the end. That is the same function
with fewer roundings than the reference's bf16(fp32(kv) * kv_scale) per
element (within its error budget, closer to the oracle); the fp32 multiply
and bf16 round per cache element it replaces made an fp8 cache slower than a
bf16 one of twice the bytes (docs/PERF.md). It needs |q| * kv_scale below
fp16's 65504 (latent queries are O(1) to O(100) and kv_scale is amax / 448).

The latent dims are taken in two halves, each its own pair of dots (score
sums both; acc_a and acc_b are o's columns of each half), and the rope dims
in two halves the same way (two more score dots), columns FIRST + ... of
width WIDTH (the latent: 0 and D_LATENT, the rope: D_LATENT and D_ROPE):

    bf16 cache: half 0 columns FIRST + c, half 1 columns FIRST + WIDTH / 2 + c
    fp8 cache:  half 0 columns FIRST + 2c, half 1 columns FIRST + 2c + 1     c < WIDTH / 2

An fp8 cache's columns are read as uint16 pairs of e4m3 codes and each pair
converted in registers to two fp16 (common.e4m3_pairs_to_fp16), so the tile a
dot reads from shared memory has 16-bit elements: ldmatrix moves those,
transposed for P @ V too. Read as bytes, the tile reached the mma fragments by
8-bit shared loads (no ldmatrix transposes 8-bit data): 228 of them a step, and
the fp8 cache streamed at 31 to 43 % of the copy (docs/PERF.md). The rope read
as bytes took 8-bit shared loads too (offline sm_90a, S = 16: 786 instructions
a step against 763 in halves). Both widths are thus at least two dots' K
(HALVES_MIN).

A program owns one query token, so a request's n query tokens read its cache
n times; in exchange the grid (S, SPLITS, head blocks) is fixed for a given
batch shape and needs no host read of the lengths. The heads of one token
share every cache row (absorbed MLA), so they are the M dim of both dots:
at TP8 a rank's 12 heads fit one BLOCK_H of 16 and each row is read once.
D_LATENT and D_ROPE are powers of two (tl.arange), so no dim needs a mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import MAX_TOKENS
from ..errors import K3InputError, check_same_device, check_unit_stride, expect_tensor
from ..planner import next_pow2
from . import common
from .common import RANGE_BY_WHILE, as_f32, dot_acc, e4m3_pairs_to_fp16, to_bf16

FP8 = torch.float8_e4m3fn
DOT_MIN = 16  # tl.dot's smallest M, N and K
HALVES_MIN = 2 * DOT_MIN  # the latent and rope widths: two halves, each a dot's K


@triton.jit
def dequant_operand(x, scale, FP8_IN: tl.constexpr):
    """The bf16 dot operand of a loaded tile: bf16(fp32(x) * scale) for fp8, x itself for bf16."""
    if FP8_IN:
        return to_bf16(x.to(tl.float32) * scale)
    else:
        return x


@triton.jit
def _cache_operand(tile, KV_FP8: tl.constexpr):
    """A cache tile as a dot operand: e4m3 exactly as fp16 (the scale is q's and o's), bf16 as it is."""
    if KV_FP8:
        return tile.to(tl.float16)
    else:
        return tile


@triton.jit
def _query_operand(q, kv_scale, KV_FP8: tl.constexpr):
    """q [BLOCK_H, D] bf16 as the score dot's operand: fp16(q * kv_scale) against an fp8 cache."""
    if KV_FP8:
        return (as_f32(q) * kv_scale).to(tl.float16)
    else:
        return q


@triton.jit
def _weight_operand(p, KV_FP8: tl.constexpr):
    """Softmax weights (fp32) as the P @ V dot's operand: the cache operand's type."""
    if KV_FP8:
        return p.to(tl.float16)
    else:
        return to_bf16(p)


@triton.jit
def _pick(
    values,  # [BP] int32: one value a request
    requests,  # [BP] int32: tl.arange(0, BP)
    b,  # the request
):
    """values[b], picked in registers."""
    return tl.sum(tl.where(requests == b, values, 0), axis=0)


@triton.jit
def _split_range(
    s,
    k,
    qsl_ptr,  # [B + 1] int32: query start offsets
    seq_lens_ptr,  # [B] int32
    indptr_ptr,  # [B + 1] int32: each request's first slot in pages
    SPLITS: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
):
    """(lo, hi, first_slot): the positions of split k that token s sees (empty if hi <= lo) and
    indptr[b] of its request b, the number of requests that end at or before s.

    Every request's offsets, lengths and first slots are loaded at once and b's
    picked in registers: the first page id then waits one memory round trip, not
    the two that finding b and then loading b's values took."""
    requests = tl.arange(0, BP)
    real = requests < B
    starts = tl.load(qsl_ptr + requests, mask=real, other=0)
    ends = tl.load(qsl_ptr + 1 + requests, mask=real, other=0)
    lens = tl.load(seq_lens_ptr + requests, mask=real, other=0)
    slots = tl.load(indptr_ptr + requests, mask=real, other=0)
    b = tl.sum(((ends <= s) & real).to(tl.int32), axis=0)
    first = _pick(starts, requests, b)
    queries = _pick(ends, requests, b) - first
    seq_len = _pick(lens, requests, b)
    chunk = tl.cdiv(seq_len, SPLITS)
    lo = k * chunk
    return lo, tl.minimum(lo + chunk, seq_len - queries + (s - first) + 1), _pick(slots, requests, b)


@triton.jit
def _page_pair(
    pos0,  # a step's first context position
    hi,  # the split's end
    pages_ptr,  # [num_slots] int32: page ids
    first_slot,  # indptr[b]
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """(near, far): the page ids of the step at pos0, its first position's and its last live
    one's (the same page within one), loaded a step ahead of the step (mla_attn_task's loop).

    A page of at least BLOCK_N rows leaves a step at most two pages, so two
    scalar loads name them and every position picks one by arithmetic
    (_step_pages). pos0 is clamped to the split's last position (hi >= 1 for
    every request check_requests admits), so the step after the last one, and an
    empty split's, load live ids: unmasked, as the pipeliner issues them early.
    Smaller pages: (0, 0), each step loading its positions' ids itself."""
    if PAGE_SIZE >= BLOCK_N:
        last_pos = tl.maximum(hi, 1) - 1
        start = tl.minimum(pos0, last_pos)
        near = tl.load(pages_ptr + first_slot + start // PAGE_SIZE)
        far = tl.load(pages_ptr + first_slot + tl.minimum(start + BLOCK_N - 1, last_pos) // PAGE_SIZE)
        return near, far
    else:
        return tl.zeros([], dtype=tl.int32), tl.zeros([], dtype=tl.int32)


@triton.jit
def _step_pages(
    pos0,  # the step's first context position
    hi,  # the split's end (pos0 < hi)
    near,  # _page_pair of pos0
    far,
    pages_ptr,  # [num_slots] int32: page ids
    first_slot,  # indptr[b]
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """[BLOCK_N] page ids of positions pos0 .. pos0 + BLOCK_N - 1 (past hi: one of the request's
    pages, or 0; the loads mask those rows).

    Picked by arithmetic from the step's two ids, which the compiler repeats in
    each layout the step's loads take. One load a position made a [BLOCK_N]
    vector that went through shared memory to each of those layouts (a store, a
    barrier and loads every step; offline sm_90a)."""
    pos = pos0 + tl.arange(0, BLOCK_N)
    if PAGE_SIZE >= BLOCK_N:
        return tl.where(pos // PAGE_SIZE == pos0 // PAGE_SIZE, near, far)
    else:
        return tl.load(pages_ptr + first_slot + pos // PAGE_SIZE, mask=pos < hi, other=0)


@triton.jit
def _cache_rows(
    pos0,  # the step's first context position
    hi,  # the split's end (pos0 < hi)
    near,  # _page_pair of pos0
    far,
    kv_ptr,  # [num_pages, PAGE_SIZE, DQK] bf16 or fp8
    stride_kvp,
    stride_kvr,
    pages_ptr,  # [num_slots] int32: page ids
    first_slot,  # indptr[b]
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """[BLOCK_N] pointers to the cache rows of positions pos0 .. pos0 + BLOCK_N - 1 (64-bit: a
    cache may pass 2^31 bytes); rows past hi point at a live page, and the loads mask them."""
    pos = pos0 + tl.arange(0, BLOCK_N)
    page = _step_pages(pos0, hi, near, far, pages_ptr, first_slot, BLOCK_N, PAGE_SIZE)
    return kv_ptr + page.to(tl.int64) * stride_kvp + (pos % PAGE_SIZE) * stride_kvr


@triton.jit
def _load_cols(
    row_ptrs,  # [BLOCK_N] pointers to cache rows
    live,  # [BLOCK_N]
    cols,  # [D] column offsets
    KV_FP8: tl.constexpr,
):
    """[BLOCK_N, D] cache tile as a dot operand (_cache_operand); rows past the range are 0."""
    return _cache_operand(tl.load(row_ptrs[:, None] + cols[None, :], mask=live[:, None], other=0.0), KV_FP8)


@triton.jit
def _half_cols(
    part,  # 0 or 1
    FIRST: tl.constexpr,  # the columns' first (0: the latent, D_LATENT: the rope)
    WIDTH: tl.constexpr,  # and their count (D_LATENT or D_ROPE)
    KV_FP8: tl.constexpr,
):
    """[WIDTH / 2] columns of half ``part`` of columns FIRST .. FIRST + WIDTH - 1 (the module docstring's table)."""
    c = tl.arange(0, WIDTH // 2)
    if KV_FP8:
        return FIRST + 2 * c + part
    else:
        return FIRST + part * (WIDTH // 2) + c


@triton.jit
def _cache_halves(
    row_ptrs,  # [BLOCK_N] pointers to cache rows
    live,  # [BLOCK_N]
    FIRST: tl.constexpr,
    WIDTH: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """([BLOCK_N, WIDTH / 2] half 0, half 1) of the cache rows' columns FIRST .. FIRST + WIDTH - 1
    as dot operands; rows past the range are 0."""
    if KV_FP8:
        pairs = FIRST // 2 + tl.arange(0, WIDTH // 2)
        pair_rows = row_ptrs.to(tl.pointer_type(tl.uint16))  # a row starts at an even byte (launch_mla_attn)
        return e4m3_pairs_to_fp16(tl.load(pair_rows[:, None] + pairs[None, :], mask=live[:, None], other=0))
    else:
        return (_load_cols(row_ptrs, live, _half_cols(0, FIRST, WIDTH, False), False),
                _load_cols(row_ptrs, live, _half_cols(1, FIRST, WIDTH, False), False))


@triton.jit
def _query_halves(
    q_rows,  # [BLOCK_H, 1] pointers to q's rows of the heads
    live_h,  # [BLOCK_H, 1]
    kv_scale,
    FIRST: tl.constexpr,
    WIDTH: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """([BLOCK_H, WIDTH / 2] half 0, half 1) of q's columns FIRST .. FIRST + WIDTH - 1 as the
    score dot's operands (_query_operand), the halves _cache_halves takes."""
    half_a = tl.load(q_rows + _half_cols(0, FIRST, WIDTH, KV_FP8)[None, :], mask=live_h, other=0.0)
    half_b = tl.load(q_rows + _half_cols(1, FIRST, WIDTH, KV_FP8)[None, :], mask=live_h, other=0.0)
    return _query_operand(half_a, kv_scale, KV_FP8), _query_operand(half_b, kv_scale, KV_FP8)


@triton.jit
def _attend_step(
    pos0,  # the step's first context position
    hi,  # the split's end
    near,  # _page_pair of pos0
    far,
    m,  # [BLOCK_H] fp32 running max
    l,  # [BLOCK_H] fp32 running sum
    acc_a,  # [BLOCK_H, D_LATENT / 2] fp32: o's half-0 columns (unscaled)
    acc_b,  # [BLOCK_H, D_LATENT / 2] fp32: half 1
    q_a,  # [BLOCK_H, D_LATENT / 2] the score dot's operand (_query_operand), latent half 0
    q_b,  # [BLOCK_H, D_LATENT / 2] latent half 1
    q_rope_a,  # [BLOCK_H, D_ROPE / 2] rope half 0
    q_rope_b,  # [BLOCK_H, D_ROPE / 2] rope half 1
    kv_ptr,  # [num_pages, PAGE_SIZE, DQK] bf16 or fp8 e4m3
    stride_kvp,
    stride_kvr,
    pages_ptr,  # [num_slots] int32
    first_slot,
    scale,
    PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One online-softmax step over positions pos0 .. pos0 + BLOCK_N - 1 (those < hi): (m, l, acc_a, acc_b)."""
    pos = pos0 + tl.arange(0, BLOCK_N)
    live = pos < hi
    rows = _cache_rows(pos0, hi, near, far, kv_ptr, stride_kvp, stride_kvr, pages_ptr, first_slot, BLOCK_N, PAGE_SIZE)
    kv_a, kv_b = _cache_halves(rows, live, 0, D_LATENT, KV_FP8)  # [BLOCK_N, D_LATENT / 2]: keys and values
    rope_a, rope_b = _cache_halves(rows, live, D_LATENT, D_ROPE, KV_FP8)  # [BLOCK_N, D_ROPE / 2]: keys only
    score = dot_acc(q_a, tl.trans(kv_a), tl.zeros([q_a.shape[0], BLOCK_N], dtype=tl.float32), UPCAST)
    score = dot_acc(q_b, tl.trans(kv_b), score, UPCAST)
    score = dot_acc(q_rope_a, tl.trans(rope_a), score, UPCAST)
    score = dot_acc(q_rope_b, tl.trans(rope_b), score, UPCAST)
    score = tl.where(live[None, :], score * scale, float("-inf"))
    # The first position of every step is live, so m_new is finite.
    m_new = tl.maximum(m, tl.max(score, axis=1))
    rescale = tl.exp(m - m_new)
    p = _weight_operand(tl.exp(score - m_new[:, None]), KV_FP8)
    l = l * rescale + tl.sum(as_f32(p), axis=1)
    acc_a = dot_acc(p, kv_a, acc_a * rescale[:, None], UPCAST)
    acc_b = dot_acc(p, kv_b, acc_b * rescale[:, None], UPCAST)
    return m_new, l, acc_a, acc_b


@triton.jit
def mla_attn_task(
    s,  # the query token
    k,  # the split
    head_block,  # which BLOCK_H of this rank's heads
    q_ptr,  # [S, HEADS, DQK] bf16, unit stride along DQK
    stride_qs,
    stride_qh,
    kv_ptr,  # [num_pages, PAGE_SIZE, DQK] bf16 or fp8 e4m3, unit stride along DQK
    stride_kvp,
    stride_kvr,
    kv_scale,  # fp32: fp8 dequantisation scale (1.0 for bf16)
    qsl_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    pages_ptr,  # [num_slots] int32
    indptr_ptr,  # [B + 1] int32
    scale,  # fp32 softmax scale
    o_ptr,  # [SPLITS, S, HEADS, D_LATENT] fp32 out, unit stride along D_LATENT
    stride_ok,
    stride_os,
    stride_oh,
    lse_ptr,  # [SPLITS, S, HEADS] fp32 out, unit stride along HEADS
    stride_lk,
    stride_ls,
    HEADS: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_ROPE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,  # the context loop's num_stages (software pipeline; planner.ATTN_STAGES)
    KV_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """o[k, s, heads of the block] and lse[k, s, ...] (the module docstring's program);
    kernels/mono.py runs it as the M1C tasks of an MLA layer's launch."""
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    live_h = heads < HEADS
    cols_a = _half_cols(0, 0, D_LATENT, KV_FP8)
    cols_b = _half_cols(1, 0, D_LATENT, KV_FP8)

    lo, hi, first_slot = _split_range(s, k, qsl_ptr, seq_lens_ptr, indptr_ptr, SPLITS, B, BP)

    q_rows = q_ptr + s * stride_qs + heads[:, None] * stride_qh
    q_a, q_b = _query_halves(q_rows, live_h[:, None], kv_scale, 0, D_LATENT, KV_FP8)
    q_rope_a, q_rope_b = _query_halves(q_rows, live_h[:, None], kv_scale, D_LATENT, D_ROPE, KV_FP8)

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_H, D_LATENT // 2], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_H, D_LATENT // 2], dtype=tl.float32)
    # Each step loads the next step's page ids and carries them: the cache rows' addresses then
    # depend on no load of their own step, so the pipeliner issues a step's copies num_stages - 2
    # steps ahead (3 stages: one step in flight while a step computes; planner.ATTN_STAGES).
    near, far = _page_pair(lo, hi, pages_ptr, first_slot, BLOCK_N, PAGE_SIZE)
    if RANGE_BY_WHILE:
        pos0 = lo
        while pos0 < hi:
            next_near, next_far = _page_pair(pos0 + BLOCK_N, hi, pages_ptr, first_slot, BLOCK_N, PAGE_SIZE)
            m, l, acc_a, acc_b = _attend_step(pos0, hi, near, far, m, l, acc_a, acc_b, q_a, q_b, q_rope_a, q_rope_b,
                                              kv_ptr, stride_kvp, stride_kvr, pages_ptr, first_slot, scale, PAGE_SIZE,
                                              D_LATENT, D_ROPE, BLOCK_N, KV_FP8, UPCAST)
            near, far = next_near, next_far
            pos0 += BLOCK_N
    else:
        # A for loop, software-pipelined (a while loop streams one step at a time).
        for pos0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
            next_near, next_far = _page_pair(pos0 + BLOCK_N, hi, pages_ptr, first_slot, BLOCK_N, PAGE_SIZE)
            m, l, acc_a, acc_b = _attend_step(pos0, hi, near, far, m, l, acc_a, acc_b, q_a, q_b, q_rope_a, q_rope_b,
                                              kv_ptr, stride_kvp, stride_kvr, pages_ptr, first_slot, scale, PAGE_SIZE,
                                              D_LATENT, D_ROPE, BLOCK_N, KV_FP8, UPCAST)
            near, far = next_near, next_far

    seen = l > 0
    if KV_FP8:
        acc_a = acc_a * kv_scale  # the values' scale (the keys' rode on q)
        acc_b = acc_b * kv_scale
    sums = tl.where(seen, l, 1.0)  # an empty split's o is 0 / 1
    lse = tl.where(seen, m + tl.log(sums), float("-inf"))
    o_rows = o_ptr + k * stride_ok + s * stride_os + heads[:, None] * stride_oh
    tl.store(o_rows + cols_a[None, :], acc_a / sums[:, None], mask=live_h[:, None])
    tl.store(o_rows + cols_b[None, :], acc_b / sums[:, None], mask=live_h[:, None])
    tl.store(lse_ptr + k * stride_lk + s * stride_ls + heads, lse, mask=live_h)


@triton.jit
def _mla_attn_kernel(
    q_ptr,  # [S, HEADS, DQK] bf16
    stride_qs,
    stride_qh,
    kv_ptr,  # [num_pages, PAGE_SIZE, DQK] bf16 or fp8 e4m3
    stride_kvp,
    stride_kvr,
    kv_scale,  # fp32
    qsl_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    pages_ptr,  # [num_slots] int32
    indptr_ptr,  # [B + 1] int32
    scale,  # fp32
    o_ptr,  # [SPLITS, S, HEADS, D_LATENT] fp32 out
    stride_ok,
    stride_os,
    stride_oh,
    lse_ptr,  # [SPLITS, S, HEADS] fp32 out
    stride_lk,
    stride_ls,
    HEADS: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_ROPE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    KV_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    mla_attn_task(tl.program_id(0), tl.program_id(1), tl.program_id(2), q_ptr, stride_qs, stride_qh, kv_ptr,
                  stride_kvp, stride_kvr, kv_scale, qsl_ptr, seq_lens_ptr, pages_ptr, indptr_ptr, scale, o_ptr,
                  stride_ok, stride_os, stride_oh, lse_ptr, stride_lk, stride_ls, HEADS, B, BP, PAGE_SIZE, D_LATENT,
                  D_ROPE, SPLITS, BLOCK_H, BLOCK_N, STAGES, KV_FP8, UPCAST)


def shape_text(t) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def check_width(name: str, what: str, width: int, least: int = DOT_MIN) -> None:
    if width < least or width & (width - 1):
        raise K3InputError(f"{name}: expected {what} a power of two >= {least}, got {width}")


def check_operand_scale(name: str, t: torch.Tensor, scale: float) -> None:
    """fp8 needs a positive finite scale; a bf16 operand is used as it is (scale 1.0)."""
    if t.dtype == FP8:
        if not 0.0 < scale < float("inf"):
            raise K3InputError(f"{name}_scale: expected a positive finite scale, got {scale}")
    elif scale != 1.0:
        raise K3InputError(f"{name}_scale: a {t.dtype} {name} takes scale 1.0, got {scale}")


def check_pair_aligned(kv: torch.Tensor) -> None:
    """An fp8 cache's latent columns are read two bytes at a time (_latent_halves): every row
    must start at an even byte."""
    if kv.dtype == FP8 and (kv.data_ptr() % 2 or kv.stride(0) % 2 or kv.stride(1) % 2):
        raise K3InputError(f"kv: an fp8 cache's rows must start at even bytes, got data_ptr {kv.data_ptr():#x} "
                           f"and strides {list(kv.stride())}")


def check_q(q) -> tuple[int, int, int]:
    """(S, heads, DQK) of a bf16 q [S, heads, DQK], 1 <= S <= MAX_TOKENS (M1b keeps all
    S tokens of a head in one program)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise K3InputError(f"q: expected shape [S, heads, DQK], got {shape_text(q)}")
    if not 1 <= q.shape[0] <= MAX_TOKENS:
        raise K3InputError(f"q: expected 1 to {MAX_TOKENS} tokens (S), got {q.shape[0]}")
    expect_tensor("q", q, tuple(q.shape), torch.bfloat16)
    return tuple(q.shape)


def check_mla_attn_args(q, kv, qsl, seq_lens, pages, indptr, o, lse, kv_scale) -> None:
    """Shapes, dtypes, strides and devices (not the request layout's values: reading
    them would sync with the device; reference.mla.check_requests states them)."""
    tokens, heads, dqk = check_q(q)
    if not isinstance(kv, torch.Tensor) or kv.dim() != 3 or kv.shape[2] != dqk:
        raise K3InputError(f"kv: expected shape [pages, page_size, {dqk}], got {shape_text(kv)}")
    if kv.dtype not in (torch.bfloat16, FP8):
        raise K3InputError(f"kv: expected dtype torch.bfloat16 or {FP8}, got {kv.dtype}")
    check_operand_scale("kv", kv, kv_scale)
    check_pair_aligned(kv)
    if not isinstance(o, torch.Tensor) or o.dim() != 4 or tuple(o.shape[1:3]) != (tokens, heads):
        raise K3InputError(f"o: expected shape [splits, {tokens}, {heads}, DL], got {shape_text(o)}")
    splits, latent = o.shape[0], o.shape[3]
    if splits < 1:
        raise K3InputError(f"o: expected at least 1 split, got shape {shape_text(o)}")
    expect_tensor("o", o, (splits, tokens, heads, latent), torch.float32)
    expect_tensor("lse", lse, (splits, tokens, heads), torch.float32)
    check_width("o", "DL (the latent width)", latent, HALVES_MIN)
    check_width("q", "DQK - DL (the positional width)", dqk - latent, HALVES_MIN)
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1:
        raise K3InputError(f"seq_lens: expected shape [B], got {shape_text(seq_lens)}")
    requests = seq_lens.shape[0]
    expect_tensor("seq_lens", seq_lens, (requests,), torch.int32)
    expect_tensor("qsl", qsl, (requests + 1,), torch.int32)
    expect_tensor("indptr", indptr, (requests + 1,), torch.int32)
    if not isinstance(pages, torch.Tensor) or pages.dim() != 1:
        raise K3InputError(f"pages: expected shape [num_slots], got {shape_text(pages)}")
    expect_tensor("pages", pages, tuple(pages.shape), torch.int32)
    named = (("q", q), ("kv", kv), ("qsl", qsl), ("seq_lens", seq_lens), ("pages", pages),
             ("indptr", indptr), ("o", o), ("lse", lse))
    check_unit_stride(*named)
    check_same_device(*named)


def launch_mla_attn(q, kv, qsl, seq_lens, pages, indptr, scale, o, lse, *, kv_scale=1.0, block_h, block_n,
                    stages, warps, max_registers=None) -> None:
    """M1c into o [splits, S, heads, DL] fp32 and lse [splits, S, heads] fp32 (their shapes
    give splits and DL). q [S, heads, DQK] bf16; kv [pages, page_size, DQK] bf16 or fp8
    e4m3 (kv_scale); qsl [B + 1], seq_lens [B], pages [num_slots], indptr [B + 1] int32.
    ``max_registers``: ptxas's cap a thread (Triton's maxnreg; None: the compiler's choice)."""
    check_mla_attn_args(q, kv, qsl, seq_lens, pages, indptr, o, lse, kv_scale)
    tokens, heads, dqk = q.shape
    splits, latent = o.shape[0], o.shape[3]
    requests = seq_lens.shape[0]
    grid = (tokens, splits, triton.cdiv(heads, block_h))
    _mla_attn_kernel[grid](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.stride(1), float(kv_scale),
        qsl, seq_lens, pages, indptr, float(scale),
        o, o.stride(0), o.stride(1), o.stride(2), lse, lse.stride(0), lse.stride(1),
        HEADS=heads, B=requests, BP=next_pow2(requests), PAGE_SIZE=kv.shape[1], D_LATENT=latent,
        D_ROPE=dqk - latent, SPLITS=splits, BLOCK_H=block_h, BLOCK_N=block_n, STAGES=stages,
        KV_FP8=kv.dtype == FP8, UPCAST=common.UPCAST_DOT, num_warps=warps, **common.register_cap(max_registers),
    )
