"""layer_post of the whole layer on one device: the released function of k3-math.md.

    o = bf16(core @ o_proj.T); P = bf16(P_in + o)
    h = AttnRes mix of [B_0 .. B_{nb-1}, P]; x = rms(h, post_attention_layernorm)
    route on sigmoid(x @ gate.T) (+ bias for the selection); z = bf16(x @ latent_down.T)
    acc = sum_j w_j * bf16(expert_j(z)); r = bf16(rms(bf16(acc)) @ latent_up.T)
    s = shared(x); y = bf16(r + s)

Shapes: core [S, C], prefix [S, H], blocks [S, nb_max, H] (bf16) -> moe_out [S, H],
prefix [S, H], route_ids [S, K] int64, route_weights [S, K].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..validate import check_layer_inputs
from . import stages as st


@dataclass
class LayerResult:
    moe_out: torch.Tensor  # [S, H]: bf16 in bf16 mode, float64 in the oracle
    prefix: torch.Tensor  # [S, H]: the updated prefix P
    route_ids: torch.Tensor  # [S, K] int64, ascending per token
    route_weights: torch.Tensor  # [S, K] in route_ids order, summing to routed_scaling_factor
    trace: dict = field(default_factory=dict)  # every stage's output, for bisection

    def outputs(self, dtype=None) -> dict:
        """The CLI's four output tensors (float values cast to ``dtype`` when given)."""
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        return {
            "moe_out": cast(self.moe_out),
            "prefix": cast(self.prefix),
            "route_ids": self.route_ids,
            "route_weights": self.route_weights.to(torch.float32),
        }


def attnres_seam(num, cfg, layer, prefix_in, o, blocks, weights, trace):
    """P, then the AttnRes mix and the pre-MLP norm: returns (P, x)."""
    eps = cfg.rms_norm_eps
    prefix = st.prefix_add(num, prefix_in, o)
    cands = st.attnres_candidates(num, blocks, cfg.num_blocks(layer), prefix)
    scores = st.attnres_scores(num, cands, weights.ares_norm, weights.ares_proj, eps)
    h = st.attnres_mix(num, cands, scores)
    x = st.rms(num, h, weights.post_norm, eps)
    trace.update(prefix=prefix, ares_scores=scores, h=h, x=x)
    return prefix, x


def finish(num, prefix, moe_out, ids, route_weights, trace) -> LayerResult:
    if num.rounds:
        prefix, moe_out = prefix.to(torch.bfloat16), moe_out.to(torch.bfloat16)
    return LayerResult(moe_out, prefix, ids, route_weights, trace)


def layer_post(core, prefix, blocks, layer, weights, cfg, *, mode="bf16", forced_routes=None) -> LayerResult:
    """The whole layer (``weights.tp == 1``) in ``mode`` 'bf16' (released) or 'oracle' (float64).
    The oracle also takes a float64 core: an MLA layer's exact M1b output
    (reference.mla.mla_back in the oracle), so the chain M1b -> layer_post has one."""
    exact_core = mode == "oracle" and isinstance(core, torch.Tensor) and core.dtype == torch.float64
    check_layer_inputs(cfg, layer, core, prefix, blocks, core_dtype=torch.float64 if exact_core else torch.bfloat16)
    if weights.tp != 1:
        raise ValueError("layer_post: expected the whole layer's weights (tp = 1); use layer_post_tp for shards")
    num = st.MODES[mode]
    eps = cfg.rms_norm_eps
    trace = {}
    o = st.o_proj(num, core, weights.o_proj)
    trace["o"] = o
    prefix_out, x = attnres_seam(num, cfg, layer, prefix, o, blocks, weights, trace)

    logits = st.router_logits(num, x, weights.router)
    ids, route_weights = st.route(
        num, logits, weights.router_bias, cfg.num_experts_per_token, cfg.routed_scaling_factor, forced_routes
    )
    z = st.latent_down(num, x, weights.latent_down)
    acc = st.routed_experts(num, z, ids, route_weights, weights, cfg, round_outputs=True)
    ln = st.latent_norm(num, acc, weights.latent_norm, eps)
    routed = num.round(st.linear(num, ln, weights.latent_up))
    shared = num.round(st.linear(num, st.shared_hidden(num, x, weights.shared_gate, weights.shared_up, cfg), weights.shared_down))
    moe_out = st.final_add(num, routed, shared)
    trace.update(router_logits=logits, z=z, latent_acc=acc, latent_normed=ln, routed=routed, shared=shared)
    return finish(num, prefix_out, moe_out, ids, route_weights, trace)
