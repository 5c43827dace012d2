"""The reference against hand-computed values, and the TP reference against the full one."""

import math

import pytest
import torch

from k3mono.config import PRESETS, K3Config, preset
from k3mono.errors import K3InputError
from k3mono.reference import ORACLE, BF16, layer_post, layer_post_tp
from k3mono.reference import stages as st
from k3mono.synthetic import random_inputs, random_layer
from k3mono.weights import LayerWeights, shard, shard_all, shard_shapes


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- stage functions against hand values ---------------------------------------


def test_attnres_two_candidates_by_hand():
    eps = 1e-5
    blocks = torch.tensor([[[1.0, 1.0]]], dtype=torch.float64)  # one block: V_0 = [1, 1]
    prefix = torch.tensor([[2.0, 0.0]], dtype=torch.float64)  # P = V_1 = [2, 0]
    cands = st.attnres_candidates(ORACLE, blocks, 1, prefix)
    norm = torch.tensor([1.0, 1.0], dtype=torch.float64)
    proj = torch.tensor([1.0, 0.0], dtype=torch.float64)
    scores = st.attnres_scores(ORACLE, cands, norm, proj, eps)
    # rmsnorm([1, 1]) = [1, 1] / sqrt(1 + eps); rmsnorm([2, 0]) = [2, 0] / sqrt(2 + eps)
    s0, s1 = 1 / math.sqrt(1 + eps), 2 / math.sqrt(2 + eps)
    assert scores[0].tolist() == pytest.approx([s0, s1], rel=1e-12)
    a1 = 1 / (1 + math.exp(s0 - s1))
    h = st.attnres_mix(ORACLE, cands, scores)
    assert h[0].tolist() == pytest.approx([(1 - a1) * 1 + a1 * 2, (1 - a1) * 1], rel=1e-12)


def test_attnres_weights_sum_to_one():
    torch.manual_seed(1)
    cands = torch.randn(5, 4, 64, dtype=torch.float64)
    scores = st.attnres_scores(ORACLE, cands, torch.rand(64) + 0.5, torch.randn(64), 1e-5)
    weights = torch.softmax(scores, dim=-1)
    assert torch.allclose(weights.sum(-1), torch.ones(5, dtype=torch.float64), atol=1e-12)
    # a mix of identical candidates is that candidate, whatever the scores
    same = cands[:, :1].expand(5, 4, 64)
    assert torch.allclose(st.attnres_mix(ORACLE, same, scores), cands[:, 0], atol=1e-12)


def situ_by_hand(g, u):
    return 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(u / 25)


@pytest.mark.parametrize("g,u", [(1.0, 1.0), (-2.5, 3.0), (0.3, -40.0), (12.0, 7.0)])
def test_situ_hand_values(g, u):
    got = st.situ(ORACLE, torch.tensor([g], dtype=torch.float64), torch.tensor([u], dtype=torch.float64), 4.0, 25.0)
    assert got.item() == pytest.approx(situ_by_hand(g, u), rel=1e-12)


def test_situ_soft_clips():
    big = torch.tensor([1000.0], dtype=torch.float64)
    # gate clips at +4 (tanh -> 1, sigmoid -> 1), the linear branch at +-25
    assert st.situ(ORACLE, big, big, 4.0, 25.0).item() == pytest.approx(100.0, rel=1e-12)
    assert st.situ(ORACLE, big, -big, 4.0, 25.0).item() == pytest.approx(-100.0, rel=1e-12)
    # a very negative gate is silenced by the sigmoid, not clipped to -4
    assert abs(st.situ(ORACLE, -big, big, 4.0, 25.0).item()) < 1e-80
    # bf16 mode rounds once, at the end
    out = st.situ(BF16, torch.tensor([1.0]), torch.tensor([1.0]), 4.0, 25.0)
    assert out.item() == torch.tensor(situ_by_hand(1.0, 1.0)).to(torch.bfloat16).item()


def test_router_selects_by_biased_score_weights_by_unbiased():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0])  # lifts expert 3 into the top 2
    ids, weights = st.route(ORACLE, logits, bias, k=2, scaling=1.0)
    assert ids.tolist() == [[0, 3]]
    sc = torch.sigmoid(logits[0])
    expected = torch.stack([sc[0], sc[3]]) / (sc[0] + sc[3])
    assert torch.allclose(weights[0], expected, atol=1e-15)
    assert weights.sum().item() == pytest.approx(1.0, abs=1e-15)


def test_router_ties_go_to_the_lower_expert():
    logits = torch.zeros(1, 6, dtype=torch.float64)
    bias = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.5, 0.5])
    ids, _ = st.route(ORACLE, logits, bias, k=3, scaling=1.0)
    assert ids.tolist() == [[1, 2, 3]]  # 1 and 3 lead; of the tied 2, 4, 5 the lowest id wins


def test_rms_two_roundings():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    w = torch.tensor([1.5, 1.0, 0.5, 2.0]).to(torch.bfloat16)
    inv = 1 / math.sqrt((1 + 4 + 9 + 16) / 4 + 1e-5)
    normed = torch.tensor([v * inv for v in (1.0, 2.0, 3.0, 4.0)]).to(torch.bfloat16).float()
    expected = (w.float() * normed).to(torch.bfloat16).float()
    assert torch.equal(st.rms(BF16, x, w, 1e-5), expected[None])


# -- the whole layer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def small_layer():
    cfg = preset("small")
    return cfg, random_layer(cfg, seed=11)


def test_bf16_reference_error_is_a_few_bf16_ulps(small_layer):
    cfg, weights = small_layer
    inputs = random_inputs(cfg, 8, 13, seed=3)
    ref = layer_post(**inputs, layer=13, weights=weights, cfg=cfg)
    oracle = layer_post(**inputs, layer=13, weights=weights, cfg=cfg, mode="oracle", forced_routes=ref.route_ids)
    assert ref.moe_out.dtype == torch.bfloat16 and oracle.moe_out.dtype == torch.float64
    err = rel_err(ref.moe_out, oracle.moe_out)
    assert 1e-4 < err < 2e-2  # bf16 rounds (2^-9) many times, but not wrongly
    assert rel_err(ref.prefix, oracle.prefix) < 4e-3
    assert torch.allclose(ref.route_weights.sum(-1), torch.ones(8), atol=1e-6)
    assert bool((ref.route_ids.diff(dim=-1) > 0).all())


def test_blocks_beyond_nb_are_ignored(small_layer):
    cfg, weights = small_layer
    inputs = random_inputs(cfg, 3, 13, seed=4, nb_max=5)
    a = layer_post(**inputs, layer=13, weights=weights, cfg=cfg)
    inputs["blocks"][:, cfg.num_blocks(13) :] = float("nan")
    b = layer_post(**inputs, layer=13, weights=weights, cfg=cfg)
    assert torch.equal(a.moe_out, b.moe_out)


@pytest.mark.parametrize("name,tps", [("tiny", (1, 2, 4)), ("small", (1, 2, 4, 8, 16))])
def test_tp_reference_matches_full_reference(name, tps):
    cfg = preset(name)
    weights = random_layer(cfg, seed=5)
    layer = 25
    inputs = random_inputs(cfg, 16, layer, seed=6)
    full = layer_post(**inputs, layer=layer, weights=weights, cfg=cfg)
    oracle = layer_post(**inputs, layer=layer, weights=weights, cfg=cfg, mode="oracle", forced_routes=full.route_ids)
    budget = 2 * rel_err(full.moe_out, oracle.moe_out)
    for tp in tps:
        shards = shard_all(weights, cfg, tp)
        got = layer_post_tp(**inputs, layer=layer, shards=shards, cfg=cfg)
        assert torch.equal(got.route_ids, full.route_ids), f"T={tp}"
        assert rel_err(got.moe_out, oracle.moe_out) <= budget, f"T={tp}"
        assert rel_err(got.prefix, oracle.prefix) <= 2 * rel_err(full.prefix, oracle.prefix) + 1e-7
        tp_oracle = layer_post_tp(
            **inputs, layer=layer, shards=shards, cfg=cfg, mode="oracle", forced_routes=full.route_ids
        )
        assert rel_err(tp_oracle.moe_out, oracle.moe_out) < 1e-12, f"T={tp}: the TP oracle is the same function"


# -- shards ---------------------------------------------------------------------


@pytest.mark.parametrize("tp", [8, 16])
def test_released_shard_shapes(tp):
    cfg = preset("kimi-k3")
    cfg.validate_tp(tp)
    shapes = shard_shapes(cfg, tp)
    full = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shard_shapes(cfg, 1).items()}
    parts = shard(LayerWeights(tp=1, rank=0, **full), cfg, tp, tp - 1)
    for name, (shape, dtype) in shapes.items():
        assert tuple(getattr(parts, name).shape) == shape, name
    if tp == 8:  # the numbers the engines use at TP8
        assert shapes["w1_packed"][0] == (896, 384, 1792)
        assert shapes["w2_packed"][0] == (896, 3584, 192)
        assert shapes["w2_scale"][0] == (896, 3584, 12)
        assert shapes["o_proj"][0] == (7168, 1536)
        assert shapes["router"][0] == (112, 7168)


@pytest.mark.parametrize(
    "field,value,tp,message",
    [
        (None, None, 3, "expected one of"),
        (None, None, 32, "expected one of"),
        ("num_experts", 900, 8, "does not divide num_experts"),
        ("num_attention_heads", 4, 8, "does not divide num_attention_heads"),
        ("moe_intermediate_size", 3072 + 4, 8, "does not divide moe_intermediate_size"),
        ("moe_intermediate_size", 16 * 48, 16, "whole number of MXFP4 groups"),
        ("routed_expert_hidden_size", 3584 + 4, 8, "routed_expert_hidden_size"),
    ],
)
def test_tp_validation(field, value, tp, message):
    import dataclasses

    cfg = preset("kimi-k3")
    if field:
        cfg = dataclasses.replace(cfg, **{field: value})
    with pytest.raises(K3InputError, match=message):
        cfg.validate_tp(tp)


def test_presets_admit_their_test_tps():
    for tp in (1, 2, 4):
        for cfg in PRESETS.values():
            cfg.validate_tp(tp)
    for tp in (8, 16):
        preset("small").validate_tp(tp)
        preset("kimi-k3").validate_tp(tp)


def test_config_json_round_trip_and_errors():
    cfg = preset("small")
    data = cfg.to_json()
    assert K3Config.from_json(data) == cfg
    nested = dict(data)
    nested["text_config"] = dict(data["text_config"], quantization_config=nested.pop("quantization_config"))
    assert K3Config.from_json(nested) == cfg
    for field, value, message in [
        ("hidden_act", "silu", "hidden_act"),
        ("moe_router_activation_func", "softmax", "moe_router_activation_func"),
        ("n_group", 8, "n_group"),
    ]:
        bad = dict(data, text_config=dict(data["text_config"], **{field: value}))
        with pytest.raises(K3InputError, match=message):
            K3Config.from_json(bad)
    bad = dict(data, quantization_config=dict(data["quantization_config"], format="nvfp4-pack-quantized"))
    with pytest.raises(K3InputError, match="mxfp4"):
        K3Config.from_json(bad)
    missing = dict(data, text_config={k: v for k, v in data["text_config"].items() if k != "num_experts"})
    with pytest.raises(K3InputError, match="num_experts"):
        K3Config.from_json(missing)


def test_bad_inputs_raise_before_work():
    cfg = preset("tiny")
    weights = random_layer(cfg, seed=1)
    good = random_inputs(cfg, 2, 13, seed=1)
    cases = [
        ("core", good["core"].float(), "core: expected dtype"),
        ("core", good["core"][:, :-1], "core: expected shape"),
        ("prefix", good["prefix"][:1], "prefix: expected shape"),
        ("blocks", good["blocks"][:, :1], "blocks: expected at least 2 AttnRes blocks"),
    ]
    for name, value, message in cases:
        with pytest.raises(K3InputError, match=message):
            layer_post(**dict(good, **{name: value}), layer=13, weights=weights, cfg=cfg)
    big = random_inputs(cfg, 17, 13, seed=1)
    with pytest.raises(K3InputError, match="too many tokens"):
        layer_post(**big, layer=13, weights=weights, cfg=cfg)
    with pytest.raises(K3InputError, match="layer"):
        layer_post(**good, layer=0, weights=weights, cfg=cfg)
