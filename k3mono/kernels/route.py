"""Stage: route (top-K expert selection per token), after AG1.

Shapes: S tokens, E experts (EP = next power of two), K experts per token.

    sc      = sigmoid(logits)                                  [S, E] fp32
    chosen  = the K largest of sc + bias, ties to the lower id (bias only selects)
    ids     = chosen, ascending                                [S, K] int32
    w       = sc[ids] / (sum(sc[ids]) + 1e-20) * routed_scaling_factor   [S, K] fp32

Equal to reference.stages.select_experts / route: a stable descending sort
takes the lower id among equal scores, and so does tl.argmax
(tie_break_left=True, Triton 3.6: on equal values the lower index wins).

One task per token: K rounds of argmax, each marking its winner; the marks
are then written in id order, the store position of a marked expert being
the number of marked experts up to it (an inclusive cumsum, minus one).
Every rank routes the same gathered logits, so every rank gets the same ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import expect_tensor
from .common import sigmoid

RENORM_EPS = tl.constexpr(1e-20)  # k3-math.md: w = sc[idx] / (sum(sc[idx]) + 1e-20)


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
    # Padding and chosen experts sit at -inf so argmax never returns them
    # while a real candidate is left (K <= E).
    candidates = tl.where(real, scores + bias, -float("inf"))
    chosen = tl.zeros((E_PAD,), tl.int1)
    for _ in tl.static_range(K):
        best = tl.argmax(candidates, axis=0, tie_break_left=True)
        won = experts == best
        chosen = chosen | won
        candidates = tl.where(won, -float("inf"), candidates)
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
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
        num_warps=geom.vector_warps,
    )
