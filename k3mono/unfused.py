"""The unfused PyTorch path of one rank: the baseline the fused launches are measured against.

It is what an engine without a fused kernel runs: the TP reference's
arithmetic (reference/tp.py) as separate torch ops on the GPU, bf16 matmuls
through cuBLAS, the routed experts dequantised to bf16 once beforehand and
gathered per chosen expert (torch has no gather-GEMM), the exchanges as copies
into a loopback peer buffer whose other ranks' slots were filled beforehand.
Every op has static shapes, so one call captures into a CUDA graph.

Shapes: S tokens, H hidden, E experts, K top-k, L latent, I/T and SI/T this
rank's intermediate slices, C/T its core columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import K3Config
from .mxfp4 import dequantize
from .weights import LayerWeights


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
    return (weight.float() * normed.float()).to(torch.bfloat16)


def _situ(gate: torch.Tensor, up: torch.Tensor, cfg: K3Config) -> torch.Tensor:
    g, u = gate.float(), up.float()
    beta, lin = cfg.situ_beta, cfg.situ_linear_beta
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * lin * torch.tanh(u / lin)).to(torch.bfloat16)


DEQUANT_CHUNK = 32
"""Experts dequantised at a time: the int64 nibble temporaries of
mxfp4.dequantize are 16x the packed bytes, so a whole layer at once would not fit."""


def dequantize_bf16(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, R, C/2] u8 + [E, R, C/32] u8 -> [E, R, C] bf16 (exact: E2M1 times a power of two)."""
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.bfloat16, device=packed.device)
    for start in range(0, packed.shape[0], DEQUANT_CHUNK):
        part = slice(start, start + DEQUANT_CHUNK)
        out[part] = dequantize(packed[part], scale[part], torch.float32).to(torch.bfloat16)
    return out


class UnfusedRank:
    """Rank ``shard.rank`` of ``shard.tp``: its layer_post as torch ops, loopback exchanges."""

    def __init__(self, cfg: K3Config, shard: LayerWeights, tokens: int, layer: int):
        self.cfg, self.w, self.layer = cfg, shard, layer
        tp, rank, S = shard.tp, shard.rank, tokens
        device = shard.o_proj.device
        E, H, L = cfg.num_experts, cfg.hidden_size, cfg.routed_expert_hidden_size
        bf16 = torch.bfloat16
        self.w1 = dequantize_bf16(shard.w1_packed, shard.w1_scale)  # [E, I/T, L]
        self.w3 = dequantize_bf16(shard.w3_packed, shard.w3_scale)
        self.w2 = dequantize_bf16(shard.w2_packed, shard.w2_scale)  # [E, L, I/T]
        self.ar1 = torch.randn(tp, S, H, device=device)  # other ranks' o partials (loopback)
        self.logits = torch.randn(S, E, device=device)
        self.z = torch.randn(S, L, device=device).to(bf16)
        self.ar2 = torch.randn(tp, S, L, device=device) * 1e-2
        self.ar3 = torch.randn(tp, S, H, device=device)
        self.rank, self.tp = rank, tp
        self.e_cols = slice(rank * E // tp, (rank + 1) * E // tp)
        self.l_cols = slice(rank * L // tp, (rank + 1) * L // tp)

    def __call__(self, core_r: torch.Tensor, prefix: torch.Tensor, blocks: torch.Tensor):
        """core_r [S, C/T] bf16, prefix [S, H] bf16 (updated in place), blocks [S, nb_max, H] -> out [S, H] bf16."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        self.ar1[self.rank] = F.linear(core_r, w.o_proj).float()
        o = self.ar1.sum(0).to(torch.bfloat16)
        prefix.copy_((prefix.float() + o.float()).to(torch.bfloat16))
        nb = cfg.num_blocks(self.layer)
        cands = torch.cat([blocks[:, :nb], prefix.unsqueeze(1)], 1).float()
        keys = cands * torch.rsqrt(cands.pow(2).mean(-1, keepdim=True) + eps)
        scores = (keys * (w.ares_norm.float() * w.ares_proj.float())).sum(-1)
        h = (torch.softmax(scores, -1).unsqueeze(-1) * cands).sum(1).to(torch.bfloat16)
        x = _rms(h, w.post_norm, eps)

        self.logits[:, self.e_cols] = F.linear(x.float(), w.router.float())
        self.z[:, self.l_cols] = F.linear(x, w.latent_down)
        shared = _situ(F.linear(x, w.shared_gate), F.linear(x, w.shared_up), cfg)

        scores = torch.sigmoid(self.logits)
        ids = torch.topk(scores + w.router_bias, cfg.num_experts_per_token, dim=-1).indices
        picked = scores.gather(1, ids)
        route_w = picked / (picked.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor

        flat = ids.flatten()
        z = self.z.repeat_interleave(cfg.num_experts_per_token, 0).unsqueeze(-1)  # [S*K, L, 1]
        gate = torch.bmm(self.w1.index_select(0, flat), z).squeeze(-1)
        up = torch.bmm(self.w3.index_select(0, flat), z).squeeze(-1)
        act = _situ(gate, up, cfg).unsqueeze(-1)  # [S*K, I/T, 1]
        down = torch.bmm(self.w2.index_select(0, flat), act).squeeze(-1).float()  # [S*K, L]
        self.ar2[self.rank] = (down.view(*ids.shape, -1) * route_w.unsqueeze(-1)).sum(1)
        latent = _rms(self.ar2.sum(0).to(torch.bfloat16), w.latent_norm, eps)

        final = F.linear(latent[:, self.l_cols], w.latent_up).float() + F.linear(shared, w.shared_down).float()
        self.ar3[self.rank] = final
        return self.ar3.sum(0).to(torch.bfloat16)
