"""Checks on one layer_post call's activations, shared by every implementation.

Shapes: core [S, C] bf16, prefix [S, H] bf16, blocks [S, nb_max, H] bf16 with
nb_max >= nb = floor(layer / attn_res_block_size) + 1, 1 <= S <= MAX_TOKENS.
"""

from __future__ import annotations

import torch

from .config import MAX_TOKENS, K3Config
from .errors import K3InputError, expect_tensor


def check_tokens(tokens: int) -> None:
    if tokens > MAX_TOKENS:
        raise K3InputError(f"too many tokens: expected at most {MAX_TOKENS}, got {tokens}")
    if tokens < 1:
        raise K3InputError(f"expected at least 1 token, got {tokens}")


def _shape(t) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def check_layer_inputs(cfg: K3Config, layer: int, core, prefix, blocks, *, core_dtype=torch.bfloat16) -> int:
    """Raise a K3InputError on any wrong shape, dtype or count; return S. ``core_dtype``:
    float64 only for the oracle's exact core (reference.layer.layer_post)."""
    cfg.validate_layer(layer)
    C, H = cfg.core_width, cfg.hidden_size
    if not isinstance(core, torch.Tensor) or core.dim() != 2 or core.shape[1] != C:
        raise K3InputError(f"core: expected shape [S, {C}], got {_shape(core)}")
    tokens = core.shape[0]
    check_tokens(tokens)
    expect_tensor("core", core, (tokens, C), core_dtype)
    expect_tensor("prefix", prefix, (tokens, H), torch.bfloat16)
    check_blocks(cfg, layer, blocks, tokens)
    return tokens


def check_blocks(cfg: K3Config, layer: int, blocks, tokens: int) -> None:
    """blocks [S, nb_max, H] bf16 with at least the layer's AttnRes blocks."""
    H = cfg.hidden_size
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 3 or blocks.shape[0] != tokens or blocks.shape[2] != H:
        raise K3InputError(f"blocks: expected shape [{tokens}, nb_max, {H}], got {_shape(blocks)}")
    nb = cfg.num_blocks(layer)
    if blocks.shape[1] < nb:
        raise K3InputError(f"blocks: expected at least {nb} AttnRes blocks for layer {layer}, got {blocks.shape[1]}")
    expect_tensor("blocks", blocks, tuple(blocks.shape), torch.bfloat16)
