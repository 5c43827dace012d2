"""The spec: layer_post in pure PyTorch (CPU, no Triton), float64 oracle and released bf16 modes."""

from .layer import LayerResult, layer_post
from .mla import mla_attn, mla_back, mla_decode
from .stages import BF16, MODES, ORACLE, Numerics
from .tp import layer_post_tp

__all__ = ["LayerResult", "layer_post", "layer_post_tp", "Numerics", "ORACLE", "BF16", "MODES",
           "mla_attn", "mla_back", "mla_decode"]
