"""The bytes one rank's layer_post launch must read: the memory floor.

floor time = ``floor_bytes(...)["total"]`` / the copy bandwidth measured in the
same run. Each weight byte is counted once (the rank's shards, k3mono.weights),
the routed experts' slices for ``unique_experts`` distinct experts, plus the
activations the launch reads: its heads of ``core``, ``prefix``, the AttnRes
``blocks`` and the peer regions the exchanges land in (layout.peer_layout; the
launch reads all of each, its own slot included). Writes and the scratch
round trips (x, activations, latent) are not counted: they stay in L2.
On an MLA layer whose launch runs M1b (``m1b``, a planner.M1bShape) the rank's
w_v is a weight, M1c's split outputs o and lse and the gate are activations,
and core is one of those scratch round trips. When M1c runs before it
(``m1c``, a planner.M1cShape) q and the cache rows of the requests' contexts
(``context`` positions in all, each read once) are activations instead of o
and lse, which become a scratch round trip too (the request layout's few
int32 words are not counted).

Shapes: S tokens, H hidden, C core width, T ranks, nb AttnRes blocks.
"""

from __future__ import annotations

import math

from .config import MAX_TOKENS, K3Config
from .errors import K3InputError
from .layout import PEER_REGIONS, peer_layout
from .planner import M1bShape, M1cShape
from .weights import shard_shapes

EXPERT_TENSORS = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")
"""Per-expert weights: only the routed experts' slices are read."""

BF16_BYTES = 2


def _tensor_bytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def default_unique_experts(cfg: K3Config, tokens: int) -> int:
    """Distinct experts S tokens touch at most: every (token, slot) its own."""
    return min(tokens * cfg.num_experts_per_token, cfg.num_experts)


def deepest_nblocks(cfg: K3Config) -> int:
    """nb of the last layer: the most AttnRes blocks any layer reads."""
    return cfg.num_blocks(cfg.num_hidden_layers - 1)


def weight_bytes(cfg: K3Config, tp: int, unique_experts: int, m1b: M1bShape | None = None) -> dict[str, int]:
    """name -> bytes of one rank's weights the launch reads (weights.py field names; w_v with m1b)."""
    out = {}
    for name, (shape, dtype) in shard_shapes(cfg, tp).items():
        nbytes = _tensor_bytes(shape, dtype)
        if name in EXPERT_TENSORS:
            nbytes = nbytes // cfg.num_experts * unique_experts
        if name == "latent_norm":  # replicated; a rank normalises its L/T columns only
            nbytes //= tp
        out[name] = nbytes
    if m1b is not None:  # w_v [heads/T, v_head_dim, DL]
        out["w_v"] = cfg.num_attention_heads // tp * cfg.v_head_dim * m1b.latent * (1 if m1b.w_v_fp8 else BF16_BYTES)
    return out


def activation_bytes(cfg: K3Config, tp: int, tokens: int, nblocks: int, m1b: M1bShape | None = None,
                     m1c: M1cShape | None = None, context: int = 0) -> dict[str, int]:
    """name -> bytes of the activations one rank's launch reads."""
    S, H, heads = tokens, cfg.hidden_size, cfg.num_attention_heads // tp
    if m1b is None:
        out = {"core": S * (cfg.core_width // tp) * BF16_BYTES}  # the rank's heads
    elif m1c is not None:
        dqk = m1b.latent + m1c.rope
        out = {
            "q": S * heads * dqk * BF16_BYTES,
            "kv": context * dqk * (1 if m1c.kv_fp8 else BF16_BYTES),
            "gate": S * (cfg.core_width // tp) * BF16_BYTES,
        }
    else:
        out = {
            "o": m1b.splits * S * heads * m1b.latent * 4,  # fp32
            "lse": m1b.splits * S * heads * 4,
            "gate": S * (cfg.core_width // tp) * BF16_BYTES,
        }
    out["prefix"] = S * H * BF16_BYTES
    out["blocks"] = S * nblocks * H * BF16_BYTES
    layout = peer_layout(cfg, tp, tokens)
    for name in PEER_REGIONS:
        _, shape, dtype = layout[name]
        out[name] = _tensor_bytes(shape, dtype)
    return out


def floor_bytes(
    cfg: K3Config, tp: int, tokens: int, unique_experts: int | None = None, *, nblocks: int | None = None,
    m1b: M1bShape | None = None, m1c: M1cShape | None = None, context: int | None = None,
) -> dict:
    """The bytes one rank's launch must read.

    unique_experts: distinct routed experts (default ``min(S*K, E)``; the
    planner plans every (token, slot) as distinct, so it matches ``S*K``).
    nblocks: AttnRes blocks of the layer (``cfg.num_blocks(layer)``; default
    the deepest layer's, the largest). m1b: the launch runs M1b, m1c: M1c too,
    over ``context`` cache positions (the sum of the requests' seq_lens; required
    with m1c) (module docstring).

    Returns {"weights": {name: bytes}, "activations": {name: bytes},
    "weight_bytes", "activation_bytes", "total"}.
    """
    if not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise K3InputError(f"tokens: expected an integer in 1..{MAX_TOKENS}, got {tokens!r}")
    cfg.validate_tp(tp)
    unique_experts = default_unique_experts(cfg, tokens) if unique_experts is None else unique_experts
    if not isinstance(unique_experts, int) or unique_experts < 0:
        raise K3InputError(f"unique_experts: expected a non-negative integer, got {unique_experts!r}")
    nblocks = deepest_nblocks(cfg) if nblocks is None else nblocks
    if not isinstance(nblocks, int) or nblocks < 1:
        raise K3InputError(f"nblocks: expected a positive integer, got {nblocks!r}")
    if m1c is not None and (m1b is None or not isinstance(context, int) or context < 1):
        raise K3InputError(f"context: M1c (with M1b) reads a positive number of cache positions, got {context!r}")
    weights = weight_bytes(cfg, tp, unique_experts, m1b)
    activations = activation_bytes(cfg, tp, tokens, nblocks, m1b, m1c, context or 0)
    return {
        "weights": weights,
        "activations": activations,
        "weight_bytes": sum(weights.values()),
        "activation_bytes": sum(activations.values()),
        "total": sum(weights.values()) + sum(activations.values()),
    }


def floor_seconds(floor: dict, bytes_per_second: float) -> float:
    """The floor time at a measured copy bandwidth."""
    return floor["total"] / bytes_per_second
