"""Stage: route (top-K expert selection per token), after AG1.

Shapes: S tokens, E experts (EP = next power of two), K experts per token.

    sc      = sigmoid(logits)                                  [S, E] fp32
    chosen  = the K largest of sc + bias, ties to the lower id (bias only selects)
    ids     = chosen, ascending                                [S, K] int32
    w       = sc[ids] / (sum(sc[ids]) + 1e-20) * routed_scaling_factor   [S, K] fp32

Equal to reference.stages.select_experts / route: a stable descending sort
takes the lower id among equal scores.

One task per token, with few block-wide steps (the task is on the launch's
critical path, so its latency is the number of dependent reductions, not
work): the biased scores become order-preserving uint32 keys; the K-th largest
key thr is found 4 bits at a time from the top (8 rounds, each one packed
reduction of 15 counts); the chosen experts are the keys above thr plus, among
the keys equal to it, the lowest ids (ties to the lower id, exactly as the
reference's stable sort). One scan in id order counts both kinds and gives each
chosen expert its store position. (K rounds of argmax took 16 dependent
block-wide (value, index) reductions.)
Every rank routes the same gathered logits, so every rank gets the same ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import expect_tensor
from .common import INTERPRET, sigmoid

RENORM_EPS = tl.constexpr(1e-20)  # k3-math.md: w = sc[idx] / (sum(sc[idx]) + 1e-20)
_SIGN = tl.constexpr(0x80000000)
_ALL_BITS = tl.constexpr(0xFFFFFFFF)
_KEY_BITS = tl.constexpr(32)
_DIGIT_BITS = tl.constexpr(4)
_ONE_REDUCE = tl.constexpr(not INTERPRET)


@triton.jit
def _at_least(key, thr, d: tl.constexpr, shift: tl.constexpr):
    """[E_PAD] int32: 1 where key >= thr + d * 2^shift (the trial of digit d)."""
    return (key >= (thr | (d << shift))).to(tl.int32)


@triton.jit
def _pair(key, thr, d: tl.constexpr, shift: tl.constexpr):
    """The indicators of digits d (low 16 bits) and d + 1 (high 16 bits), packed."""
    return _at_least(key, thr, d, shift) | (_at_least(key, thr, d + 1, shift) << 16)


@triton.jit
def _keeps(packed, K: tl.constexpr):
    """How many of the (at most two) counts packed in ``packed`` are >= K."""
    return ((packed & 0xFFFF) >= K).to(tl.int32) + ((packed >> 16) >= K).to(tl.int32)


@triton.jit
def _add8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5, a6 + b6, a7 + b7


@triton.jit
def route_task(
    token,
    logits_ptr,  # fp32 [S, E]
    bias_ptr,  # fp32 [E]
    ids_ptr,  # int32 [S, K] out, ascending per token
    weights_ptr,  # fp32 [S, K] out, ids order
    scaling,  # fp32 routed_scaling_factor
    E: tl.constexpr,
    K: tl.constexpr,
    E_PAD: tl.constexpr,  # next power of two >= E
):
    experts = tl.arange(0, E_PAD)
    real = experts < E
    scores = sigmoid(tl.load(logits_ptr + token * E + experts, mask=real, other=0.0))
    bias = tl.load(bias_ptr + experts, mask=real, other=0.0)
    biased = scores + bias
    # Order-preserving unsigned key of the biased score: flip every bit of a
    # negative, set the sign bit of a positive; -0.0 counts as +0.0 (they tie,
    # as in the reference's float sort). Padding gets 0, below every real key
    # (a real key is at least that of -inf, 0x007FFFFF).
    bits = tl.where(biased == 0.0, 0.0, biased).to(tl.uint32, bitcast=True)
    key = tl.where((bits & _SIGN) != 0, bits ^ _ALL_BITS, bits | _SIGN)
    key = tl.where(real, key, 0)
    # thr = the K-th largest key, found digit by digit from the top: the
    # largest value with count(key >= thr) >= K. Each round tries the 16
    # values of the next 4 bits at once and keeps the largest that still has
    # K keys at or above it (count is nonincreasing in the digit, and digit 0,
    # thr itself, keeps K by induction). The 15 counts of a round are one
    # block-wide reduction: packed two to an int32 (16 bits each: counts are
    # at most E_PAD <= 65535), eight operands of one tl.reduce, so a round
    # costs one pass through shared memory, not fifteen.
    thr = tl.zeros((), dtype=tl.uint32)
    for r in tl.static_range(_KEY_BITS // _DIGIT_BITS):
        shift = _KEY_BITS - _DIGIT_BITS * (r + 1)
        p0 = _pair(key, thr, 1, shift)
        p1 = _pair(key, thr, 3, shift)
        p2 = _pair(key, thr, 5, shift)
        p3 = _pair(key, thr, 7, shift)
        p4 = _pair(key, thr, 9, shift)
        p5 = _pair(key, thr, 11, shift)
        p6 = _pair(key, thr, 13, shift)
        p7 = _at_least(key, thr, 15, shift)
        if _ONE_REDUCE:
            c0, c1, c2, c3, c4, c5, c6, c7 = tl.reduce((p0, p1, p2, p3, p4, p5, p6, p7), 0, _add8)
        else:  # the interpreter runs a combine function element by element: the same sums, one at a time
            c0 = tl.sum(p0, axis=0)
            c1 = tl.sum(p1, axis=0)
            c2 = tl.sum(p2, axis=0)
            c3 = tl.sum(p3, axis=0)
            c4 = tl.sum(p4, axis=0)
            c5 = tl.sum(p5, axis=0)
            c6 = tl.sum(p6, axis=0)
            c7 = tl.sum(p7, axis=0)
        best = (
            _keeps(c0, K) + _keeps(c1, K) + _keeps(c2, K) + _keeps(c3, K)
            + _keeps(c4, K) + _keeps(c5, K) + _keeps(c6, K) + _keeps(c7, K)
        )
        thr = thr | (best.to(tl.uint32) << shift)
    # Chosen: every key above thr, and the lowest ids among those equal to it
    # (ties to the lower id), K in all. One scan counts both in id order: the
    # low half the keys above, the high half the keys equal.
    above = key > thr
    level = key == thr
    need = K - tl.sum(above.to(tl.int32), axis=0)
    run = tl.cumsum(above.to(tl.int32) + (level.to(tl.int32) << 16), axis=0)
    n_above = run & 0xFFFF
    n_level = run >> 16
    chosen = above | (level & (n_level <= need))
    slot = n_above + tl.minimum(n_level, need) - 1  # chosen experts up to and including this one, less one
    total = tl.sum(tl.where(chosen, scores, 0.0), axis=0)
    weights = scores / (total + RENORM_EPS) * scaling
    tl.store(ids_ptr + token * K + slot, experts, mask=chosen)
    tl.store(weights_ptr + token * K + slot, weights, mask=chosen)


@triton.jit
def _route_kernel(
    logits_ptr,  # fp32 [S, E]
    bias_ptr,  # fp32 [E]
    ids_ptr,  # int32 [S, K] out
    weights_ptr,  # fp32 [S, K] out
    scaling,  # fp32
    E: tl.constexpr,
    K: tl.constexpr,
    E_PAD: tl.constexpr,
):
    route_task(tl.program_id(0), logits_ptr, bias_ptr, ids_ptr, weights_ptr, scaling, E, K, E_PAD)


def launch_route(logits, bias, route_ids, route_w, geom, cfg) -> None:
    """logits [S, E] fp32, bias [E] fp32 -> route_ids [S, K] int32, route_w [S, K] fp32."""
    S, E, K = geom.tokens, cfg.num_experts, cfg.num_experts_per_token
    expect_tensor("logits", logits, (S, E), torch.float32)
    expect_tensor("router_bias", bias, (E,), torch.float32)
    expect_tensor("route_ids", route_ids, (S, K), torch.int32)
    expect_tensor("route_w", route_w, (S, K), torch.float32)
    for name, t in (("logits", logits), ("router_bias", bias), ("route_ids", route_ids), ("route_w", route_w)):
        if not t.is_contiguous():
            raise ValueError(f"launch_route: {name} must be contiguous")
    _route_kernel[(S,)](
        logits,
        bias,
        route_ids,
        route_w,
        float(cfg.routed_scaling_factor),
        E=E,
        K=K,
        E_PAD=triton.next_power_of_2(E),
        num_warps=geom.route_warps,
    )
