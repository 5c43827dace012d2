"""The bf16 GEMV tile every dense stage is built from.

Shapes: S tokens (SP padded: a power of two, 16 on the tl.dot path), K the
input width, N the output rows of the weight, ROWS the rows one task owns.

    acc[s, j] = sum_k x[s, k] * w[row0 + j, k]        fp32, unrounded
    x [S, K] bf16, w [N, K] bf16, acc [SP, ROWS] fp32

This is the hot loop of layer_post: at decode sizes every weight byte is read
once and used for at most 16 tokens, so the tile is built to stream weights at
the memory bandwidth:

* weight tiles are [ROWS, BLOCK_K] with K innermost and unit stride, so each
  thread loads contiguous 16-byte vectors and a warp reads whole cache lines;
* the weight rows past N are clamped onto row N-1 instead of masked: the loads
  stay unpredicated per element (the duplicated row is served by L1), and the
  garbage rows are never stored (``store_rows`` masks them). With ``EVEN_K``
  (K a multiple of BLOCK_K) the K tail mask disappears too: the steady-state
  weight load is a plain 16-byte vector load under one uniform predicate;
* USE_DOT picks the arithmetic. tl.dot runs on the tensor cores with the tokens
  padded to 16; Triton's pipeliner stages its operands through shared memory.
  The FMA path (at most FMA_MAX_SP tokens) keeps, per token, partial sums of
  the VEC products each thread loaded as one vector (register FMAs only: no
  shuffle and no CTA barrier inside the loop) and reduces across lanes and
  warps once at the end. x is loaded broadcast to the weight tile's shape so
  it gets the weight tile's register layout (no per-step layout conversion; the
  repeated reads hit L1). The next step's weight load is issued once this
  step's tile is read: the sm_90a build refills the same registers, so one
  step is in flight and each step waits out a memory round trip (a 32-row
  o_proj task at S = 1: 12 steps of 8 KB, 10 us from HBM and 7.9 from L2 in
  the mono launch's traces). Triton's pipelined range instead (cp.async
  into shared memory, 2 or 3 stages) made the mono launch slower on an H100:
  69.6 -> 110.3 / 97.6 us at S = 1, 130 -> 215 / 253 at S = 4 (docs/PERF.md,
  twenty-sixth session). So did the mono launch's tasks loading their first
  step into registers before polling their waits: S = 1 69.6 -> 70.7, S = 4
  130.5 -> 132.7 (router, latent down and FINAL; thirty-third session).

Shape-like arguments (S, N, K) are constexprs: the interpreter cannot loop to a
runtime bound (numpy 2.4 refuses int() of its 1-element scalars), and a build
is specialised to its shapes anyway.

Tokens at or past S contribute zero rows to ``acc``; rows at or past N hold
garbage. Callers store through ``store_rows``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import as_f32, dot_acc, rms_value

VEC = tl.constexpr(8)  # bf16 values in one 16-byte load: the run a thread holds
FMA_MAX_SP = tl.constexpr(8)  # tokens the FMA path keeps accumulators for (planner.X_FMA_MAX_TOKENS)


@triton.jit
def _load_w(
    w_ptrs,  # [ROWS, BLOCK_K] pointers into w [N, K] bf16 at column k0
    k0,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """A weight tile, streamed once (evict first: it is never read again); all
    zeros (and no memory traffic) from k0 = K on, so a prefetch may run past."""
    if EVEN_K:
        return tl.load(w_ptrs + k0, mask=k0 < K, other=0.0, eviction_policy="evict_first")
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        return tl.load(w_ptrs + k0, mask=(kk < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _load_x_bcast(
    x_row_ptr,  # [K] bf16: one token of x
    zero_rows,  # [ROWS] int32 zeros: the weight tile's row axis, to broadcast over
    k0,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """x[k0 : k0 + BLOCK_K] as a [ROWS, BLOCK_K] tile (every row the same): the
    same shape and contiguity as the weight tile, so it gets the same register
    layout and the product needs no layout conversion (a conversion is a trip
    through shared memory and a CTA barrier every step). The repeated reads are
    L1 hits."""
    kk = k0 + tl.arange(0, BLOCK_K)
    ptrs = x_row_ptr + zero_rows[:, None] + kk[None, :]
    if EVEN_K:
        return tl.load(ptrs, eviction_policy="evict_last")
    else:
        return tl.load(ptrs, mask=(kk < K)[None, :], other=0.0, eviction_policy="evict_last")


@triton.jit
def _fold(
    w,  # [ROWS, BLOCK_K] fp32 weight tile
    x_row_ptr,  # [K] bf16: one token of x
    zero_rows,  # [ROWS] int32 zeros
    k0,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    norm_ptr=None,  # [K] bf16 (X_RMS)
    x_scale=1.0,  # fp32 (X_RMS)
    X_RMS: tl.constexpr = False,
):
    """[ROWS, BLOCK_K / VEC] fp32: w * x summed over each run of VEC columns
    (the run one thread loaded as one vector, so the sum stays in registers).
    X_RMS: the row is h and x = rms_value(h, norm, x_scale), formed here."""
    xs = as_f32(_load_x_bcast(x_row_ptr, zero_rows, k0, K, BLOCK_K, EVEN_K))
    if X_RMS:
        norm = as_f32(_load_x_bcast(norm_ptr, zero_rows, k0, K, BLOCK_K, EVEN_K))
        xs = as_f32(rms_value(xs, norm, x_scale))
    return tl.sum(tl.reshape(w * xs, [ROWS, BLOCK_K // VEC, VEC]), axis=2)


@triton.jit
def _token_row(
    tok,  # [SP] int32 token indices
    t: tl.constexpr,  # the token whose sums these are
    partial,  # [ROWS, BLOCK_K / VEC] fp32: its per-thread partial sums
    acc,  # [SP, ROWS] fp32
):
    """acc with row t replaced by the partial sums summed across lanes and warps."""
    return tl.where(tok[:, None] == t, tl.sum(partial, axis=1)[None, :], acc)


@triton.jit
def _fold_tokens(
    p0, p1, p2, p3, p4, p5, p6, p7,  # [ROWS, BLOCK_K / VEC] fp32: tokens 0..7's partial sums (S of them live)
    w,  # [ROWS, BLOCK_K] fp32: the step's weight tile
    x_ptr,  # [S, K] bf16, row stride stride_xs
    stride_xs,
    zero_rows,  # [ROWS] int32 zeros
    k0,
    S: tl.constexpr,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    norm_ptr,  # [K] bf16 (X_RMS)
    x_scale,  # fp32 (X_RMS)
    X_RMS: tl.constexpr,
):
    """The partial sums with one weight step folded in for each of the S tokens."""
    p0 += _fold(w, x_ptr, zero_rows, k0, K, ROWS, BLOCK_K, EVEN_K, norm_ptr, x_scale, X_RMS)
    if S > 1:
        p1 += _fold(w, x_ptr + stride_xs, zero_rows, k0, K, ROWS, BLOCK_K, EVEN_K)
    if S > 2:
        p2 += _fold(w, x_ptr + 2 * stride_xs, zero_rows, k0, K, ROWS, BLOCK_K, EVEN_K)
    if S > 3:
        p3 += _fold(w, x_ptr + 3 * stride_xs, zero_rows, k0, K, ROWS, BLOCK_K, EVEN_K)
    if S > 4:
        p4 += _fold(w, x_ptr + 4 * stride_xs, zero_rows, k0, K, ROWS, BLOCK_K, EVEN_K)
    if S > 5:
        p5 += _fold(w, x_ptr + 5 * stride_xs, zero_rows, k0, K, ROWS, BLOCK_K, EVEN_K)
    if S > 6:
        p6 += _fold(w, x_ptr + 6 * stride_xs, zero_rows, k0, K, ROWS, BLOCK_K, EVEN_K)
    if S > 7:
        p7 += _fold(w, x_ptr + 7 * stride_xs, zero_rows, k0, K, ROWS, BLOCK_K, EVEN_K)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def gemv_tile(
    x_ptr,  # [S, K] bf16, row stride stride_xs, unit column stride
    stride_xs,
    w_ptr,  # [N, K] bf16, row stride stride_wn, unit column stride
    stride_wn,
    row0,  # first weight row of the tile
    S: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    norm_ptr=None,  # [K] bf16: X_RMS's norm vector
    x_scale=1.0,  # fp32: X_RMS's scale
    X_RMS: tl.constexpr = False,
):
    """acc [SP, ROWS] fp32 = x @ w[row0 : row0 + ROWS].T (see the module docstring).

    X_RMS (one token, the FMA path): x_ptr holds h and the tile multiplies
    x = rms_value(h, norm, x_scale), formed as it streams: the bits a norm step
    would have stored, without that step's poll and round trip."""
    tl.static_assert(not X_RMS or (S == 1 and not USE_DOT))
    rows = tl.minimum(row0 + tl.arange(0, ROWS), N - 1)
    kk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + kk[None, :]
    tok = tl.arange(0, SP)
    if USE_DOT:
        acc = tl.zeros([SP, ROWS], dtype=tl.float32)
        x_ptrs = x_ptr + tok[:, None] * stride_xs + kk[None, :]
        for k0 in range(0, K, BLOCK_K):
            w = _load_w(w_ptrs, k0, K, BLOCK_K, EVEN_K)
            if EVEN_K:
                x = tl.load(x_ptrs + k0, mask=(tok < S)[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs + k0, mask=(tok < S)[:, None] & ((k0 + kk) < K)[None, :], other=0.0)
            acc = dot_acc(x, tl.trans(w), acc, UPCAST)
        return acc
    else:
        # Per token, [ROWS, BLOCK_K / VEC] partial sums: a step folds only the VEC
        # products a thread holds of one row (register FMAs: no shuffles and no
        # CTA barrier in the loop); the sums across lanes and warps run once.
        tl.static_assert(SP <= FMA_MAX_SP)
        zero_rows = tl.zeros([ROWS], dtype=tl.int32)
        p0 = tl.zeros([ROWS, BLOCK_K // VEC], dtype=tl.float32)
        p1 = tl.zeros([ROWS, BLOCK_K // VEC], dtype=tl.float32)
        p2 = tl.zeros([ROWS, BLOCK_K // VEC], dtype=tl.float32)
        p3 = tl.zeros([ROWS, BLOCK_K // VEC], dtype=tl.float32)
        p4 = tl.zeros([ROWS, BLOCK_K // VEC], dtype=tl.float32)
        p5 = tl.zeros([ROWS, BLOCK_K // VEC], dtype=tl.float32)
        p6 = tl.zeros([ROWS, BLOCK_K // VEC], dtype=tl.float32)
        p7 = tl.zeros([ROWS, BLOCK_K // VEC], dtype=tl.float32)
        # The next step's load is issued once this step's registers are read,
        # so one step is in flight while this step's FMAs run (the dot path
        # gets more from Triton's pipeliner).
        w_next = _load_w(w_ptrs, 0, K, BLOCK_K, EVEN_K)
        for k0 in range(0, K, BLOCK_K):
            w = as_f32(w_next)
            w_next = _load_w(w_ptrs, k0 + BLOCK_K, K, BLOCK_K, EVEN_K)
            p0, p1, p2, p3, p4, p5, p6, p7 = _fold_tokens(p0, p1, p2, p3, p4, p5, p6, p7, w, x_ptr, stride_xs,
                                                          zero_rows, k0, S, K, ROWS, BLOCK_K, EVEN_K, norm_ptr,
                                                          x_scale, X_RMS)
        acc = _token_row(tok, 0, p0, tl.zeros([SP, ROWS], dtype=tl.float32))
        if S > 1:
            acc = _token_row(tok, 1, p1, acc)
        if S > 2:
            acc = _token_row(tok, 2, p2, acc)
        if S > 3:
            acc = _token_row(tok, 3, p3, acc)
        if S > 4:
            acc = _token_row(tok, 4, p4, acc)
        if S > 5:
            acc = _token_row(tok, 5, p5, acc)
        if S > 6:
            acc = _token_row(tok, 6, p6, acc)
        if S > 7:
            acc = _token_row(tok, 7, p7, acc)
        return acc


@triton.jit
def gemv_part(
    x_ptr,  # [S, K] bf16, row stride stride_xs, unit column stride
    stride_xs,
    w_ptr,  # [N, K] bf16, row stride stride_wn, unit column stride
    stride_wn,
    row0,
    part,  # which KC columns: part * KC ..
    S: tl.constexpr,
    N: tl.constexpr,
    KC: tl.constexpr,  # K / parts
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # KC a multiple of BLOCK_K
    UPCAST: tl.constexpr,
):
    """acc [SP, ROWS] fp32 = x[:, part*KC : (part+1)*KC] @ w[row0 : row0 + ROWS, the same columns].T:
    one part of K of a split tile (tl.dot; planner.X_K_PARTS)."""
    return gemv_tile(x_ptr + part * KC, stride_xs, w_ptr + part * KC, stride_wn, row0, S, N, KC, SP, ROWS, BLOCK_K,
                     True, EVEN_K, UPCAST)


@triton.jit
def gemv_parts_tile(
    x_ptr,  # [S, K] bf16, row stride stride_xs, unit column stride
    stride_xs,
    w_ptr,  # [N, K] bf16, row stride stride_wn, unit column stride
    stride_wn,
    row0,
    S: tl.constexpr,
    N: tl.constexpr,
    KC: tl.constexpr,  # K / PARTS
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTS: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """acc [SP, ROWS] fp32: the PARTS gemv_parts added from zero in part order, in
    one program: the sum the mono launch forms from its split tasks (sum_parts)."""
    acc = tl.zeros([SP, ROWS], dtype=tl.float32)
    for part in tl.static_range(PARTS):
        acc += gemv_part(x_ptr, stride_xs, w_ptr, stride_wn, row0, part, S, N, KC, SP, ROWS, BLOCK_K, EVEN_K, UPCAST)
    return acc


@triton.jit
def sum_parts(
    parts_ptr,  # [PARTS - 1, S, N] fp32: the earlier parts' gemv_part tiles (store_rows)
    last,  # [SP, ROWS] fp32: the last part's, in registers
    row0,
    S: tl.constexpr,
    N: tl.constexpr,
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    PARTS: tl.constexpr,
):
    """[SP, ROWS] fp32: zero + parts 0 .. PARTS - 2 + ``last``, in that order
    (gemv_parts_tile's sum, so its bits); tokens past S are 0, rows past N
    garbage as gemv_tile's (store_rows masks them)."""
    tok = tl.arange(0, SP)
    rows = row0 + tl.arange(0, ROWS)
    offsets = tok[:, None] * N + rows[None, :]
    mask = (tok < S)[:, None] & (rows < N)[None, :]
    acc = tl.zeros([SP, ROWS], dtype=tl.float32)
    for part in tl.static_range(PARTS - 1):
        acc += tl.load(parts_ptr + part * (S * N) + offsets, mask=mask, other=0.0)
    return acc + last


@triton.jit
def store_rows(
    out_ptr,  # [S, N] (any dtype), row stride stride_os, unit column stride
    stride_os,
    tile,  # [SP, ROWS] in out's dtype
    row0,
    first,  # the first token stored (0; a token group's tasks: the ones before it are another task's)
    S: tl.constexpr,
    N: tl.constexpr,
    SP: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out[first:S, row0 : row0 + ROWS] = tile[first:S], masked to the real rows."""
    tok = tl.arange(0, SP)
    rows = row0 + tl.arange(0, ROWS)
    ptrs = out_ptr + tok[:, None] * stride_os + rows[None, :]
    tl.store(ptrs, tile, mask=((tok >= first) & (tok < S))[:, None] & (rows < N)[None, :])


@triton.jit
def group_window(
    first,  # the group's first token (a multiple of G), or -1: all S tokens (G = S)
    S: tl.constexpr,
    G: tl.constexpr,  # tokens a group
):
    """(window, skip): a task of a group of G tokens runs on the G rows of x
    from ``window``, the last group's window shifted back to end at row S (x
    has exactly S rows), and stores the rows from ``skip`` on (the earlier
    ones belong to the group before, which computes the same bits)."""
    window = tl.minimum(tl.maximum(first, 0), S - G)
    return window, tl.maximum(first, 0) - window


def even_k(k: int, block_k: int) -> bool:
    """Host side: whether K needs no tail mask (the EVEN_K constexpr)."""
    return k % block_k == 0


def check_rows_contiguous(name: str, t) -> None:
    """Host side: the GEMV tiles assume unit stride along a tensor's last dim."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride along the last dim, got strides {tuple(t.stride())}")


def num_tasks(n: int, rows: int) -> int:
    return triton.cdiv(n, rows)
