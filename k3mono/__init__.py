"""k3mono: one Kimi-K3 decoder layer's post-attention half as one GPU launch per layer."""

from .config import MAX_TOKENS, PRESETS, K3Config, preset
from .errors import K3InputError
from .weights import LayerWeights, shard, shard_all

__all__ = ["K3Config", "K3InputError", "LayerWeights", "MAX_TOKENS", "PRESETS", "preset", "shard", "shard_all"]
__version__ = "0.1.0"
