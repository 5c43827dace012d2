"""The unfused baseline computes layer_post (at T = 1, where it owns every exchange slot)."""

import torch

from k3mono.config import preset
from k3mono.runner import Oracle
from k3mono.synthetic import random_inputs, random_layer
from k3mono.unfused import UnfusedRank


def test_unfused_rank_matches_the_reference_within_budget():
    cfg = preset("tiny")
    weights = random_layer(cfg, seed=21)
    inputs = random_inputs(cfg, 3, 13, seed=22)
    oracle = Oracle(cfg, weights, inputs, 13)
    prefix = inputs["prefix"].clone()
    out = UnfusedRank(cfg, weights, tokens=3, layer=13)(inputs["core"], prefix, inputs["blocks"])
    assert out.dtype == torch.bfloat16 and out.shape == (3, cfg.hidden_size)
    ids = oracle.reference.route_ids  # topk order differs from the spec's tie rule only on exact ties
    verdict = oracle.judge({"moe_out": out, "prefix": prefix, "route_ids": ids})
    assert verdict.moe_err <= verdict.moe_budget and verdict.prefix_err <= verdict.prefix_budget
