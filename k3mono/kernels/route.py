"""Stage: route (top-K expert selection per token), after AG1.

Shapes: S tokens, E experts (EP = next power of two), K experts per token.

    sc      = sigmoid(logits)                                  [S, E] fp32
    chosen  = the K largest of sc + bias, ties to the lower id (bias only selects)
    ids     = chosen, ascending                                [S, K] int32
    w       = sc[ids] / (sum(sc[ids]) + 1e-20) * routed_scaling_factor   [S, K] fp32

Equal to reference.stages.select_experts / route: a stable descending sort
takes the lower id among equal scores, and so does the packed key below.

One task per token. Each expert's biased score becomes one int64 key: the
score's fp32 bits made order-preserving as a signed int32 (negative values
have their magnitude bits flipped) in the high half, E_PAD - 1 - id in the
low half, so keys are distinct, order by score, and among equal scores the
lower id has the larger key. ``tl.topk`` (a bitonic top-K) returns the K_PAD
largest keys; the first K hold the chosen ids, which ``tl.sort`` puts in
ascending order (padding slots hold E_PAD and sort last). The weights read
the chosen experts' logits again (one cached load of K values). Beside K
rounds of block-wide argmax this is about two thirds of the instructions and
a sixth of the barriers (sm_90a build, E = 896, K = 16: 2192 instructions and
9 barriers against 3368 and 56), on the path from the router to the experts.
A biased score is never -0 (sigmoid > 0 and x + y is -0 only for two -0s),
so +0 and -0 never tie in the float order while differing in the key.
Every rank routes the same gathered logits, so every rank gets the same ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import expect_tensor
from .common import sigmoid

RENORM_EPS = tl.constexpr(1e-20)  # k3-math.md: w = sc[idx] / (sum(sc[idx]) + 1e-20)
ID_BITS = tl.constexpr(32)  # a key's low half holds E_PAD - 1 - id
ID_MASK = tl.constexpr(0xFFFFFFFF)
MAGNITUDE_BITS = tl.constexpr(0x7FFFFFFF)
SIGN_SPREAD = tl.constexpr(31)  # arithmetic shift: all ones for a negative fp32, zeros otherwise


@triton.jit
def ordered_bits(x):
    """fp32 (no NaN) -> int32 in the same order: negative values' magnitude bits flipped."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> SIGN_SPREAD) & MAGNITUDE_BITS)


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
    K_PAD: tl.constexpr = triton.next_power_of_2(K)  # tl.topk takes a power of two
    experts = tl.arange(0, E_PAD)
    real = experts < E
    logits = logits_ptr + token * E
    scores = sigmoid(tl.load(logits + experts, mask=real, other=0.0))
    bias = tl.load(bias_ptr + experts, mask=real, other=0.0)
    # Padding sits at -inf: below every real candidate (K <= E).
    candidates = tl.where(real, scores + bias, -float("inf"))
    keys = (ordered_bits(candidates).to(tl.int64) << ID_BITS) | (E_PAD - 1 - experts).to(tl.int64)
    top = tl.topk(keys, K_PAD)  # descending
    slot = tl.arange(0, K_PAD)
    live = slot < K
    ids = tl.sort(tl.where(live, (E_PAD - 1) - (top & ID_MASK).to(tl.int32), E_PAD))
    chosen = sigmoid(tl.load(logits + ids, mask=live, other=0.0))
    total = tl.sum(tl.where(live, chosen, 0.0), axis=0)
    weights = chosen / (total + RENORM_EPS) * scaling
    tl.store(ids_ptr + token * K + slot, ids, mask=live)
    tl.store(weights_ptr + token * K + slot, weights, mask=live)


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
        num_warps=geom.vector_warps,
    )
