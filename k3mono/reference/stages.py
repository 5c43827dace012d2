"""The stages of layer_post, one small pure-torch function each (k3-math.md).

Shape legend: S tokens, H hidden, E experts, K top-k, L latent, I expert
intermediate, SI shared intermediate, C core width, n AttnRes candidates.

Every function takes a ``Numerics``: the float64 oracle (no rounding at all)
or the released bf16 mode (fp32 arithmetic, every bf16 rounding of
k3-math.md). Tensors flowing between stages are in ``num.dtype`` and, in bf16
mode, hold bf16-representable values wherever k3-math.md rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mxfp4 import dequantize


@dataclass(frozen=True)
class Numerics:
    name: str
    dtype: torch.dtype
    rounds: bool

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """bf16(.) of k3-math.md; the identity in the oracle."""
        return x.to(torch.bfloat16).to(self.dtype) if self.rounds else x

    def cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


ORACLE = Numerics("oracle", torch.float64, rounds=False)
BF16 = Numerics("bf16", torch.float32, rounds=True)
MODES = {"oracle": ORACLE, "bf16": BF16}


def linear(num: Numerics, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [S, in] @ w [out, in].T, accumulated in num.dtype, NOT rounded."""
    return num.cast(x) @ num.cast(w).T


def rms_scale(num: Numerics, x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, unrounded."""
    x = num.cast(x)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rms(num: Numerics, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(w * bf16(x * rsqrt(mean(x^2) + eps))): two roundings."""
    return num.round(num.cast(weight) * num.round(rms_scale(num, x, eps)))


def situ(num: Numerics, gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """bf16(beta*tanh(g/beta)*sigmoid(g) * lb*tanh(u/lb)): soft clips at +-beta and +-lb."""
    g, u = num.cast(gate), num.cast(up)
    return num.round(beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta)))


# -- o_proj and the AttnRes seam ---------------------------------------------


def o_proj(num: Numerics, core: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """core [S, C] -> o [S, H] = bf16(core @ o_proj.T)."""
    return num.round(linear(num, core, w_o))


def prefix_add(num: Numerics, prefix_in: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """P = bf16(P_in + o) [S, H]."""
    return num.round(num.cast(prefix_in) + num.cast(o))


def attnres_candidates(num: Numerics, blocks: torch.Tensor, nb: int, prefix: torch.Tensor) -> torch.Tensor:
    """V = [B_0 .. B_{nb-1}, P]: [S, nb + 1, H], blocks first."""
    return torch.cat([num.cast(blocks[:, :nb]), num.cast(prefix).unsqueeze(1)], dim=1)


def attnres_scores(num: Numerics, cands: torch.Tensor, norm: torch.Tensor, proj: torch.Tensor, eps: float):
    """s_i = sum_d rmsnorm(V_i)[d] * mlp_res_norm[d] * mlp_res_proj[d]: [S, n], unrounded."""
    query = num.cast(norm) * num.cast(proj)
    return (rms_scale(num, cands, eps) * query).sum(dim=-1)


def attnres_mix(num: Numerics, cands: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """h = bf16(sum_i softmax(s)_i * V_i): mixes the raw candidates. [S, H]."""
    weights = torch.softmax(scores, dim=-1)
    return num.round((weights.unsqueeze(-1) * cands).sum(dim=1))


# -- router ----------------------------------------------------------------------


def router_logits(num: Numerics, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [S, H] @ gate[E', H].T in fp32 (no rounding): [S, E']."""
    return linear(num, x, gate)


def select_experts(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of (sigmoid score + bias), ties to the lower expert id; ids ascending. [S, K] int64."""
    biased = scores + bias.to(scores.dtype)
    order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=-1).values


def route(num: Numerics, logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float, forced_ids=None):
    """(ids [S, K] int64 ascending, weights [S, K] in num.dtype summing to ``scaling``).

    The bias only selects; the weights renormalise the unbiased sigmoid scores.
    ``forced_ids`` replaces the selection (the oracle evaluated on another
    path's routes, so near-ties do not turn into error).
    """
    scores = torch.sigmoid(num.cast(logits))
    ids = select_experts(scores, bias, k) if forced_ids is None else forced_ids.to(torch.int64)
    picked = scores.gather(1, ids)
    return ids, picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * scaling


# -- latent MoE ------------------------------------------------------------------


def latent_down(num: Numerics, x: torch.Tensor, w_ld: torch.Tensor) -> torch.Tensor:
    """z = bf16(x @ routed_expert_down_proj.T): [S, L'] (a slice of L under TP)."""
    return num.round(linear(num, x, w_ld))


def expert_hidden(num: Numerics, z: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, cfg) -> torch.Tensor:
    """situ(bf16(z @ w1.T), bf16(z @ w3.T)): z [n, L], w1/w3 [I', L] dequantised -> [n, I']."""
    gate = num.round(linear(num, z, w1))
    up = num.round(linear(num, z, w3))
    return situ(num, gate, up, cfg.situ_beta, cfg.situ_linear_beta)


def latent_norm(num: Numerics, acc: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms(bf16(acc), routed_expert_norm): [S, L]."""
    return rms(num, num.round(acc), weight, eps)


def shared_hidden(num: Numerics, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, cfg) -> torch.Tensor:
    """situ(bf16(x @ gate_proj.T), bf16(x @ up_proj.T)): [S, SI']."""
    return situ(num, num.round(linear(num, x, gate)), num.round(linear(num, x, up)), cfg.situ_beta, cfg.situ_linear_beta)


def final_add(num: Numerics, routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """y = bf16(r + s)."""
    return num.round(num.cast(routed) + num.cast(shared))


def routed_experts(
    num: Numerics,
    z: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    layer_weights,
    cfg,
    round_outputs: bool,
) -> torch.Tensor:
    """acc [S, L] = sum_j w_j * d_j, d_j = situ(...) @ w2[e_j].T, on the intermediate
    slice the weights hold (all of I at tp = 1).

    ``round_outputs``: bf16(d_j) as the released model rounds each expert's
    output; a tensor-parallel rank holds only a partial of d_j and cannot.
    Per token the sum runs in route order (ascending expert id). Only the
    chosen experts are dequantised.
    """
    lw = layer_weights
    acc = torch.zeros(z.shape[0], lw.w2_packed.shape[1], dtype=num.dtype, device=z.device)
    for expert in torch.unique(ids).tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        w1 = dequantize(lw.w1_packed[expert], lw.w1_scale[expert], num.dtype)
        w3 = dequantize(lw.w3_packed[expert], lw.w3_scale[expert], num.dtype)
        w2 = dequantize(lw.w2_packed[expert], lw.w2_scale[expert], num.dtype)
        out = linear(num, expert_hidden(num, z[tokens], w1, w3, cfg), w2)
        if round_outputs:
            out = num.round(out)
        acc.index_add_(0, tokens, weights[tokens, slots].unsqueeze(-1) * out)
    return acc
