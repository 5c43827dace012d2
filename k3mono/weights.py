"""One MoE layer's layer_post weights, and their tensor-parallel shards.

A ``LayerWeights`` holds either the whole layer (``tp == 1``) or one rank's
shard of it: the same fields, sliced. Nothing is replicated but the small
vectors every rank needs whole (norm weights, the router's correction bias):

    field           full shape          rank r of T             split by
    o_proj          [H, C]   bf16       [H, C/T]                heads (input columns)
    ares_norm       [H]      bf16       [H]                     (mlp_res_norm)
    ares_proj       [H]      bf16       [H]                     (mlp_res_proj, stored [1, H])
    post_norm       [H]      bf16       [H]                     (post_attention_layernorm)
    router          [E, H]   bf16       [E/T, H]                expert rows
    router_bias     [E]      fp32       [E]                     (selection needs every expert)
    latent_down     [L, H]   bf16       [L/T, H]                latent rows
    latent_norm     [L]      bf16       [L]                     (norm of the summed latent)
    latent_up       [H, L]   bf16       [H, L/T]                latent input columns
    w1/w3_packed    [E, I, L/2]  u8     [E, I/T, L/2]           intermediate rows
    w1/w3_scale     [E, I, L/32] u8     [E, I/T, L/32]
    w2_packed       [E, L, I/2]  u8     [E, L, I/(2T)]          intermediate columns
    w2_scale        [E, L, I/32] u8     [E, L, I/(32T)]         (whole groups: I/T % 32 == 0)
    shared_gate/up  [SI, H]  bf16       [SI/T, H]               intermediate rows
    shared_down     [H, SI]  bf16       [H, SI/T]               intermediate columns

The packed experts may also be int8, in f16 order (k3mono.mxfp4.f16_order, what
the expert loops summing in f16 read): ``experts_in_f16_order_`` turns a shard's
three in place at load time, so an engine holds one copy of its experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import MXFP4_GROUP, K3Config
from .errors import K3InputError, expect_tensor
from .mxfp4 import F16_ORDER_DTYPE, f16_order_

BF16, FP32, U8 = torch.bfloat16, torch.float32, torch.uint8


@dataclass
class LayerWeights:
    tp: int
    rank: int
    o_proj: torch.Tensor
    ares_norm: torch.Tensor
    ares_proj: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor
    router_bias: torch.Tensor
    latent_down: torch.Tensor
    latent_norm: torch.Tensor
    latent_up: torch.Tensor
    w1_packed: torch.Tensor
    w1_scale: torch.Tensor
    w3_packed: torch.Tensor
    w3_scale: torch.Tensor
    w2_packed: torch.Tensor
    w2_scale: torch.Tensor
    shared_gate: torch.Tensor
    shared_up: torch.Tensor
    shared_down: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("tp", "rank")}

    def to(self, device) -> "LayerWeights":
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def shard_shapes(cfg: K3Config, tp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Field -> (shape, dtype) of one rank's shard (the whole layer at tp = 1)."""
    H, C, E, L, I, SI = cfg.matrix_dims
    G = MXFP4_GROUP
    return {
        "o_proj": ((H, C // tp), BF16),
        "ares_norm": ((H,), BF16),
        "ares_proj": ((H,), BF16),
        "post_norm": ((H,), BF16),
        "router": ((E // tp, H), BF16),
        "router_bias": ((E,), FP32),
        "latent_down": ((L // tp, H), BF16),
        "latent_norm": ((L,), BF16),
        "latent_up": ((H, L // tp), BF16),
        "w1_packed": ((E, I // tp, L // 2), U8),
        "w1_scale": ((E, I // tp, L // G), U8),
        "w3_packed": ((E, I // tp, L // 2), U8),
        "w3_scale": ((E, I // tp, L // G), U8),
        "w2_packed": ((E, L, I // tp // 2), U8),
        "w2_scale": ((E, L, I // tp // G), U8),
        "shared_gate": ((SI // tp, H), BF16),
        "shared_up": ((SI // tp, H), BF16),
        "shared_down": ((H, SI // tp), BF16),
    }


PACKED_EXPERTS = ("w1_packed", "w3_packed", "w2_packed")


def check_weights(weights: LayerWeights, cfg: K3Config) -> None:
    """Every field has its shard's shape and dtype (a clear error otherwise); the
    packed experts either the checkpoint's uint8 or all three in f16 order (int8)."""
    in_f16_order = [getattr(weights, name).dtype == F16_ORDER_DTYPE for name in PACKED_EXPERTS
                    if isinstance(getattr(weights, name), torch.Tensor)]
    if any(in_f16_order) and not all(in_f16_order):
        orders = {name: str(getattr(getattr(weights, name), "dtype", None)) for name in PACKED_EXPERTS}
        raise K3InputError(f"weights: the packed experts must share one order (uint8, or int8 in f16 order), "
                           f"got {orders}")
    for name, (shape, dtype) in shard_shapes(cfg, weights.tp).items():
        if name in PACKED_EXPERTS and any(in_f16_order):
            dtype = F16_ORDER_DTYPE
        expect_tensor(f"weights.{name}", getattr(weights, name), shape, dtype)


def experts_in_f16_order_(weights: LayerWeights) -> LayerWeights:
    """``weights`` with its packed experts turned to f16 order in place
    (k3mono.mxfp4.f16_order_: no copy): the returned shard holds their int8 views,
    and ``weights`` must not be used afterwards."""
    return dataclasses.replace(weights, **{name: f16_order_(getattr(weights, name)) for name in PACKED_EXPERTS})


def check_shard(name: str, weights, cfg: K3Config, tp: int, rank: int) -> None:
    """``weights`` is rank ``rank`` of ``tp``'s shard of a cfg layer (a clear error otherwise)."""
    if not isinstance(weights, LayerWeights) or (weights.tp, weights.rank) != (tp, rank):
        got = f"rank {weights.rank} of {weights.tp}" if isinstance(weights, LayerWeights) else type(weights).__name__
        raise K3InputError(f"{name}: expected rank {rank} of {tp}, got {got}")
    check_weights(weights, cfg)


def _rows(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n).contiguous()


def shard(full: LayerWeights, cfg: K3Config, tp: int, rank: int) -> LayerWeights:
    """Rank ``rank``'s slices of a whole layer (see the module table)."""
    cfg.validate_tp(tp)
    if full.tp != 1:
        raise ValueError("shard: expected the whole layer (tp = 1)")

    def cut(t, dim):
        return _rows(t, dim, tp, rank)

    return LayerWeights(
        tp=tp,
        rank=rank,
        o_proj=cut(full.o_proj, 1),
        ares_norm=full.ares_norm,
        ares_proj=full.ares_proj,
        post_norm=full.post_norm,
        router=cut(full.router, 0),
        router_bias=full.router_bias,
        latent_down=cut(full.latent_down, 0),
        latent_norm=full.latent_norm,
        latent_up=cut(full.latent_up, 1),
        w1_packed=cut(full.w1_packed, 1),
        w1_scale=cut(full.w1_scale, 1),
        w3_packed=cut(full.w3_packed, 1),
        w3_scale=cut(full.w3_scale, 1),
        w2_packed=cut(full.w2_packed, 2),
        w2_scale=cut(full.w2_scale, 2),
        shared_gate=cut(full.shared_gate, 0),
        shared_up=cut(full.shared_up, 0),
        shared_down=cut(full.shared_down, 1),
    )


def shard_all(full: LayerWeights, cfg: K3Config, tp: int) -> list[LayerWeights]:
    return [shard(full, cfg, tp, r) for r in range(tp)]
