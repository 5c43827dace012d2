"""The staged driver end to end: T ranks on one device against the TP reference.

Routes must equal the bf16 TP reference's exactly; moe_out, prefix and the
route weights may err against the float64 oracle (evaluated on the staged
routes) at most twice as much as the bf16 TP reference itself does; every rank must hold bit-identical
outputs (they all reduce the same exchanged data in the same order).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from k3mono.config import preset
from k3mono.errors import K3InputError
from k3mono.reference import layer_post_tp
from k3mono.runner import error_and_budget
from k3mono.staged import StagedLayer
from k3mono.synthetic import random_inputs, random_layer
from k3mono.weights import shard_all

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@functools.lru_cache(maxsize=None)
def layer_weights(preset_name: str = "tiny", seed: int = 0):
    return random_layer(preset(preset_name), seed)


def staged_layer(cfg, weights, tp, tokens, layer):
    return StagedLayer(cfg, [w.to(DEVICE) for w in shard_all(weights, cfg, tp)], tokens=tokens, layer=layer)


def on_device(inputs):
    return {k: v.to(DEVICE) for k, v in inputs.items()}


CASES = [(tp, S, layer) for tp in (1, 2, 4) for S, layer in ((1, 1), (3, 13), (16, 92))]


@pytest.mark.parametrize("tp,tokens,layer", CASES, ids=[f"T{tp}-S{s}-L{l}" for tp, s, l in CASES])
def test_staged_matches_the_tp_reference(tp, tokens, layer):
    cfg = preset("tiny")
    weights = layer_weights()
    nb = cfg.num_blocks(layer)
    inputs = random_inputs(cfg, tokens, layer, seed=100 + 7 * tp + tokens, nb_max=nb + 1)
    prefix_before = inputs["prefix"].clone()

    staged = staged_layer(cfg, weights, tp, tokens, layer)
    got = staged(**on_device(inputs))
    assert torch.equal(inputs["prefix"], prefix_before), "the caller's prefix must not be modified"

    shards = shard_all(weights, cfg, tp)
    ref = layer_post_tp(**inputs, layer=layer, shards=shards, cfg=cfg)
    assert torch.equal(got.route_ids.cpu(), ref.route_ids), "routes differ from the bf16 TP reference"
    assert got.route_ids.dtype == torch.int64 and got.route_weights.dtype == torch.float32

    exact = layer_post_tp(**inputs, layer=layer, shards=shards, cfg=cfg, mode="oracle", forced_routes=got.route_ids.cpu())
    for name in ("moe_out", "prefix", "route_weights"):
        out = getattr(got, name)
        assert out.dtype == (torch.float32 if name == "route_weights" else torch.bfloat16), name
        assert torch.isfinite(out.float()).all(), name
        err, budget = error_and_budget(out, getattr(ref, name), getattr(exact, name))
        assert err <= budget, f"{name}: error {err:.3g} against the oracle, budget {budget:.3g}"

    first = staged.rank_results()[0]
    for rank, other in enumerate(staged.rank_results()[1:], start=1):
        for name in ("moe_out", "prefix", "route_ids", "route_weights"):
            a, b = getattr(first, name), getattr(other, name)
            assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b), f"rank {rank} {name} differs from rank 0"


def test_stage_order_and_exchanges():
    cfg = preset("tiny")
    staged = staged_layer(cfg, layer_weights(), 2, 1, 13)
    names = [name for name, _ in staged.stages()]
    kinds = [name.split("[")[0] for name in names]
    order = [
        "oproj", "exchange ar1", "reduce_prefix", "attnres", "router", "latent_down", "shared_gate_up",
        "exchange logits", "exchange z", "route", "expert_gate_up", "expert_down", "exchange ar2",
        "latent_norm", "final_partial", "exchange ar3", "final_reduce",
    ]
    assert list(dict.fromkeys(kinds)) == order
    for kind in order:
        assert kinds.count(kind) == (1 if kind.startswith("exchange") else 2), kind
    assert [n for n in names if n.startswith("oproj")] == ["oproj[0]", "oproj[1]"]


def test_reused_layer_is_poisoned_between_runs():
    """A second run on other inputs gives what a fresh StagedLayer gives."""
    cfg, layer, tokens, tp = preset("tiny"), 13, 1, 2
    weights = layer_weights()
    a = random_inputs(cfg, tokens, layer, seed=1)
    b = random_inputs(cfg, tokens, layer, seed=2)
    reused = staged_layer(cfg, weights, tp, tokens, layer)
    reused(**on_device(a))
    second = reused(**on_device(b))
    fresh = staged_layer(cfg, weights, tp, tokens, layer)(**on_device(b))
    for name in ("moe_out", "prefix", "route_ids", "route_weights"):
        assert torch.equal(getattr(second, name), getattr(fresh, name)), name


def test_staged_rejects_bad_inputs():
    cfg, layer = preset("tiny"), 13
    staged = staged_layer(cfg, layer_weights(), 1, 3, layer)
    wrong_tokens = on_device(random_inputs(cfg, 2, layer, seed=3))
    with pytest.raises(K3InputError, match="tokens"):
        staged(**wrong_tokens)
    inputs = on_device(random_inputs(cfg, 3, layer, seed=3))
    with pytest.raises(K3InputError, match="prefix"):
        staged(inputs["core"], inputs["prefix"].float(), inputs["blocks"])
    with pytest.raises(K3InputError):
        StagedLayer(cfg, [w.to(DEVICE) for w in shard_all(layer_weights(), cfg, 2)][:1], tokens=3, layer=layer)


def test_routes_that_differ_are_judged_on_the_implementations_own_logits():
    from k3mono.config import preset
    from k3mono.runner import Oracle
    from k3mono.synthetic import random_inputs, random_layer

    cfg = preset("tiny")
    weights = random_layer(cfg, seed=40)
    inputs = random_inputs(cfg, 2, 1, seed=41)
    oracle = Oracle(cfg, weights, inputs, 1)
    ref = oracle.reference
    logits = ref.trace["router_logits"].clone()
    # lift expert 0 of token 0 to the top: the spec's selection of these logits differs
    logits[0, 0] = logits[0].max() + 1.0
    own = dict(ref.outputs(), router_logits=logits)
    own["route_ids"] = torch.sort(
        torch.sort(torch.sigmoid(logits) + weights.router_bias, dim=-1, descending=True, stable=True).indices[:, : cfg.num_experts_per_token]
    ).values
    verdict = oracle.judge(own)
    assert not verdict.routes_identical and verdict.routes_own_exact
    assert verdict.logits_err > 1e-3 and not verdict.routes_ok  # logits too far from the reference's
    wrong = dict(own, route_ids=ref.route_ids.flip(0))
    assert not oracle.judge(dict(wrong, router_logits=ref.trace["router_logits"])).routes_ok


def test_smaller_tiles_give_the_same_bits():
    """The staged path at the mono launch's other TileChoices (benchmarks/mono_sweep.py
    times both): smaller expert and larger router tasks split the same sums the same way."""
    from k3mono.planner import TileChoice

    cfg, tp, tokens, layer = preset("tiny"), 2, 3, 13
    inputs = on_device(random_inputs(cfg, tokens, layer, seed=31))
    shards = [w.to(DEVICE) for w in shard_all(layer_weights(), cfg, tp)]
    plain = StagedLayer(cfg, shards, tokens, layer)(**inputs)
    tiles = TileChoice(gate_up_rows=8, down_rows=8, router_rows=8)
    small = StagedLayer(cfg, shards, tokens, layer, tiles=tiles)(**inputs)
    for name in ("moe_out", "prefix", "route_ids", "route_weights"):
        a, b = getattr(plain, name), getattr(small, name)
        if a.is_floating_point():
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), name
