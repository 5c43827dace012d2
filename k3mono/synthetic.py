"""Random weights and inputs with realistic magnitudes, deterministic from a seed.

Scales follow the trained model's orders of magnitude so that every stage of
layer_post does real work: matmul outputs stay O(1), AttnRes scores vary by
O(1) (the softmax neither saturates nor flattens), the router bias is small
next to the sigmoid scores (it perturbs the top-k, it does not decide it).
"""

from __future__ import annotations

import math

import torch

from . import mxfp4
from .checkpoint import write_checkpoint
from .config import MXFP4_GROUP, K3Config, preset
from .errors import K3InputError
from .weights import BF16, U8, LayerWeights

_QUANTIZE_CHUNK = 1 << 18
"""Elements quantized at a time: mxfp4.quantize builds an 8x temporary, and
cache-sized chunks are both lighter and faster than one huge call."""


def _normal(g: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=g) * std


def _matrix(g: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] bf16 ~ N(0, 1/sqrt(cols)): unit-variance inputs give unit-variance outputs."""
    return _normal(g, (rows, cols), 1 / math.sqrt(cols)).to(BF16)


def _norm_weight(g: torch.Generator, n: int) -> torch.Tensor:
    return (1 + _normal(g, (n,), 0.1)).to(BF16)


def _experts(g: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of [experts, rows, cols] ~ N(0, 1/sqrt(cols)) -> ([E, rows, cols/2], [E, rows, cols/32]) u8."""
    packed = torch.empty((experts, rows, cols // 2), dtype=U8)
    scale = torch.empty((experts, rows, cols // MXFP4_GROUP), dtype=U8)
    step = max(1, _QUANTIZE_CHUNK // (rows * cols))
    for start in range(0, experts, step):
        n = min(step, experts - start)
        packed[start : start + n], scale[start : start + n] = mxfp4.quantize(
            _normal(g, (n, rows, cols), 1 / math.sqrt(cols))
        )
    return packed, scale


def random_layer(cfg: K3Config, seed: int) -> LayerWeights:
    """A whole layer (tp = 1) of random weights; the same seed gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    H, C, E, L, I, SI = cfg.matrix_dims
    o_proj = _matrix(g, H, C)
    ares_norm = _norm_weight(g, H)
    # k_i has unit RMS, so s_i = sum_d k_i[d] * norm[d] * proj[d] is ~N(0, 1).
    ares_proj = _normal(g, (H,), 1 / math.sqrt(H)).to(BF16)
    post_norm = _norm_weight(g, H)
    router = _matrix(g, E, H)
    router_bias = _normal(g, (E,), 0.05)
    latent_down = _matrix(g, L, H)
    latent_norm = _norm_weight(g, L)
    latent_up = _matrix(g, H, L)
    w1_packed, w1_scale = _experts(g, E, I, L)
    w3_packed, w3_scale = _experts(g, E, I, L)
    w2_packed, w2_scale = _experts(g, E, L, I)
    return LayerWeights(
        tp=1,
        rank=0,
        o_proj=o_proj,
        ares_norm=ares_norm,
        ares_proj=ares_proj,
        post_norm=post_norm,
        router=router,
        router_bias=router_bias,
        latent_down=latent_down,
        latent_norm=latent_norm,
        latent_up=latent_up,
        w1_packed=w1_packed,
        w1_scale=w1_scale,
        w3_packed=w3_packed,
        w3_scale=w3_scale,
        w2_packed=w2_packed,
        w2_scale=w2_scale,
        shared_gate=_matrix(g, SI, H),
        shared_up=_matrix(g, SI, H),
        shared_down=_matrix(g, H, SI),
    )


def random_inputs(
    cfg: K3Config, tokens: int, layer: int, seed: int, nb_max: int | None = None
) -> dict[str, torch.Tensor]:
    """core [S, C], prefix [S, H], blocks [S, nb_max, H], all bf16 ~ N(0, 1).

    ``nb_max`` may exceed the layer's block count (a launch padded for the
    deepest layer); the blocks past it are filled too, and must be ignored.
    """
    cfg.validate_layer(layer)
    nb = cfg.num_blocks(layer)
    nb_max = nb if nb_max is None else nb_max
    if tokens < 1:
        raise K3InputError(f"tokens: expected at least 1, got {tokens}")
    if nb_max < nb:
        raise K3InputError(f"nb_max: expected at least {nb} AttnRes blocks for layer {layer}, got {nb_max}")
    g = torch.Generator().manual_seed(seed)
    H = cfg.hidden_size
    return {
        "core": torch.randn((tokens, cfg.core_width), generator=g).to(BF16),
        "prefix": torch.randn((tokens, H), generator=g).to(BF16),
        "blocks": torch.randn((tokens, nb_max, H), generator=g).to(BF16),
    }


def make_checkpoint(
    ckpt_dir, preset_name: str = "tiny", layers=(1, 13), seed: int = 0, shard_bytes: int = 1 << 20
) -> K3Config:
    """A released-layout checkpoint of random layers (layer l from seed + l, so layers differ).

    The small default ``shard_bytes`` spreads even the tiny preset over several
    shards, so the loader's multi-shard path is what gets exercised.
    """
    cfg = preset(preset_name)
    write_checkpoint(ckpt_dir, cfg, {layer: random_layer(cfg, seed + layer) for layer in layers}, shard_bytes)
    return cfg


E2M1_RMS = math.sqrt(sum(v * v for v in mxfp4.E2M1_MAGNITUDES) / len(mxfp4.E2M1_MAGNITUDES))
"""RMS of a uniformly random E2M1 code: sets the scale byte for a target weight RMS."""


def random_shard(cfg: K3Config, tp: int, seed: int, device) -> LayerWeights:
    """One rank's shard of random weights made directly on ``device`` (the
    benchmarks' full-size layers: quantising 15 GB of experts on the CPU would
    take minutes). MXFP4 codes are uniform and each group's scale byte is
    picked around the one that gives N(0, 1/sqrt(fan_in))-like magnitudes; at
    tp = 1 it is a whole layer, and ``shard`` cuts it like a loaded one."""
    from .weights import shard_shapes

    g = torch.Generator(device=device).manual_seed(seed)
    fan_in = {
        "w1_scale": cfg.routed_expert_hidden_size,
        "w3_scale": cfg.routed_expert_hidden_size,
        "w2_scale": cfg.moe_intermediate_size,
    }
    tensors = {}
    for name, (shape, dtype) in shard_shapes(cfg, tp).items():
        if name.endswith("_packed"):
            tensors[name] = torch.randint(0, 256, shape, generator=g, device=device, dtype=U8)
        elif name.endswith("_scale"):
            centre = round(mxfp4.E8M0_BIAS + math.log2(1 / (math.sqrt(fan_in[name]) * E2M1_RMS)))
            tensors[name] = torch.randint(centre - 1, centre + 2, shape, generator=g, device=device, dtype=U8)
        elif name in ("ares_norm", "post_norm", "latent_norm"):
            tensors[name] = (1 + 0.1 * torch.randn(shape, generator=g, device=device)).to(BF16)
        elif name == "router_bias":
            tensors[name] = 0.05 * torch.randn(shape, generator=g, device=device)
        elif name == "ares_proj":
            tensors[name] = (torch.randn(shape, generator=g, device=device) / math.sqrt(shape[0])).to(BF16)
        else:
            tensors[name] = (torch.randn(shape, generator=g, device=device) / math.sqrt(shape[-1])).to(BF16)
    return LayerWeights(tp=tp, rank=0, **tensors)
