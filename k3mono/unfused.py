"""The unfused PyTorch path of one rank: the baseline the fused launches are measured against.

It is what an engine without a fused kernel runs: the TP reference's
arithmetic (reference/tp.py) as separate torch ops on the GPU, bf16 matmuls
through cuBLAS, the routed experts dequantised to bf16 once beforehand and
gathered per chosen expert (torch has no gather-GEMM). The exchanges:
``UnfusedRank`` copies into a loopback peer buffer whose other ranks' slots
were filled beforehand (one GPU); ``CollectiveUnfusedRank`` runs them as
torch.distributed all-reduces and all-gathers over a process group (NCCL
across GPUs: the engines' unfused path). Every op has static shapes, so one
call captures into a CUDA graph.

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

    # -- the exchanges (loopback: this rank's slot of a buffer the others filled) -------------
    def sum_partials(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``part`` [S, X] fp32 (this rank's)."""
        slots = getattr(self, name)
        slots[self.rank] = part
        return slots.sum(0)

    def gather_columns(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """[S, X] with this rank's columns ``part`` [S, X/T] in place."""
        whole = getattr(self, name)
        width = whole.shape[1] // self.tp
        whole[:, self.rank * width : (self.rank + 1) * width] = part
        return whole

    def __call__(self, core_r: torch.Tensor, prefix: torch.Tensor, blocks: torch.Tensor):
        """core_r [S, C/T] bf16, prefix [S, H] bf16 (updated in place), blocks [S, nb_max, H] -> out [S, H] bf16."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        o = self.sum_partials("ar1", F.linear(core_r, w.o_proj).float()).to(torch.bfloat16)
        prefix.copy_((prefix.float() + o.float()).to(torch.bfloat16))
        nb = cfg.num_blocks(self.layer)
        cands = torch.cat([blocks[:, :nb], prefix.unsqueeze(1)], 1).float()
        keys = cands * torch.rsqrt(cands.pow(2).mean(-1, keepdim=True) + eps)
        scores = (keys * (w.ares_norm.float() * w.ares_proj.float())).sum(-1)
        h = (torch.softmax(scores, -1).unsqueeze(-1) * cands).sum(1).to(torch.bfloat16)
        x = _rms(h, w.post_norm, eps)

        logits = self.gather_columns("logits", F.linear(x.float(), w.router.float()))
        z_all = self.gather_columns("z", F.linear(x, w.latent_down))
        shared = _situ(F.linear(x, w.shared_gate), F.linear(x, w.shared_up), cfg)

        scores = torch.sigmoid(logits)
        ids = torch.topk(scores + w.router_bias, cfg.num_experts_per_token, dim=-1).indices
        picked = scores.gather(1, ids)
        route_w = picked / (picked.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor

        flat = ids.flatten()
        z = z_all.repeat_interleave(cfg.num_experts_per_token, 0).unsqueeze(-1)  # [S*K, L, 1]
        gate = torch.bmm(self.w1.index_select(0, flat), z).squeeze(-1)
        up = torch.bmm(self.w3.index_select(0, flat), z).squeeze(-1)
        act = _situ(gate, up, cfg).unsqueeze(-1)  # [S*K, I/T, 1]
        down = torch.bmm(self.w2.index_select(0, flat), act).squeeze(-1).float()  # [S*K, L]
        latent_sum = self.sum_partials("ar2", (down.view(*ids.shape, -1) * route_w.unsqueeze(-1)).sum(1))
        latent = _rms(latent_sum.to(torch.bfloat16), w.latent_norm, eps)

        final = F.linear(latent[:, self.l_cols], w.latent_up).float() + F.linear(shared, w.shared_down).float()
        return self.sum_partials("ar3", final).to(torch.bfloat16)


class CollectiveUnfusedRank(UnfusedRank):
    """The same layer_post with its exchanges as collectives over ``group``
    (default: the world): all-reduce (sum) of the o_proj, expert-down and final
    partials, all-gather of the router logits and latent z columns."""

    def __init__(self, cfg: K3Config, shard: LayerWeights, tokens: int, layer: int, group=None):
        super().__init__(cfg, shard, tokens, layer)
        self.group = group

    def sum_partials(self, name: str, part: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        total = part.contiguous()
        dist.all_reduce(total, group=self.group)
        return total

    def gather_columns(self, name: str, part: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        tokens, width = part.shape
        parts = torch.empty(self.tp * tokens, width, dtype=part.dtype, device=part.device)  # ranks stacked on dim 0
        dist.all_gather_into_tensor(parts, part.contiguous(), group=self.group)
        return parts.view(self.tp, tokens, width).permute(1, 0, 2).reshape(tokens, -1)
