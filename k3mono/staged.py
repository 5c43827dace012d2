"""The staged driver: layer_post over T ranks on one device, one launch per stage.

Every rank r owns, as the mono launch will:

    peer buffer   flat uint8, layout.peer_layout: ar1 [T, S, H], logits [S, E],
                  z [S, L], ar2 [T, S, L], ar3 [T, S, H] (what other ranks write into)
    scratch       flat uint8, layout.scratch_layout: x, route_ids, route_w,
                  expert_act, latent, shared_act, the seam's partials (only
                  rank r touches it)
    prefix        [S, H] bf16, its own copy of P, updated in place
    out           [S, H] bf16, its copy of the MoE output

A stage kernel of rank r writes its exchanged result into its OWN peer buffer,
at the place it occupies in every rank's buffer (ar slot r, or its column
slice of logits / z). An exchange stage then copies that place from rank t's
buffer into every other rank's buffer, for each t: after it every rank's
buffer holds exactly what the mono launch's pushes would have put there.

Order of one run (tp.py's exchange order):

    oproj (every rank) -> exchange ar1 -> reduce_prefix -> attnres (score, mix, norm)
    -> router, latent_down, shared_gate_up -> exchange logits, z
    -> route (parts, merge) -> expert_gate_up -> expert_down -> exchange ar2
    -> latent_norm (the parts; the scale is final_partial's) -> final_partial -> exchange ar3
    -> final_reduce

With tiles.expert_mma the expert stages run on tensor cores (weights in mma
order, made once here), and z is multiplied by 2^63 after its exchange: what
the mono launch's LATENT_DOWN tasks push for them.

Shapes: S tokens, H hidden, E experts, K top-k, L latent, C core width, T ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import K3Config
from .errors import K3InputError, check_same_device
from .kernels.attnres import launch_attnres
from .kernels.experts import (launch_expert_down, launch_expert_down_mma, launch_expert_gate_up,
                              launch_expert_gate_up_mma)
from .kernels.final import launch_final_partial
from .kernels.latent_down import launch_latent_down
from .kernels.latent_norm import launch_latent_parts
from .kernels.mxfp4 import ACT_PRESCALE
from .kernels.oproj import launch_oproj
from .kernels.reduce import launch_final_reduce, launch_reduce_prefix
from .kernels.route import launch_route
from .kernels.router import launch_router
from .kernels.shared import launch_shared_gate_up
from .layout import layout_bytes, peer_layout, region_views, scratch_layout
from .mxfp4 import ExpertOrderCache, expert_order_cache
from .planner import TileChoice, stage_geometry
from .validate import check_layer_inputs
from .weights import LayerWeights, check_shard

SLOT_EXCHANGES = ("ar1", "ar2", "ar3")  # all-reduce operands: slot t is rank t's partial
COLUMN_EXCHANGES = ("logits", "z")  # all-gathers: columns t*n/T .. of rank t


@dataclass
class StagedResult:
    """One rank's view of a run's outputs."""

    moe_out: torch.Tensor  # [S, H] bf16
    prefix: torch.Tensor  # [S, H] bf16, the updated prefix
    route_ids: torch.Tensor  # [S, K] int64, ascending per token
    route_weights: torch.Tensor  # [S, K] fp32, route_ids order
    router_logits: torch.Tensor | None = None  # [S, E] fp32: what the route stage read

    def outputs(self, dtype=None) -> dict:
        """The CLI's four output tensors (moe_out and prefix cast to ``dtype`` when given)."""
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        return {
            "moe_out": cast(self.moe_out),
            "prefix": cast(self.prefix),
            "route_ids": self.route_ids,
            "route_weights": self.route_weights.to(torch.float32),
        }


def _check_shards(cfg: K3Config, shards) -> int:
    if not shards:
        raise K3InputError("shards: expected one LayerWeights per rank, got none")
    tp = len(shards)
    cfg.validate_tp(tp)
    for rank, w in enumerate(shards):
        check_shard(f"shards[{rank}]", w, cfg, tp, rank)
    check_same_device(*((f"shards[{rank}].{name}", t) for rank, w in enumerate(shards)
                        for name, t in w.tensors().items()))
    return tp


class StagedLayer:
    """layer_post for ``tokens`` tokens at ``layer``, T = len(shards) ranks on the shards' device;
    ``tiles`` the task sizes (the mono launch's TileChoice: the same bits, benchmarks/mono_sweep.py)."""

    def __init__(self, cfg: K3Config, shards: list[LayerWeights], tokens: int, layer: int,
                 tiles: TileChoice = TileChoice(), expert_words: ExpertOrderCache | None = None):
        cfg.validate_layer(layer)
        self.tp = _check_shards(cfg, shards)
        self.cfg, self.shards, self.tokens, self.layer = cfg, list(shards), tokens, layer
        self.geom = stage_geometry(cfg, self.tp, tokens, tiles=tiles)
        # tiles.expert_mma / expert_f16: each rank's w1, w3, w2 in mma order (k3mono.mxfp4.mma_order) or
        # f16 order (f16_order), each distinct tensor once (``expert_words``: a cache shared with the
        # caller's mono ranks); None: the checkpoint's bytes
        self.tiles = tiles
        self.expert_words = None
        order = expert_words if expert_words is not None else expert_order_cache(tiles)
        if order is not None:
            self.expert_words = [{name: order(getattr(w, f"{name}_packed")) for name in ("w1", "w3", "w2")}
                                 for w in self.shards]
        self.device = shards[0].o_proj.device
        self.nb = cfg.num_blocks(layer)
        S, H = tokens, cfg.hidden_size

        peer, scratch = peer_layout(cfg, self.tp, tokens), scratch_layout(cfg, self.tp, tokens)
        self.peer_buffers = [torch.empty(layout_bytes(peer), dtype=torch.uint8, device=self.device) for _ in self.ranks]
        self.scratch_buffers = [torch.empty(layout_bytes(scratch), dtype=torch.uint8, device=self.device) for _ in self.ranks]
        self.peer = [region_views(b, peer) for b in self.peer_buffers]
        self.scratch = [region_views(b, scratch) for b in self.scratch_buffers]
        self.prefix = [torch.empty((S, H), dtype=torch.bfloat16, device=self.device) for _ in self.ranks]
        self.out = [torch.empty((S, H), dtype=torch.bfloat16, device=self.device) for _ in self.ranks]
        self.core = torch.empty((S, cfg.core_width), dtype=torch.bfloat16, device=self.device)
        self.blocks = None  # the caller's [S, nb_max, H], read in place through its strides
        self._stages = self._build_stages()

    @property
    def ranks(self) -> range:
        return range(self.tp)

    # -- the stages ------------------------------------------------------------------------

    def stages(self) -> list[tuple[str, Callable[[], None]]]:
        """Every launch and exchange of one run, in order: (name, callable of no arguments)."""
        return list(self._stages)

    def _build_stages(self) -> list[tuple[str, Callable[[], None]]]:
        cfg, geom, tp = self.cfg, self.geom, self.tp
        E_r, L_r, C_r = cfg.num_experts // tp, cfg.routed_expert_hidden_size // tp, cfg.core_width // tp
        out = []

        def each_rank(name, fn):
            out.extend((f"{name}[{r}]", (lambda r=r: fn(r))) for r in self.ranks)

        w, peer, scratch = self.shards, self.peer, self.scratch
        each_rank("oproj", lambda r: launch_oproj(self.core[:, r * C_r : (r + 1) * C_r], w[r].o_proj, peer[r]["ar1"][r], geom))
        out.append(("exchange ar1", lambda: self._exchange_slot("ar1")))
        each_rank("reduce_prefix", lambda r: launch_reduce_prefix(peer[r]["ar1"], self.prefix[r], geom))
        each_rank(
            "attnres",
            lambda r: launch_attnres(
                self.prefix[r], self.blocks, self.nb, w[r].ares_norm, w[r].ares_proj, w[r].post_norm,
                cfg.rms_norm_eps, scratch[r]["x"], scratch[r], geom,
            ),
        )
        each_rank(
            "router",
            lambda r: launch_router(scratch[r]["x"], w[r].router, peer[r]["logits"][:, r * E_r : (r + 1) * E_r], geom),
        )
        each_rank(
            "latent_down",
            lambda r: launch_latent_down(scratch[r]["x"], w[r].latent_down, peer[r]["z"][:, r * L_r : (r + 1) * L_r], geom),
        )
        each_rank(
            "shared_gate_up",
            lambda r: launch_shared_gate_up(
                scratch[r]["x"], w[r].shared_gate, w[r].shared_up, scratch[r]["shared_act"], geom, cfg
            ),
        )
        out.append(("exchange logits", lambda: self._exchange_columns("logits")))
        out.append(("exchange z", lambda: self._exchange_columns("z")))
        if self.tiles.expert_mma:  # z * 2^63 (exact), as the mono launch's LATENT_DOWN tasks push it
            each_rank("prescale z", lambda r: peer[r]["z"].mul_(ACT_PRESCALE.value))
        each_rank(
            "route",
            lambda r: launch_route(
                peer[r]["logits"], w[r].router_bias, scratch[r]["route_ids"], scratch[r]["route_w"],
                scratch[r]["route_keys"], geom, cfg,
            ),
        )
        if self.tiles.expert_mma:
            words = self.expert_words
            each_rank(
                "expert_gate_up",
                lambda r: launch_expert_gate_up_mma(
                    peer[r]["z"], scratch[r]["route_ids"], words[r]["w1"], w[r].w1_scale, words[r]["w3"],
                    w[r].w3_scale, scratch[r]["expert_act"], self.tokens, cfg,
                ),
            )
            each_rank(
                "expert_down",
                lambda r: launch_expert_down_mma(
                    scratch[r]["expert_act"], scratch[r]["route_ids"], scratch[r]["route_w"], words[r]["w2"],
                    w[r].w2_scale, peer[r]["ar2"][r], self.tokens, cfg,
                ),
            )
        else:  # the checkpoint's bytes, or (tiles.expert_f16) the same in f16 order
            words = self.expert_words or [{name: getattr(x, f"{name}_packed") for name in ("w1", "w3", "w2")}
                                          for x in w]
            each_rank(
                "expert_gate_up",
                lambda r: launch_expert_gate_up(
                    peer[r]["z"], scratch[r]["route_ids"], words[r]["w1"], w[r].w1_scale, words[r]["w3"],
                    w[r].w3_scale, scratch[r]["expert_act"], geom, cfg,
                ),
            )
            each_rank(
                "expert_down",
                lambda r: launch_expert_down(
                    scratch[r]["expert_act"], scratch[r]["route_ids"], scratch[r]["route_w"], words[r]["w2"],
                    w[r].w2_scale, peer[r]["ar2"][r], geom, cfg,
                ),
            )
        out.append(("exchange ar2", lambda: self._exchange_slot("ar2")))
        each_rank(
            "latent_norm",
            lambda r: launch_latent_parts(peer[r]["ar2"], w[r].latent_norm, scratch[r]["latent_sq"],
                                          scratch[r]["latent"], r, geom),
        )
        each_rank(
            "final_partial",
            lambda r: launch_final_partial(
                scratch[r]["latent"], scratch[r]["latent_sq"], cfg.rms_norm_eps, w[r].latent_up, scratch[r]["shared_act"],
                w[r].shared_down, peer[r]["ar3"][r], geom, cfg.routed_expert_hidden_size,
            ),
        )
        out.append(("exchange ar3", lambda: self._exchange_slot("ar3")))
        each_rank("final_reduce", lambda r: launch_final_reduce(peer[r]["ar3"], self.out[r], geom))
        return out

    def _exchange_slot(self, name: str) -> None:
        """Slot t of rank t's buffer into slot t of every other rank's."""
        for t in self.ranks:
            for u in self.ranks:
                if u != t:
                    self.peer[u][name][t].copy_(self.peer[t][name][t])

    def _exchange_columns(self, name: str) -> None:
        """Rank t's column slice of its buffer into the same columns of every other rank's."""
        width = self.peer[0][name].shape[1] // self.tp
        for t in self.ranks:
            cols = slice(t * width, (t + 1) * width)
            for u in self.ranks:
                if u != t:
                    self.peer[u][name][:, cols].copy_(self.peer[t][name][:, cols])

    # -- a run ---------------------------------------------------------------------------------

    def load_inputs(self, core, prefix, blocks) -> None:
        """Check the inputs and set them for the next run: core copied, prefix into every
        rank's copy, blocks kept by reference (read through its strides)."""
        tokens = check_layer_inputs(self.cfg, self.layer, core, prefix, blocks)
        if tokens != self.tokens:
            raise K3InputError(f"core: expected {self.tokens} tokens (this StagedLayer's build), got {tokens}")
        for name, t in (("core", core), ("prefix", prefix), ("blocks", blocks)):
            if t.device != self.device:
                raise K3InputError(f"{name}: expected device {self.device}, got {t.device}")
        if blocks.stride(-1) != 1:
            blocks = blocks.contiguous()
        self.core.copy_(core)
        for r in self.ranks:
            self.prefix[r].copy_(prefix)
        self.blocks = blocks

    def poison(self) -> None:
        """NaN into every float output and scratch region, -1 into the ids: a stage
        that fails to write what a later one reads shows up in the outputs."""
        for views in self.peer + self.scratch:
            for t in views.values():
                t.fill_(float("nan") if t.dtype.is_floating_point else -1)
        for t in self.out:
            t.fill_(float("nan"))

    def run(self) -> None:
        for _, stage in self._stages:
            stage()

    def result(self, rank: int = 0) -> StagedResult:
        """What ``rank`` holds after a run (copies)."""
        scratch = self.scratch[rank]
        return StagedResult(
            moe_out=self.out[rank].clone(),
            prefix=self.prefix[rank].clone(),
            route_ids=scratch["route_ids"].to(torch.int64),
            route_weights=scratch["route_w"].clone(),
            router_logits=self.peer[rank]["logits"].clone(),
        )

    def rank_results(self) -> list[StagedResult]:
        """Every rank's copy of the outputs (they must agree bit for bit)."""
        return [self.result(r) for r in self.ranks]

    def __call__(self, core, prefix, blocks) -> StagedResult:
        """One layer_post: core [S, C], prefix [S, H], blocks [S, nb_max, H] (bf16) ->
        rank 0's outputs. ``prefix`` itself is not modified."""
        self.load_inputs(core, prefix, blocks)
        self.poison()
        self.run()
        return self.result(0)
