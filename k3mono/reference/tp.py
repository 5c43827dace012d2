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

Each rank's work is one generator, ``rank_program``: it yields an ``Exchange``
at each of the points above and is sent back the combined result. The
single-process driver here runs the T generators in lockstep; a distributed
driver runs one per process and combines through torch.distributed. Both run
the same per-rank code.

Shapes: S tokens, H hidden, E experts, L latent, C core width, T ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import check_layer_inputs
from . import stages as st
from .layer import LayerResult, attnres_seam, finish


@dataclass(frozen=True)
class Exchange:
    """What a rank contributes at one exchange point."""

    name: str  # "AR1", "AG1 logits", "AG1 z", "AR2", "AR3"
    kind: str  # "sum" (all-reduce) or "gather" (all-gather along the last dim)
    part: torch.Tensor  # this rank's partial or slice


def combine(kind: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The exchange's result from every rank's part, in rank order."""
    if kind == "gather":
        return torch.cat(parts, dim=-1)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


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


def rank_program(core, prefix, blocks, layer, shard, cfg, num, forced_routes, trace):
    """Rank ``shard.rank``'s layer_post from its own shard: yields each Exchange,
    is sent its combined result, returns the LayerResult every rank sees."""
    tp, rank, eps = shard.tp, shard.rank, cfg.rms_norm_eps
    o = num.round((yield Exchange("AR1", "sum", st.linear(num, core_slice(core, tp, rank), shard.o_proj))))
    trace["o"] = o
    prefix_out, x = attnres_seam(num, cfg, layer, prefix, o, blocks, shard, trace)
    logits = yield Exchange("AG1 logits", "gather", st.router_logits(num, x, shard.router))
    z = yield Exchange("AG1 z", "gather", st.latent_down(num, x, shard.latent_down))
    ids, route_weights = st.route(
        num, logits, shard.router_bias, cfg.num_experts_per_token, cfg.routed_scaling_factor, forced_routes
    )
    acc = yield Exchange("AR2", "sum", st.routed_experts(num, z, ids, route_weights, shard, cfg, round_outputs=False))
    ln = st.latent_norm(num, acc, shard.latent_norm, eps)
    routed = st.linear(num, latent_slice(ln, tp, rank), shard.latent_up)
    hidden = st.shared_hidden(num, x, shard.shared_gate, shard.shared_up, cfg)
    moe_out = num.round((yield Exchange("AR3", "sum", routed + st.linear(num, hidden, shard.shared_down))))
    trace.update(router_logits=logits, z=z, latent_acc=acc, latent_normed=ln)
    return finish(num, prefix_out, moe_out, ids, route_weights, trace)


def run_lockstep(programs: list) -> list[LayerResult]:
    """Drive T rank programs in one process: at each exchange every rank must be
    at the same point; each gets the combination of all ranks' parts."""
    messages = [next(p) for p in programs]
    while True:
        names = {m.name for m in messages}
        if len(names) != 1:
            raise RuntimeError(f"ranks disagree on the exchange: {sorted(names)}")
        result = combine(messages[0].kind, [m.part for m in messages])
        finished, messages = [], []
        for program in programs:
            try:
                messages.append(program.send(result))
            except StopIteration as done:
                finished.append(done.value)
        if finished:
            if len(finished) != len(programs):
                raise RuntimeError("some ranks finished while others wait at an exchange")
            return finished


def layer_post_tp(core, prefix, blocks, layer, shards, cfg, *, mode="bf16", forced_routes=None) -> LayerResult:
    """layer_post over T = len(shards) ranks; returns what every rank sees (rank 0's copy)."""
    check_layer_inputs(cfg, layer, core, prefix, blocks)
    check_shards(shards, cfg)
    num = st.MODES[mode]
    programs = [rank_program(core, prefix, blocks, layer, w, cfg, num, forced_routes, {}) for w in shards]
    return run_lockstep(programs)[0]
