"""Run one layer_post with a named implementation, and compare it with the oracle.

Implementations: ``reference`` (pure torch; tensor-parallel form when T > 1),
``staged`` (one Triton launch per stage, T ranks on one device) and ``mono``
(one persistent launch per rank; T > 1 runs every rank in loopback: its
launch alone, the other ranks' pushes pre-written from a staged run). An
implementation that is asked for runs or fails with a clear error: it never
falls back to another.

On a CPU device the Triton implementations run in the Triton interpreter,
which must be switched on before Triton compiles anything: ``prepare_device``
does that, so it runs before any kernel module is imported.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from .config import K3Config
from .errors import K3InputError
from .reference import layer_post, layer_post_tp
from .reference.stages import select_experts
from .weights import LayerWeights, shard_all

IMPLS = ("reference", "staged", "mono")


def prepare_device(device: str) -> torch.device:
    """The torch device for ``device`` ('cpu' or 'cuda'), the interpreter on for CPU kernels."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise K3InputError("device: cuda requested but torch sees no GPU (use --device cpu)")
        return torch.device("cuda")
    if device != "cpu":
        raise K3InputError(f"device: expected cpu or cuda, got {device!r}")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def available_impls() -> tuple[str, ...]:
    """Every implementation this machine can run (Triton ones need the triton package)."""
    if importlib.util.find_spec("triton") is None:
        return ("reference",)
    return IMPLS


def _check_interpreter(device: torch.device) -> None:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise K3InputError("device cpu: the Triton kernels need TRITON_INTERPRET=1 on a machine without a GPU")


def run_layer(impl: str, cfg: K3Config, weights: LayerWeights, inputs: dict, layer: int, tp: int, device) -> dict:
    """The four outputs of layer_post as every rank sees them (on the CPU):
    moe_out [S, H] bf16, prefix [S, H] bf16, route_ids [S, K] int64, route_weights [S, K] fp32."""
    if impl not in IMPLS:
        raise K3InputError(f"impl: expected one of {list(IMPLS)}, got {impl!r}")
    cfg.validate_tp(tp)
    device = torch.device(device)
    on_device = {name: t.to(device) for name, t in inputs.items()}
    if impl == "reference":
        if tp == 1:
            result = layer_post(**on_device, layer=layer, weights=weights.to(device), cfg=cfg)
        else:
            result = layer_post_tp(**on_device, layer=layer, shards=shard_all(weights.to(device), cfg, tp), cfg=cfg)
        return {name: t.cpu() for name, t in result.outputs().items()}
    _check_interpreter(device)
    shards = [w.to(device) for w in shard_all(weights, cfg, tp)]
    if impl == "mono":
        from .mono import MonoRunner

        runner = MonoRunner(cfg, shards, inputs["core"].shape[0], layer, device=device)
        result = runner(**on_device)
        if device.type == "cpu":
            # Loopback ranks run against the staged driver's pushes of the others. The
            # interpreter sums in one order in every kernel, so they must agree bit for
            # bit; compiled, those pushes were summed in other kernels' orders.
            _check_ranks_agree(runner.rank_results())
        return {name: t.cpu() for name, t in result.outputs().items()}
    from .staged import StagedLayer

    staged = StagedLayer(cfg, shards, tokens=inputs["core"].shape[0], layer=layer)
    return {name: t.cpu() for name, t in staged(**on_device).outputs().items()}


def _check_ranks_agree(results) -> None:
    """Every rank reduces the same data in the same order: bit-identical outputs."""
    first = results[0]
    for rank, other in enumerate(results[1:], start=1):
        for name in ("moe_out", "prefix", "route_ids", "route_weights"):
            a, b = getattr(first, name), getattr(other, name)
            if not torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b):
                raise RuntimeError(f"mono: rank {rank}'s {name} differs from rank 0's")


@dataclass
class Comparison:
    """One implementation's outputs against the float64 oracle and the bf16 reference."""

    moe_err: float
    moe_budget: float
    prefix_err: float
    prefix_budget: float
    routes_identical: bool
    # Where routes differ: whether they are exactly the spec's selection on the
    # implementation's own router logits, and how far those logits are from the
    # reference's (their inputs were not identical, so neither are the routes).
    routes_own_exact: bool | None = None
    logits_err: float | None = None

    @property
    def routes_ok(self) -> bool:
        return self.routes_identical or (bool(self.routes_own_exact) and self.logits_err < LOGITS_TOLERANCE)

    @property
    def routes_text(self) -> str:
        if self.routes_identical:
            return "identical"
        if self.routes_own_exact is None:
            return "DIFFER"
        return f"{'own-exact' if self.routes_ok else 'DIFFER'} (logits {self.logits_err:.0e})"

    @property
    def ok(self) -> bool:
        return self.routes_ok and self.moe_err <= self.moe_budget and self.prefix_err <= self.prefix_budget


LOGITS_TOLERANCE = 1e-3
"""Relative error an implementation's router logits may have against the bf16
reference's: x is bf16, so a last-bit difference in x (a different fp32
summation order before its rounding) moves the logits by about 1e-4."""

BUDGET_FACTOR = 2.0
"""An implementation may err at most this many times the bf16 reference's own
error against the float64 oracle."""


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return ((got.to(want.device).double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def error_and_budget(got: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """got's relative error against the float64 oracle ``exact``, and the most it may be:
    BUDGET_FACTOR times the bf16 ``reference``'s own error against ``exact``."""
    return rel_err(got, exact), BUDGET_FACTOR * rel_err(reference, exact)


class Oracle:
    """The float64 oracle and the bf16 reference's error against it, for one input.

    The oracle is evaluated on the routes of the path it judges: near-ties in
    the router flip between float64 and bf16 (a few percent of tokens), which
    is a difference in routes, checked exactly against the bf16 reference,
    not numerical error.
    """

    def __init__(self, cfg: K3Config, weights: LayerWeights, inputs: dict, layer: int):
        self.args = dict(inputs, layer=layer, weights=weights, cfg=cfg)
        self.reference = layer_post(**self.args)
        exact = layer_post(**self.args, mode="oracle", forced_routes=self.reference.route_ids)
        self.moe_budget = BUDGET_FACTOR * rel_err(self.reference.moe_out, exact.moe_out)
        self.prefix_budget = BUDGET_FACTOR * rel_err(self.reference.prefix, exact.prefix)

    def judge(self, outputs: dict) -> Comparison:
        route_ids = outputs["route_ids"].to(self.reference.route_ids.device)
        routes_identical = torch.equal(route_ids, self.reference.route_ids)
        exact = layer_post(**self.args, mode="oracle", forced_routes=route_ids)
        return Comparison(
            moe_err=rel_err(outputs["moe_out"], exact.moe_out),
            moe_budget=self.moe_budget,
            prefix_err=rel_err(outputs["prefix"], exact.prefix),
            prefix_budget=self.prefix_budget,
            routes_identical=routes_identical,
            **({} if routes_identical else self.own_routes(route_ids, outputs.get("router_logits"))),
        )

    def own_routes(self, route_ids: torch.Tensor, logits) -> dict:
        """Routes that differ from the reference's are judged exactly on the
        implementation's own logits (the spec's selection of them), and those
        logits against the reference's within LOGITS_TOLERANCE."""
        if logits is None:
            return {}
        cfg, weights = self.args["cfg"], self.args["weights"]
        logits = logits.to(route_ids.device).float()
        own = select_experts(torch.sigmoid(logits), weights.router_bias.to(logits.device), cfg.num_experts_per_token)
        return {
            "routes_own_exact": torch.equal(own, route_ids),
            "logits_err": rel_err(logits, self.reference.trace["router_logits"]),
        }
