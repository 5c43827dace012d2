"""Checks on one layer_post call's activations, shared by every implementation.

Shapes: core [S, C] bf16, prefix [S, H] bf16, blocks [S, nb_max, H] bf16 with
nb_max >= nb = floor(layer / attn_res_block_size) + 1, 1 <= S <= MAX_TOKENS.
"""

from __future__ import annotations

import torch

from .config import MAX_TOKENS, K3Config
from .errors import K3InputError, expect_tensor


def check_tokens(tokens: int) -> None:
    if not 1 <= tokens <= MAX_TOKENS:
        raise K3InputError(f"too many tokens: expected 1 to {MAX_TOKENS} tokens a call, got {tokens}")


def check_layer_inputs(cfg: K3Config, layer: int, core, prefix, blocks) -> int:
    """Raise a K3InputError on any wrong shape, dtype or count; return S."""
    cfg.validate_layer(layer)
    if not isinstance(core, torch.Tensor) or core.dim() != 2:
        got = list(core.shape) if isinstance(core, torch.Tensor) else type(core).__name__
        raise K3InputError(f"core: expected shape [S, {cfg.core_width}], got {got}")
    tokens = core.shape[0]
    check_tokens(tokens)
    H = cfg.hidden_size
    expect_tensor("core", core, (tokens, cfg.core_width), torch.bfloat16)
    expect_tensor("prefix", prefix, (tokens, H), torch.bfloat16)
    nb = cfg.num_blocks(layer)
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 3 or blocks.shape[1] < nb:
        got = list(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise K3InputError(f"blocks: expected shape [{tokens}, nb_max >= {nb}, {H}] at layer {layer}, got {got}")
    expect_tensor("blocks", blocks, (tokens, blocks.shape[1], H), torch.bfloat16)
    return tokens
