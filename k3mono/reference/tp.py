"""Tensor-parallel layer_post: every rank computes from its own shard only
(k3mono.weights), and the exchanges between ranks are explicit.

The exchanges, their order and precision (the kernels implement exactly these):

    AR1  o      = bf16(sum_t o_t)           o_t = core[:, heads of t] @ o_proj_t.T, fp32
    AG1  logits = [logits_0 | .. | logits_{T-1}]   fp32, E/T expert rows each
         z      = [z_0 | .. | z_{T-1}]             bf16, L/T latent rows each
    AR2  acc    = sum_t acc_t               fp32; bf16(acc) then feeds the latent norm
    AR3  y      = bf16(sum_t (r_t + s_t))   fp32; r_t = ln[:, L/T of t] @ latent_up_t.T,
                                            s_t = shared_hidden_t @ shared_down_t.T

Every sum runs over ranks in order t = 0 .. T-1, each partial complete before
it is added. Partials are never rounded to bf16: a rank holds only a partial
of each expert's output, so bf16(d_j) of the released model is not reproduced
(the last-bit difference engines accept), and r and s are rounded once, as
their sum. Every rank ends with the same o, P, x, routes and y.

Shapes: S tokens, H hidden, E experts, L latent, C core width, T ranks.
"""

from __future__ import annotations

import torch

from ..validate import check_layer_inputs
from . import stages as st
from .layer import LayerResult, attnres_seam, finish


def exchange_sum(partials: list[torch.Tensor]) -> torch.Tensor:
    """All-reduce: the sum over ranks, in rank order."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total


def exchange_gather(slices: list[torch.Tensor]) -> torch.Tensor:
    """All-gather along the last dim, rank order."""
    return torch.cat(slices, dim=-1)


def core_slice(core: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The rank's heads of the attention output: [S, C/T]."""
    width = core.shape[1] // tp
    return core[:, rank * width : (rank + 1) * width]


def latent_slice(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    width = t.shape[1] // tp
    return t[:, rank * width : (rank + 1) * width]


def check_shards(shards, cfg) -> int:
    tp = len(shards)
    cfg.validate_tp(tp)
    for rank, w in enumerate(shards):
        if (w.tp, w.rank) != (tp, rank):
            raise ValueError(f"shards[{rank}]: expected rank {rank} of {tp}, got rank {w.rank} of {w.tp}")
    return tp


def layer_post_tp(core, prefix, blocks, layer, shards, cfg, *, mode="bf16", forced_routes=None) -> LayerResult:
    """layer_post over T = len(shards) ranks; returns what every rank sees (rank 0's copy)."""
    check_layer_inputs(cfg, layer, core, prefix, blocks)
    tp = check_shards(shards, cfg)
    num = st.MODES[mode]
    eps = cfg.rms_norm_eps
    ranks = range(tp)

    o_parts = [st.linear(num, core_slice(core, tp, r), shards[r].o_proj) for r in ranks]
    o = num.round(exchange_sum(o_parts))  # AR1

    trace = {"o": o}  # rank 0's view; every rank computes the same seam from the same o
    seams = [attnres_seam(num, cfg, layer, prefix, o, blocks, shards[r], trace if r == 0 else {}) for r in ranks]
    prefix_out = seams[0][0]

    logits = exchange_gather([st.router_logits(num, seams[r][1], shards[r].router) for r in ranks])  # AG1
    z = exchange_gather([st.latent_down(num, seams[r][1], shards[r].latent_down) for r in ranks])  # AG1
    routes = [
        st.route(num, logits, shards[r].router_bias, cfg.num_experts_per_token, cfg.routed_scaling_factor, forced_routes)
        for r in ranks
    ]
    ids, route_weights = routes[0]

    acc_parts = [st.routed_experts(num, z, *routes[r], shards[r], cfg, round_outputs=False) for r in ranks]
    acc = exchange_sum(acc_parts)  # AR2
    ln = st.latent_norm(num, acc, shards[0].latent_norm, eps)

    final_parts = []
    for r in ranks:
        routed = st.linear(num, latent_slice(ln, tp, r), shards[r].latent_up)
        hidden = st.shared_hidden(num, seams[r][1], shards[r].shared_gate, shards[r].shared_up, cfg)
        final_parts.append(routed + st.linear(num, hidden, shards[r].shared_down))
    moe_out = num.round(exchange_sum(final_parts))  # AR3

    trace.update(
        o_partials=o_parts,
        router_logits=logits,
        z=z,
        latent_partials=acc_parts,
        latent_acc=acc,
        latent_normed=ln,
        final_partials=final_parts,
    )
    return finish(num, prefix_out, moe_out, ids, route_weights, trace)
