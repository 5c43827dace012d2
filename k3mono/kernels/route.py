"""Stage: route (top-K expert selection per token), after AG1.

Shapes: S tokens, E experts (E_PAD = next power of two), K experts per token
(K_PAD = next power of two), RC = geom.route_chunk experts a part, P = ceil(E / RC).

    sc      = sigmoid(logits)                                  [S, E] fp32
    chosen  = the K largest of sc + bias, ties to the lower id (bias only selects)
    ids     = chosen, ascending                                [S, K] int32
    w       = sc[ids] / (sum(sc[ids]) + 1e-20) * routed_scaling_factor   [S, K] fp32

Equal to reference.stages.select_experts / route: a stable descending sort
takes the lower id among equal scores, and so does the packed key below.

Two steps. Each expert's biased score becomes one int64 key: the score's fp32
bits made order-preserving as a signed int32 (negative values have their
magnitude bits flipped) in the high half, E_PAD - 1 - id in the low half, so
keys are distinct, order by score, and among equal scores the lower id has the
larger key. ``route_part_task`` (token, part): ``tl.topk`` (a bitonic top-K)
keeps the K_PAD largest keys of RC experts, and beside them their experts'
unbiased scores; ``route_merge_task`` (token): the K_PAD largest of every
part's, whose first K hold the chosen ids (distinct keys: the largest of a
union are the largest of its parts' largest), which ``tl.sort`` puts in
ascending order (padding slots hold E_PAD and sort last). The weights take the
chosen experts' scores from the parts' rows, loaded with the keys: a second
load of the logits at the chosen ids was a memory round trip after the sort on
the path from the router to the experts (ROUTE ran 2.5 us a task in the S = 1
trace of cfd5a34). The merge moves each candidate's place in that row into its
key, below the id (ids are distinct, so the order stays), and the top-K and the
sort then carry the chosen experts' places to ``tl.gather``: the scores keep
route_part_task's bits. A sort of
RC = 128 keys a CTA instead of all 1024 in one (E = 896): the one-CTA route
took 8 to 14 us of the mono launch at S = 1 (its trace), against 4.4 for the
staged kernel, on the path from the router to the experts. A biased score is
never -0 (sigmoid > 0 and x + y is -0 only for two -0s), so +0 and -0 never
tie in the float order while differing in the key.
Every rank routes the same gathered logits, so every rank gets the same ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import expect_tensor
from ..layout import ROUTE_PART_ROWS
from .common import sigmoid

RENORM_EPS = tl.constexpr(1e-20)  # k3-math.md: w = sc[idx] / (sum(sc[idx]) + 1e-20)
ID_BITS = tl.constexpr(32)  # a key's low half holds E_PAD - 1 - id
ID_MASK = tl.constexpr(0xFFFFFFFF)
MAGNITUDE_BITS = tl.constexpr(0x7FFFFFFF)
SIGN_SPREAD = tl.constexpr(31)  # arithmetic shift: all ones for a negative fp32, zeros otherwise
KEY_FLOOR = tl.constexpr(-(2**63))  # below every key: pads the merge's candidates
PART_ROWS = tl.constexpr(ROUTE_PART_ROWS)  # a part's keys, then their scores


@triton.jit
def ordered_bits(x):
    """fp32 (no NaN) -> int32 in the same order: negative values' magnitude bits flipped."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> SIGN_SPREAD) & MAGNITUDE_BITS)


@triton.jit
def _key_id(
    keys,  # int64 keys
    E_PAD: tl.constexpr,
):
    """int32 expert id of each key."""
    return (E_PAD - 1) - (keys & ID_MASK).to(tl.int32)


@triton.jit
def route_part_task(
    token,
    part,
    logits_ptr,  # fp32 [S, E]
    bias_ptr,  # fp32 [E]
    keys_ptr,  # int64 [S, P, PART_ROWS, K_PAD] out: each part's largest keys, descending, then their scores
    E: tl.constexpr,
    K: tl.constexpr,
    E_PAD: tl.constexpr,  # next power of two >= E
    RC: tl.constexpr,  # experts a part covers (planner.route_chunk)
):
    """Row 0 of the part's [PART_ROWS, K_PAD]: its K_PAD largest keys; row 1:
    their experts' sigmoid scores, fp32 bits in int64 (padding experts' 0.5)."""
    K_PAD: tl.constexpr = triton.next_power_of_2(K)  # tl.topk takes a power of two
    P: tl.constexpr = triton.cdiv(E, RC)
    experts = part * RC + tl.arange(0, RC)
    real = experts < E
    scores = sigmoid(tl.load(logits_ptr + token * E + experts, mask=real, other=0.0))
    bias = tl.load(bias_ptr + experts, mask=real, other=0.0)
    candidates = tl.where(real, scores + bias, -float("inf"))  # padding below every real candidate (K <= E)
    keys = (ordered_bits(candidates).to(tl.int64) << ID_BITS) | (E_PAD - 1 - experts).to(tl.int64)
    top = tl.topk(keys, K_PAD)
    top_scores = tl.gather(scores, _key_id(top, E_PAD) - part * RC, 0)
    row = keys_ptr + (token * P + part) * (PART_ROWS * K_PAD) + tl.arange(0, K_PAD)
    tl.store(row, top)
    tl.store(row + K_PAD, top_scores.to(tl.int32, bitcast=True).to(tl.int64))


@triton.jit
def route_merge_task(
    token,
    keys_ptr,  # int64 [S, P, PART_ROWS, K_PAD]: every route_part_task of the token
    ids_ptr,  # int32 [S, K] out, ascending per token
    weights_ptr,  # fp32 [S, K] out, ids order
    scaling,  # fp32 routed_scaling_factor
    E: tl.constexpr,
    K: tl.constexpr,
    E_PAD: tl.constexpr,
    RC: tl.constexpr,
):
    """The candidates' places ride in their keys, below the ids (distinct ids
    keep the order), so the top-K and the sort by id carry each chosen
    expert's place, where tl.gather finds its score."""
    K_PAD: tl.constexpr = triton.next_power_of_2(K)
    P: tl.constexpr = triton.cdiv(E, RC)
    N: tl.constexpr = triton.next_power_of_2(P * K_PAD)
    PLACE_BITS: tl.constexpr = N.bit_length() - 1
    tl.static_assert(E_PAD * N <= 2**31, "an id and a place share a key's low 32 bits")
    n = tl.arange(0, N)
    real = n < P * K_PAD
    part_keys = keys_ptr + token * (P * PART_ROWS * K_PAD) + (n // K_PAD) * (PART_ROWS * K_PAD) + n % K_PAD
    keys = tl.load(part_keys, mask=real, other=KEY_FLOOR)
    scores = tl.load(part_keys + K_PAD, mask=real, other=0).to(tl.int32).to(tl.float32, bitcast=True)
    placed = ((keys >> ID_BITS) << ID_BITS) | ((keys & ID_MASK) << PLACE_BITS) | n.to(tl.int64)
    top = tl.topk(placed, K_PAD)  # descending
    slot = tl.arange(0, K_PAD)
    live = slot < K
    place = (top & (N - 1)).to(tl.int32)
    expert = (E_PAD - 1) - ((top & ID_MASK) >> PLACE_BITS).to(tl.int32)
    by_id = tl.sort(tl.where(live, (expert << PLACE_BITS) | place, E_PAD << PLACE_BITS))
    ids = by_id >> PLACE_BITS
    chosen = tl.gather(scores, by_id & (N - 1), 0)
    total = tl.sum(tl.where(live, chosen, 0.0), axis=0)
    weights = chosen / (total + RENORM_EPS) * scaling
    tl.store(ids_ptr + token * K + slot, ids, mask=live)
    tl.store(weights_ptr + token * K + slot, weights, mask=live)


@triton.jit
def _route_part_kernel(
    logits_ptr,  # fp32 [S, E]
    bias_ptr,  # fp32 [E]
    keys_ptr,  # int64 [S, P, PART_ROWS, K_PAD] out
    E: tl.constexpr,
    K: tl.constexpr,
    E_PAD: tl.constexpr,
    RC: tl.constexpr,
):
    route_part_task(tl.program_id(0), tl.program_id(1), logits_ptr, bias_ptr, keys_ptr, E, K, E_PAD, RC)


@triton.jit
def _route_merge_kernel(
    keys_ptr,  # int64 [S, P, PART_ROWS, K_PAD]
    ids_ptr,  # int32 [S, K] out
    weights_ptr,  # fp32 [S, K] out
    scaling,  # fp32
    E: tl.constexpr,
    K: tl.constexpr,
    E_PAD: tl.constexpr,
    RC: tl.constexpr,
):
    route_merge_task(tl.program_id(0), keys_ptr, ids_ptr, weights_ptr, scaling, E, K, E_PAD, RC)


def launch_route(logits, bias, route_ids, route_w, route_keys, geom, cfg) -> None:
    """logits [S, E] fp32, bias [E] fp32 -> route_ids [S, K] int32, route_w [S, K] fp32;
    route_keys [S, P, PART_ROWS, K_PAD] int64 the parts' keys and scores (layout.scratch_layout). Two
    launches: a program per (token, part), then one per token."""
    S, E, K = geom.tokens, cfg.num_experts, cfg.num_experts_per_token
    parts = triton.cdiv(E, geom.route_chunk)
    expect_tensor("logits", logits, (S, E), torch.float32)
    expect_tensor("router_bias", bias, (E,), torch.float32)
    expect_tensor("route_ids", route_ids, (S, K), torch.int32)
    expect_tensor("route_w", route_w, (S, K), torch.float32)
    expect_tensor("route_keys", route_keys, (S, parts, ROUTE_PART_ROWS, triton.next_power_of_2(K)), torch.int64)
    for name, t in (("logits", logits), ("router_bias", bias), ("route_ids", route_ids), ("route_w", route_w),
                    ("route_keys", route_keys)):
        if not t.is_contiguous():
            raise ValueError(f"launch_route: {name} must be contiguous")
    shape = dict(E=E, K=K, E_PAD=triton.next_power_of_2(E), RC=geom.route_chunk, num_warps=geom.vector_warps)
    _route_part_kernel[(S, parts)](logits, bias, route_keys, **shape)
    _route_merge_kernel[(S,)](route_keys, route_ids, route_w, float(cfg.routed_scaling_factor), **shape)
