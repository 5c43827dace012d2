"""Stages: routed experts on one rank (MXFP4 weights), after route.

Shapes: S tokens, K experts per token, E experts, L latent, I_R = I/T this
rank's slice of the expert intermediate, G_ROW = inputs / 32 (MXFP4 groups
of a row); weights as k3mono.weights shards:

    w1/w3_packed [E, I_R, L/2] u8     w1/w3_scale [E, I_R, L/32] u8
    w2_packed    [E, L, I_R/2] u8     w2_scale    [E, L, I_R/32] u8

gate_up: task = (pair s*K + j, tile of ROWS intermediate rows), e = ids[s, j]:

    g   = bf16(z[s] @ w1[e].T)      u = bf16(z[s] @ w3[e].T)       fp32 accumulation
    act = bf16(situ(g, u))                                          -> expert_act [S, K, I_R]

down: task = (token s, tile of ROWS latent rows):

    acc = sum_j w[s, j] * (act[s, j] @ w2[ids[s, j]].T)             fp32, never rounded
                                                                    -> latent_partial [S, L]

The per-expert output is not rounded: this rank holds only a partial of it
(reference/tp.py). The K experts' inputs form one row of K * G_ROW group
columns, each with its own expert's weights, activations and route weight
(folded into the group's scale factor): the sums over groups and experts
are one fp32 sum of the same terms in another association than the
reference's (a 1e-7-relative difference), and a step always has live
columns even where I_R is only a few groups (12 at TP8).

MXFP4 is dequantised in registers (kernels/mxfp4.py): each thread reads 16
contiguous bytes (one 32-value group) and its scale byte, places each
nibble into an fp32 with three integer ops and one FFMA, and applies the
scale once per group. Activations carry a 2^63 pre-scale that the finished
dot gives back, which needs |activation| < 2^64: z is an O(1) latent and
situ is bounded by beta * linear_beta = 100.

With the weights in f16 order (int8; k3mono.mxfp4.f16_order, TileChoice.expert_f16)
the same loops place each nibble pair as an f16x2 and take two products an
HFMA2, a group's sum in f16 (kernels/mxfp4.py, "f16x2 placement"): 3.0 (gate/up)
and 3.7 (down) instructions a weight value against 4.3 and 5.0 (offline sm_90a
builds, kimi-k3 TP8). Each task first reads its token's activations (z for
gate/up, the K experts' act for down) for their largest magnitude, which sets
the power of two that keeps them in f16's range.

The same two stages on tensor cores (``*_mma``; TileChoice.expert_mma):
weights in mma order (k3mono.mxfp4.mma_order, int32 words), placed as bf16
pairs straight into the tl.dot operand, the activations (z, act) times 2^63
in memory and laid out block-diagonally so one dot gives each group's partial
in its own column; the scales multiply that [ROWS, 16] tile once a step
(kernels/mxfp4.py, "tensor-core placement").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import MXFP4_GROUP
from ..errors import K3InputError, expect_tensor
from ..mxfp4 import F16_ORDER_DTYPE
from ..planner import expert_mma_tile
from .common import UPCAST_DOT, as_f32, dot_acc, situ, to_bf16
from .mxfp4 import (
    ACT_PRESCALE,
    DEFAULT_DEQUANT,
    DEQUANT_F16,
    MMA_N,
    OUT_RESCALE,
    WORDS_PER_GROUP,
    act_pair_ptrs,
    bf16_abs_max_bits,
    e2m1_mma_tile,
    e8m0_scale,
    f16_act_pairs,
    f16_scale_for,
    load_act_pairs,
    load_block_diagonal,
    load_mma_tile,
    load_mxfp4_tile,
    mxfp4_f16_group_dot,
    mxfp4_f16_group_dot_pair,
    mxfp4_group_dot,
    mxfp4_group_dot_pair,
)

GROUP = tl.constexpr(MXFP4_GROUP)  # inputs per E8M0 scale
_PACKING = 2  # E2M1 values per packed byte
_MMA_VALUES_PER_WORD = 8  # E2M1 values per int32 word of weights in mma order
PACKING = tl.constexpr(_PACKING)
# Steps whose loads are in flight at once. 1: each step's loads go straight
# into registers (64 to 128 bytes of weights a thread); more stage them through
# shared memory with cp.async, which cost more than it hid for bytes used once
# (benchmarks/expert_loops.py on the H200: gate/up at S = 8 66 us at 1 stage,
# 135 at 3; docs/PERF.md). LOOP_UNROLL: steps a loop body holds (1: none; 2 and
# 4 gained nothing). Not part of StageGeometry (GemvTile has no such field); the
# interpreter ignores both. The launchers compile EXPERT_STAGES / EXPERT_UNROLL,
# module attributes a benchmark may set.
F16 = tl.constexpr(DEQUANT_F16)
SCALE_SCAN = tl.constexpr(1024)  # activations a task reads at once for the largest magnitude (DEQUANT_F16)
PIPELINE_STAGES = tl.constexpr(1)
LOOP_UNROLL = tl.constexpr(1)


@triton.jit
def _gate_up_loads(
    w1,  # u8 [I_R, L/2]: the expert's w1
    w1_scale,  # u8 [I_R, L/32]
    w3,  # u8 [I_R, L/2]: the expert's w3
    w3_scale,  # u8 [I_R, L/32]
    z_row,  # bf16 [L]: the token's latent
    g0,  # the step's first group (none loads past G_ROW: a lookahead's last step is free)
    rows,  # [ROWS] int32
    row_ok,
    G_ROW: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
):
    groups = g0 + tl.arange(0, BLOCK_G)
    col_ok = groups < G_ROW
    words1, scales1 = load_mxfp4_tile(w1, w1_scale, groups, col_ok, rows, row_ok, G_ROW, EVICT_FIRST)
    words3, scales3 = load_mxfp4_tile(w3, w3_scale, groups, col_ok, rows, row_ok, G_ROW, EVICT_FIRST)
    a_ptrs, a_ok = act_pair_ptrs(z_row, groups, col_ok)
    return words1, scales1, words3, scales3, load_act_pairs(a_ptrs, a_ok)


@triton.jit
def expert_gate_up_task(
    task,
    z_ptr,  # bf16 [S, L]
    ids_ptr,  # int32 [S, K]
    w1_ptr,  # u8 [E, I_R, L/2]
    w1_scale_ptr,  # u8 [E, I_R, L/32]
    w3_ptr,  # u8 [E, I_R, L/2]
    w3_scale_ptr,  # u8 [E, I_R, L/32]
    act_ptr,  # bf16 [S, K, I_R] out
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,  # I/T
    ROWS: tl.constexpr,  # intermediate rows per task
    BLOCK_G: tl.constexpr,  # MXFP4 groups of a row per step
    BETA: tl.constexpr,
    LINEAR_BETA: tl.constexpr,
    DEQUANT: tl.constexpr = DEFAULT_DEQUANT,  # kernels/mxfp4.py: DEQUANT_SHIFT (0), DEQUANT_IMAD (1), DEQUANT_F16 (2)
    STAGES: tl.constexpr = PIPELINE_STAGES,
    UNROLL: tl.constexpr = LOOP_UNROLL,
    LOOKAHEAD: tl.constexpr = False,  # load step i + 1 (weights, activations) before step i's math (GemvTile.lookahead)
    EVICT_FIRST: tl.constexpr = False,  # weight loads evict_first in L2 (kernels/mxfp4.py load_mxfp4_tile)
):
    """Task = (pair s*K + j, tile of ROWS intermediate rows), pair-major.
    DEQUANT_F16 (w1, w3 int8 in f16 order): the token's z scaled by the power
    of two that puts its largest magnitude just below 2^15 (f16_scale_for)."""
    TILES: tl.constexpr = triton.cdiv(I_R, ROWS)
    G_ROW: tl.constexpr = L // GROUP
    pair = task // TILES
    tile = task % TILES
    token = pair // K
    # int64: E * I_R * L/2 bytes passes 2^31 at TP1 (4.9 GB for the released shapes).
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w1 = w1_ptr + expert * (I_R * L // PACKING)
    w3 = w3_ptr + expert * (I_R * L // PACKING)
    w1_scale = w1_scale_ptr + expert * (I_R * G_ROW)
    w3_scale = w3_scale_ptr + expert * (I_R * G_ROW)
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_ok = rows < I_R

    # Per (group column, row) partials; the row sums are taken once, at the end.
    gate = tl.zeros((BLOCK_G, ROWS), tl.float32)
    up = tl.zeros((BLOCK_G, ROWS), tl.float32)
    z_row = z_ptr + token * L
    if DEQUANT == F16:
        act_scale, rescale = f16_scale_for(bf16_abs_max_bits(z_row, L, SCALE_SCAN))
    else:
        act_scale, rescale = 1.0, OUT_RESCALE
    if LOOKAHEAD:
        ahead = _gate_up_loads(w1, w1_scale, w3, w3_scale, z_row, 0, rows, row_ok, G_ROW, BLOCK_G, EVICT_FIRST)
    for g0 in tl.range(0, G_ROW, BLOCK_G, num_stages=STAGES, loop_unroll_factor=UNROLL):
        if LOOKAHEAD:
            words1, scales1, words3, scales3, acts = ahead
            ahead = _gate_up_loads(w1, w1_scale, w3, w3_scale, z_row, g0 + BLOCK_G, rows, row_ok, G_ROW, BLOCK_G,
                                   EVICT_FIRST)
        else:
            words1, scales1, words3, scales3, acts = _gate_up_loads(w1, w1_scale, w3, w3_scale, z_row, g0, rows,
                                                                    row_ok, G_ROW, BLOCK_G, EVICT_FIRST)
        if DEQUANT == F16:
            dot1, dot3 = mxfp4_f16_group_dot_pair(words1, words3, f16_act_pairs(acts, act_scale))
        else:
            dot1, dot3 = mxfp4_group_dot_pair(words1, words3, acts, DEQUANT)
        gate += dot1 * e8m0_scale(scales1)
        up += dot3 * e8m0_scale(scales3)
    g = to_bf16(tl.sum(gate, axis=0) * rescale)
    u = to_bf16(tl.sum(up, axis=0) * rescale)
    act = to_bf16(situ(as_f32(g), as_f32(u), BETA, LINEAR_BETA))
    tl.store(act_ptr + pair * I_R + rows, act, mask=row_ok)


@triton.jit
def _expert_gate_up_kernel(
    z_ptr,  # bf16 [S, L]
    ids_ptr,  # int32 [S, K]
    w1_ptr,  # u8 [E, I_R, L/2]
    w1_scale_ptr,  # u8 [E, I_R, L/32]
    w3_ptr,  # u8 [E, I_R, L/2]
    w3_scale_ptr,  # u8 [E, I_R, L/32]
    act_ptr,  # bf16 [S, K, I_R] out
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BETA: tl.constexpr,
    LINEAR_BETA: tl.constexpr,
    DEQUANT: tl.constexpr,
    STAGES: tl.constexpr,
    UNROLL: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
):
    expert_gate_up_task(
        tl.program_id(0),
        z_ptr,
        ids_ptr,
        w1_ptr,
        w1_scale_ptr,
        w3_ptr,
        w3_scale_ptr,
        act_ptr,
        K,
        L,
        I_R,
        ROWS,
        BLOCK_G,
        BETA,
        LINEAR_BETA,
        DEQUANT,
        STAGES,
        UNROLL,
        LOOKAHEAD,
    )


@triton.jit
def _down_loads(
    c0,  # the step's first (slot, group) column (none loads past K * G_ROW)
    token,
    act_ptr,  # bf16 [S, K, I_R]
    ids_ptr,  # int32 [S, K]
    route_w_ptr,  # fp32 [S, K]
    w2_ptr,  # u8 [E, L, I_R/2]
    w2_scale_ptr,  # u8 [E, L, I_R/32]
    rows,  # [ROWS] int32
    row_ok,
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    rescale,  # what the dot still owes (2^63, or 2^(14 - t) for DEQUANT_F16)
):
    G_ROW: tl.constexpr = I_R // GROUP
    cols = c0 + tl.arange(0, BLOCK_G)
    col_ok = cols < K * G_ROW
    pair = token * K + cols // G_ROW
    # int64: E * L * I_R/2 bytes passes 2^31 at TP1.
    expert = tl.load(ids_ptr + pair, mask=col_ok, other=0).to(tl.int64)
    w2 = (w2_ptr + expert * (L * I_R // PACKING))[:, None]
    w2_scale = (w2_scale_ptr + expert * (L * G_ROW))[:, None]
    words, scales = load_mxfp4_tile(w2, w2_scale, cols % G_ROW, col_ok, rows, row_ok, G_ROW, EVICT_FIRST)
    a_ptrs, a_ok = act_pair_ptrs((act_ptr + pair * I_R)[:, None], cols % G_ROW, col_ok)
    # What the dot still owes rides on the route weight (a power of two: exact).
    weight = tl.load(route_w_ptr + pair, mask=col_ok, other=0.0) * rescale
    return words, scales, load_act_pairs(a_ptrs, a_ok), weight


@triton.jit
def expert_down_task(
    task,
    act_ptr,  # bf16 [S, K, I_R]
    ids_ptr,  # int32 [S, K]
    route_w_ptr,  # fp32 [S, K]
    w2_ptr,  # u8 [E, L, I_R/2]
    w2_scale_ptr,  # u8 [E, L, I_R/32]
    out_ptr,  # fp32 [S, L] out: this rank's latent partial
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,  # I/T
    ROWS: tl.constexpr,  # latent rows per task
    BLOCK_G: tl.constexpr,  # (slot, group) columns per step
    DEQUANT: tl.constexpr = DEFAULT_DEQUANT,  # kernels/mxfp4.py: DEQUANT_SHIFT (0), DEQUANT_IMAD (1), DEQUANT_F16 (2)
    STAGES: tl.constexpr = PIPELINE_STAGES,
    UNROLL: tl.constexpr = LOOP_UNROLL,
    LOOKAHEAD: tl.constexpr = False,  # load step i + 1 (weights, activations, route weights) before step i's math
    EVICT_FIRST: tl.constexpr = False,  # weight loads evict_first in L2 (kernels/mxfp4.py load_mxfp4_tile)
):
    """Task = (token, tile of ROWS latent rows), token-major.

    The K chosen experts' inputs are one row of K * I_R/32 group columns,
    column c = (slot c // G_ROW, group c % G_ROW), each with its own expert's
    weights, activations and route weight (folded into the group's scale).
    A step thus always has BLOCK_G live columns, however few groups I/T has
    (12 at TP8), and the row sums are taken once, at the end. The sum over
    experts is reassociated with the sums over groups: fp32 rounding of the
    same terms, no per-expert rounding. DEQUANT_F16 (w2 int8 in f16 order):
    the token's act scaled as gate/up scales z (f16_scale_for)."""
    TILES: tl.constexpr = triton.cdiv(L, ROWS)
    G_ROW: tl.constexpr = I_R // GROUP
    COLS: tl.constexpr = K * G_ROW
    token = task // TILES
    tile = task % TILES
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_ok = rows < L

    acc = tl.zeros((BLOCK_G, ROWS), tl.float32)
    if DEQUANT == F16:
        act_scale, rescale = f16_scale_for(bf16_abs_max_bits(act_ptr + token * COLS * GROUP, COLS * GROUP, SCALE_SCAN))
    else:
        act_scale, rescale = 1.0, OUT_RESCALE
    if LOOKAHEAD:
        ahead = _down_loads(0, token, act_ptr, ids_ptr, route_w_ptr, w2_ptr, w2_scale_ptr, rows, row_ok, K, L, I_R,
                            BLOCK_G, EVICT_FIRST, rescale)
    for c0 in tl.range(0, COLS, BLOCK_G, num_stages=STAGES, loop_unroll_factor=UNROLL):
        if LOOKAHEAD:
            words, scales, acts, weight = ahead
            ahead = _down_loads(c0 + BLOCK_G, token, act_ptr, ids_ptr, route_w_ptr, w2_ptr, w2_scale_ptr, rows, row_ok,
                                K, L, I_R, BLOCK_G, EVICT_FIRST, rescale)
        else:
            words, scales, acts, weight = _down_loads(c0, token, act_ptr, ids_ptr, route_w_ptr, w2_ptr, w2_scale_ptr,
                                                      rows, row_ok, K, L, I_R, BLOCK_G, EVICT_FIRST, rescale)
        if DEQUANT == F16:
            dot = mxfp4_f16_group_dot(words, f16_act_pairs(acts, act_scale))
        else:
            dot = mxfp4_group_dot(words, acts, DEQUANT)
        acc += dot * (e8m0_scale(scales) * weight[:, None])
    tl.store(out_ptr + token * L + rows, tl.sum(acc, axis=0), mask=row_ok)


@triton.jit
def _expert_down_kernel(
    act_ptr,  # bf16 [S, K, I_R]
    ids_ptr,  # int32 [S, K]
    route_w_ptr,  # fp32 [S, K]
    w2_ptr,  # u8 [E, L, I_R/2]
    w2_scale_ptr,  # u8 [E, L, I_R/32]
    out_ptr,  # fp32 [S, L] out
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    DEQUANT: tl.constexpr,
    STAGES: tl.constexpr,
    UNROLL: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
):
    expert_down_task(tl.program_id(0), act_ptr, ids_ptr, route_w_ptr, w2_ptr, w2_scale_ptr, out_ptr, K, L, I_R, ROWS,
                     BLOCK_G, DEQUANT, STAGES, UNROLL, LOOKAHEAD)


# -- the same stages on tensor cores (weights in mma order) -----------------------
#
# k3mono.mxfp4.mma_order puts each group's elements where an mma fragment wants
# them; kernels/mxfp4.py e2m1_mma_tile places them as bf16 (E2M1 * 2^-126) and
# load_block_diagonal lays a step's activations out one group a column, so
# tl.dot returns every group's partial in its own column and the scales (route
# weights too, for down) multiply a [ROWS, MMA_N] tile once a step. The
# activations come times 2^63 (ACT_PRESCALE): z from the caller, and gate/up
# writes its act so for down. Every product is exact (bf16 times bf16), sums are
# fp32 in another association than the FMA loops': the same terms.


@triton.jit
def expert_gate_up_mma_task(
    task,
    z_ptr,  # bf16 [S, L]: z * 2^63
    ids_ptr,  # int32 [S, K]
    w1_ptr,  # i32 [E, I_R, L/8]: w1 in mma order
    w1_scale_ptr,  # u8 [E, I_R, L/32]
    w3_ptr,  # i32 [E, I_R, L/8]: w3 in mma order
    w3_scale_ptr,  # u8 [E, I_R, L/32]
    act_ptr,  # bf16 [S, K, I_R] out: act * 2^63
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,  # I/T
    ROWS: tl.constexpr,  # intermediate rows per task
    BLOCK_G: tl.constexpr,  # MXFP4 groups of a row per step, at most MMA_N
    BETA: tl.constexpr,
    LINEAR_BETA: tl.constexpr,
    UPCAST: tl.constexpr,  # common.UPCAST_DOT
):
    """expert_gate_up_task on tensor cores: task = (pair s*K + j, tile of ROWS rows)."""
    TILES: tl.constexpr = triton.cdiv(I_R, ROWS)
    G_ROW: tl.constexpr = L // GROUP
    pair = task // TILES
    tile = task % TILES
    token = pair // K
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w1 = w1_ptr + expert * (I_R * G_ROW * WORDS_PER_GROUP)
    w3 = w3_ptr + expert * (I_R * G_ROW * WORDS_PER_GROUP)
    w1_scale = w1_scale_ptr + expert * (I_R * G_ROW)
    w3_scale = w3_scale_ptr + expert * (I_R * G_ROW)
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_ok = rows < I_R
    column = tl.arange(0, MMA_N)
    inputs = tl.arange(0, BLOCK_G * GROUP)
    gate = tl.zeros((ROWS, MMA_N), tl.float32)
    up = tl.zeros((ROWS, MMA_N), tl.float32)
    for g0 in tl.range(0, G_ROW, BLOCK_G):
        groups = g0 + tl.arange(0, BLOCK_G)
        scale_groups = g0 + column
        scale_ok = (column < BLOCK_G) & (scale_groups < G_ROW)
        words1, scales1 = load_mma_tile(w1, w1_scale, groups, groups < G_ROW, scale_groups, scale_ok, rows, row_ok,
                                        G_ROW)
        words3, scales3 = load_mma_tile(w3, w3_scale, groups, groups < G_ROW, scale_groups, scale_ok, rows, row_ok,
                                        G_ROW)
        k = g0 * GROUP + inputs
        z_diag = load_block_diagonal(z_ptr + token * L + k, k < L)
        no_sum = tl.zeros((ROWS, MMA_N), tl.float32)
        gate += dot_acc(e2m1_mma_tile(words1), z_diag, no_sum, UPCAST) * e8m0_scale(scales1)
        up += dot_acc(e2m1_mma_tile(words3), z_diag, no_sum, UPCAST) * e8m0_scale(scales3)
    g = to_bf16(tl.sum(gate, axis=1) * OUT_RESCALE)
    u = to_bf16(tl.sum(up, axis=1) * OUT_RESCALE)
    act = to_bf16(as_f32(to_bf16(situ(as_f32(g), as_f32(u), BETA, LINEAR_BETA))) * ACT_PRESCALE)
    tl.store(act_ptr + pair * I_R + rows, act, mask=row_ok)


@triton.jit
def expert_down_mma_task(
    task,
    act_ptr,  # bf16 [S, K, I_R]: act * 2^63 (expert_gate_up_mma_task)
    ids_ptr,  # int32 [S, K]
    route_w_ptr,  # fp32 [S, K]
    w2_ptr,  # i32 [E, L, I_R/8]: w2 in mma order
    w2_scale_ptr,  # u8 [E, L, I_R/32]
    out_ptr,  # fp32 [S, L] out: this rank's latent partial
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,  # I/T
    ROWS: tl.constexpr,  # latent rows per task
    BLOCK_G: tl.constexpr,  # (slot, group) columns per step, at most MMA_N
    UPCAST: tl.constexpr,  # common.UPCAST_DOT
):
    """expert_down_task on tensor cores: task = (token, tile of ROWS latent
    rows); the K experts' inputs one row of K * I_R/32 group columns, each
    with its own expert's weights, activations and route weight."""
    TILES: tl.constexpr = triton.cdiv(L, ROWS)
    G_ROW: tl.constexpr = I_R // GROUP
    COLS: tl.constexpr = K * G_ROW
    token = task // TILES
    tile = task % TILES
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_ok = rows < L
    column = tl.arange(0, MMA_N)
    inputs = tl.arange(0, BLOCK_G * GROUP)
    acc = tl.zeros((ROWS, MMA_N), tl.float32)
    for c0 in tl.range(0, COLS, BLOCK_G):
        cols = c0 + tl.arange(0, BLOCK_G)
        col_ok = cols < COLS
        # int64: E * L * I_R/2 bytes passes 2^31 at TP1.
        expert = tl.load(ids_ptr + token * K + cols // G_ROW, mask=col_ok, other=0).to(tl.int64)
        scale_cols = c0 + column
        scale_ok = (column < BLOCK_G) & (scale_cols < COLS)
        scale_pair = token * K + scale_cols // G_ROW
        scale_expert = tl.load(ids_ptr + scale_pair, mask=scale_ok, other=0).to(tl.int64)
        words, scales = load_mma_tile((w2_ptr + expert * (L * G_ROW * WORDS_PER_GROUP))[None, :],
                                      (w2_scale_ptr + scale_expert * (L * G_ROW))[None, :], cols % G_ROW, col_ok,
                                      scale_cols % G_ROW, scale_ok, rows, row_ok, G_ROW)
        input_col = c0 + inputs // GROUP
        act_diag = load_block_diagonal(act_ptr + (token * K + input_col // G_ROW) * I_R + (input_col % G_ROW) * GROUP
                                       + inputs % GROUP, input_col < COLS)
        weight = tl.load(route_w_ptr + scale_pair, mask=scale_ok, other=0.0)
        part = dot_acc(e2m1_mma_tile(words), act_diag, tl.zeros((ROWS, MMA_N), tl.float32), UPCAST)
        acc += part * (e8m0_scale(scales) * weight[None, :])
    tl.store(out_ptr + token * L + rows, tl.sum(acc, axis=1) * OUT_RESCALE, mask=row_ok)


@triton.jit
def _expert_gate_up_mma_kernel(
    z_ptr,  # bf16 [S, L]: z * 2^63
    ids_ptr,  # int32 [S, K]
    w1_ptr,  # i32 [E, I_R, L/8]
    w1_scale_ptr,  # u8 [E, I_R, L/32]
    w3_ptr,  # i32 [E, I_R, L/8]
    w3_scale_ptr,  # u8 [E, I_R, L/32]
    act_ptr,  # bf16 [S, K, I_R] out: act * 2^63
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BETA: tl.constexpr,
    LINEAR_BETA: tl.constexpr,
    UPCAST: tl.constexpr,
):
    expert_gate_up_mma_task(tl.program_id(0), z_ptr, ids_ptr, w1_ptr, w1_scale_ptr, w3_ptr, w3_scale_ptr, act_ptr, K,
                            L, I_R, ROWS, BLOCK_G, BETA, LINEAR_BETA, UPCAST)


@triton.jit
def _expert_down_mma_kernel(
    act_ptr,  # bf16 [S, K, I_R]: act * 2^63
    ids_ptr,  # int32 [S, K]
    route_w_ptr,  # fp32 [S, K]
    w2_ptr,  # i32 [E, L, I_R/8]
    w2_scale_ptr,  # u8 [E, L, I_R/32]
    out_ptr,  # fp32 [S, L] out
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    UPCAST: tl.constexpr,
):
    expert_down_mma_task(tl.program_id(0), act_ptr, ids_ptr, route_w_ptr, w2_ptr, w2_scale_ptr, out_ptr, K, L, I_R,
                         ROWS, BLOCK_G, UPCAST)


# -- launchers -------------------------------------------------------------------


def _check_contiguous(stage: str, **tensors) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{stage}: {name} must be contiguous")


def _values_per_element(w_packed) -> int:
    """MXFP4 values an element holds: 8 an int32 word (k3mono.mxfp4.mma_order), 2 a byte."""
    return _MMA_VALUES_PER_WORD if w_packed.dtype == torch.int32 else _PACKING


def _expert_shapes(cfg, w_packed, w_scale, rows: int, cols: int, name: str, mma: bool) -> None:
    E = cfg.num_experts
    if mma:
        if w_packed.dtype != torch.int32:
            raise K3InputError(f"{name}_packed: expected int32 words in mma order (k3mono.mxfp4.mma_order), "
                               f"got {w_packed.dtype}")
        expect_tensor(f"{name}_packed", w_packed, (E, rows, cols // _MMA_VALUES_PER_WORD), torch.int32)
    else:  # int8: the bytes in f16 order (k3mono.mxfp4.f16_order), else the checkpoint's uint8
        in_f16_order = isinstance(w_packed, torch.Tensor) and w_packed.dtype == F16_ORDER_DTYPE
        order = F16_ORDER_DTYPE if in_f16_order else torch.uint8
        expect_tensor(f"{name}_packed", w_packed, (E, rows, cols // _PACKING), order)
    expect_tensor(f"{name}_scale", w_scale, (E, rows, cols // MXFP4_GROUP), torch.uint8)


def _dequant_for(name: str, w_packed, dequant) -> int:
    """The placement a launch compiles: DEQUANT_F16 for int8 bytes in f16 order,
    else ``dequant`` (EXPERT_DEQUANT when None), which must then not be DEQUANT_F16."""
    if w_packed.dtype == F16_ORDER_DTYPE:
        if dequant not in (None, DEQUANT_F16):
            raise K3InputError(f"{name}: int8 bytes in f16 order need dequant DEQUANT_F16, got {dequant!r}")
        return DEQUANT_F16
    if dequant == DEQUANT_F16:
        raise K3InputError(f"{name}: dequant DEQUANT_F16 needs int8 bytes in f16 order (k3mono.mxfp4.f16_order), "
                           f"got {w_packed.dtype}")
    return EXPERT_DEQUANT if dequant is None else dequant


def _rank_intermediate(cfg, name: str, tensor, dim: int) -> int:
    """I/T, read off the shard (the launchers take no T): whole MXFP4 groups dividing I."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
        raise K3InputError(f"{name}: expected a 3-d tensor [E, rows, cols/2] uint8 (or [E, rows, cols/8] int32 "
                           "in mma order)")
    i_r = tensor.shape[dim] * (_values_per_element(tensor) if dim == 2 else 1)
    I = cfg.moe_intermediate_size
    if i_r <= 0 or i_r % MXFP4_GROUP or I % i_r:
        raise K3InputError(f"{name}: {i_r} intermediate values per rank is not I/T in whole groups (I = {I})")
    return i_r


def _gate_up_shapes(cfg, z, route_ids, w1_packed, w1_scale, w3_packed, w3_scale, expert_act, S: int, mma: bool) -> int:
    """Checks the gate/up stage's tensors; returns I/T."""
    K, L = cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    I_R = _rank_intermediate(cfg, "w1_packed", w1_packed, 1)
    expect_tensor("z", z, (S, L), torch.bfloat16)
    expect_tensor("route_ids", route_ids, (S, K), torch.int32)
    _expert_shapes(cfg, w1_packed, w1_scale, I_R, L, "w1", mma)
    _expert_shapes(cfg, w3_packed, w3_scale, I_R, L, "w3", mma)
    expect_tensor("expert_act", expert_act, (S, K, I_R), torch.bfloat16)
    return I_R


def _down_shapes(cfg, expert_act, route_ids, route_w, w2_packed, w2_scale, latent_partial, S: int, mma: bool) -> int:
    """Checks the down stage's tensors; returns I/T."""
    K, L = cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    I_R = _rank_intermediate(cfg, "w2_packed", w2_packed, 2)
    expect_tensor("expert_act", expert_act, (S, K, I_R), torch.bfloat16)
    expect_tensor("route_ids", route_ids, (S, K), torch.int32)
    expect_tensor("route_w", route_w, (S, K), torch.float32)
    _expert_shapes(cfg, w2_packed, w2_scale, L, I_R, "w2", mma)
    expect_tensor("latent_partial", latent_partial, (S, L), torch.float32)
    return I_R


def _block_groups(tile) -> int:
    if tile.block_k % MXFP4_GROUP:
        raise ValueError(f"expert tile block_k {tile.block_k} is not a multiple of the MXFP4 group {MXFP4_GROUP}")
    return tile.block_k // MXFP4_GROUP


EXPERT_DEQUANT = DEFAULT_DEQUANT
"""The MXFP4 placement the launchers compile for the checkpoint's bytes
(kernels/mxfp4.py: DEQUANT_SHIFT = 0, DEQUANT_IMAD = 1) unless given
``dequant=``; set this module attribute to time both placements in one run
(each value compiles its own kernel). Bytes in f16 order (int8) always take
DEQUANT_F16."""

EXPERT_STAGES = PIPELINE_STAGES.value
EXPERT_UNROLL = LOOP_UNROLL.value
"""The hot loops' pipeline depth and unroll factor the launchers compile (set
them, as EXPERT_DEQUANT, to time other loop shapes in one run)."""


def launch_expert_gate_up(
    z, route_ids, w1_packed, w1_scale, w3_packed, w3_scale, expert_act, geom, cfg, dequant=None
) -> None:
    """z [S, L] bf16, route_ids [S, K] int32, w1/w3 shards -> expert_act [S, K, I/T] bf16."""
    S, K, L = geom.tokens, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    I_R = _gate_up_shapes(cfg, z, route_ids, w1_packed, w1_scale, w3_packed, w3_scale, expert_act, S, mma=False)
    if w1_packed.dtype != w3_packed.dtype:
        raise K3InputError(f"w3_packed: expected {w1_packed.dtype} as w1_packed, got {w3_packed.dtype}")
    dequant = _dequant_for("w1_packed", w1_packed, dequant)
    _check_contiguous(
        "launch_expert_gate_up",
        z=z,
        route_ids=route_ids,
        w1_packed=w1_packed,
        w1_scale=w1_scale,
        w3_packed=w3_packed,
        w3_scale=w3_scale,
        expert_act=expert_act,
    )
    tile = geom.expert_gate_up
    grid = (S * K * triton.cdiv(I_R, tile.rows),)
    _expert_gate_up_kernel[grid](
        z,
        route_ids,
        w1_packed,
        w1_scale,
        w3_packed,
        w3_scale,
        expert_act,
        K=K,
        L=L,
        I_R=I_R,
        ROWS=tile.rows,
        BLOCK_G=_block_groups(tile),
        BETA=cfg.situ_beta,
        LINEAR_BETA=cfg.situ_linear_beta,
        DEQUANT=dequant,
        STAGES=EXPERT_STAGES,
        UNROLL=EXPERT_UNROLL,
        LOOKAHEAD=tile.lookahead,
        num_warps=tile.warps,
    )


def launch_expert_down(
    expert_act, route_ids, route_w, w2_packed, w2_scale, latent_partial, geom, cfg, dequant=None
) -> None:
    """expert_act [S, K, I/T] bf16, routes, w2 shard -> latent_partial [S, L] fp32 (unrounded)."""
    S, K, L = geom.tokens, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    I_R = _down_shapes(cfg, expert_act, route_ids, route_w, w2_packed, w2_scale, latent_partial, S, mma=False)
    dequant = _dequant_for("w2_packed", w2_packed, dequant)
    _check_contiguous(
        "launch_expert_down",
        expert_act=expert_act,
        route_ids=route_ids,
        route_w=route_w,
        w2_packed=w2_packed,
        w2_scale=w2_scale,
        latent_partial=latent_partial,
    )
    tile = geom.expert_down
    grid = (S * triton.cdiv(L, tile.rows),)
    _expert_down_kernel[grid](
        expert_act,
        route_ids,
        route_w,
        w2_packed,
        w2_scale,
        latent_partial,
        K=K,
        L=L,
        I_R=I_R,
        ROWS=tile.rows,
        BLOCK_G=_block_groups(tile),
        DEQUANT=dequant,
        STAGES=EXPERT_STAGES,
        UNROLL=EXPERT_UNROLL,
        LOOKAHEAD=tile.lookahead,
        num_warps=tile.warps,
    )


def launch_expert_gate_up_mma(z_prescaled, route_ids, w1_words, w1_scale, w3_words, w3_scale, act_prescaled, tokens,
                              cfg) -> None:
    """The gate/up stage on tensor cores: z * 2^63 [S, L] bf16, route_ids [S, K]
    int32, w1/w3 in mma order (k3mono.mxfp4.mma_order: int32 [E, I/T, L/8]) and
    their scales -> act * 2^63 [S, K, I/T] bf16 (exact: launch_expert_down_mma's input)."""
    S, K, L = tokens, cfg.num_experts_per_token, cfg.routed_expert_hidden_size
    I_R = _gate_up_shapes(cfg, z_prescaled, route_ids, w1_words, w1_scale, w3_words, w3_scale, act_prescaled, S,
                          mma=True)
    _check_contiguous("launch_expert_gate_up_mma", z_prescaled=z_prescaled, route_ids=route_ids, w1_words=w1_words,
                      w1_scale=w1_scale, w3_words=w3_words, w3_scale=w3_scale, act_prescaled=act_prescaled)
    tile = expert_mma_tile(I_R)
    _expert_gate_up_mma_kernel[(S * K * triton.cdiv(I_R, tile.rows),)](
        z_prescaled, route_ids, w1_words, w1_scale, w3_words, w3_scale, act_prescaled, K=K, L=L, I_R=I_R,
        ROWS=tile.rows, BLOCK_G=_block_groups(tile), BETA=cfg.situ_beta, LINEAR_BETA=cfg.situ_linear_beta,
        UPCAST=UPCAST_DOT, num_warps=tile.warps)


def launch_expert_down_mma(act_prescaled, route_ids, route_w, w2_words, w2_scale, latent_partial, tokens,
                           cfg) -> None:
    """The down stage on tensor cores: act * 2^63 [S, K, I/T] bf16
    (launch_expert_gate_up_mma's output), routes, w2 in mma order (int32
    [E, L, I/T/8]) and its scales -> latent_partial [S, L] fp32 (unrounded)."""
    S, L = tokens, cfg.routed_expert_hidden_size
    I_R = _down_shapes(cfg, act_prescaled, route_ids, route_w, w2_words, w2_scale, latent_partial, S, mma=True)
    _check_contiguous("launch_expert_down_mma", act_prescaled=act_prescaled, route_ids=route_ids, route_w=route_w,
                      w2_words=w2_words, w2_scale=w2_scale, latent_partial=latent_partial)
    tile = expert_mma_tile(L)
    _expert_down_mma_kernel[(S * triton.cdiv(L, tile.rows),)](
        act_prescaled, route_ids, route_w, w2_words, w2_scale, latent_partial, K=cfg.num_experts_per_token, L=L,
        I_R=I_R, ROWS=tile.rows, BLOCK_G=_block_groups(tile), UPCAST=UPCAST_DOT, num_warps=tile.warps)
