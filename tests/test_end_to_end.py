"""The CLI end to end on a checkpoint that k3mono did not write, against an
independent float64 implementation of k3-math.md written here in numpy."""

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from k3mono.cli import main

DIMS = dict(H=96, heads=4, v=16, E=16, K=4, I=128, shared=1, L=64)
LAYERS = (1, 13)  # one AttnRes block, then two
EPS = 1e-5


def config_json() -> dict:
    d = DIMS
    text = {
        "model_type": "kimi_k3",
        "hidden_size": d["H"],
        "num_attention_heads": d["heads"],
        "v_head_dim": d["v"],
        "num_experts": d["E"],
        "num_experts_per_token": d["K"],
        "moe_intermediate_size": d["I"],
        "num_shared_experts": d["shared"],
        "routed_expert_hidden_size": d["L"],
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "moe_router_activation_func": "sigmoid",
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": EPS,
        "attn_res_block_size": 12,
        "num_hidden_layers": 20,
        "first_k_dense_replace": 1,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
    }
    return {"text_config": text}


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] + [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def mxfp4_tensor(rng, rows, cols, scale_lo, scale_hi):
    """(packed u8 [rows, cols/2], scale u8 [rows, cols/32], float64 values [rows, cols])."""
    codes = rng.integers(0, 16, (rows, cols))
    scales = rng.integers(scale_lo, scale_hi + 1, (rows, cols // 32))
    values = E2M1[codes] * np.repeat(np.exp2(scales - 127.0), 32, axis=1)
    packed = (codes[:, ::2] + 16 * codes[:, 1::2]).astype(np.uint8)
    return torch.from_numpy(packed), torch.from_numpy(scales.astype(np.uint8)), values


def bf16_matrix(rng, rows, cols):
    t = torch.from_numpy(rng.standard_normal((rows, cols)) / np.sqrt(cols)).to(torch.bfloat16)
    return t, t.double().numpy()


def foreign_layer(rng, layer):
    """(released name -> tensor, the float64 arrays the oracle uses)."""
    d = DIMS
    H, C, E, I, L, SI = d["H"], d["heads"] * d["v"], d["E"], d["I"], d["L"], d["shared"] * d["I"]
    p = f"language_model.model.layers.{layer}."
    tensors, w = {}, {}

    def put(name, key, tensor):
        tensors[p + name] = tensor
        w[key] = tensor.double().numpy()

    put("self_attn.o_proj.weight", "o", bf16_matrix(rng, H, C)[0])
    put("mlp_res_norm.weight", "ares_norm", torch.from_numpy(1 + 0.2 * rng.standard_normal(H)).to(torch.bfloat16))
    put("mlp_res_proj.weight", "ares_proj", bf16_matrix(rng, 1, H)[0])
    put("post_attention_layernorm.weight", "post_norm", torch.from_numpy(1 + 0.2 * rng.standard_normal(H)).to(torch.bfloat16))
    put("block_sparse_moe.gate.weight", "gate", bf16_matrix(rng, E, H)[0])
    put("block_sparse_moe.gate.e_score_correction_bias", "bias", torch.from_numpy(0.05 * rng.standard_normal(E)).float())
    put("block_sparse_moe.routed_expert_down_proj.weight", "ld", bf16_matrix(rng, L, H)[0])
    put("block_sparse_moe.routed_expert_norm.weight", "ln", torch.from_numpy(1 + 0.2 * rng.standard_normal(L)).to(torch.bfloat16))
    put("block_sparse_moe.routed_expert_up_proj.weight", "lu", bf16_matrix(rng, H, L)[0])
    put("block_sparse_moe.shared_experts.gate_proj.weight", "sg", bf16_matrix(rng, SI, H)[0])
    put("block_sparse_moe.shared_experts.up_proj.weight", "su", bf16_matrix(rng, SI, H)[0])
    put("block_sparse_moe.shared_experts.down_proj.weight", "sd", bf16_matrix(rng, H, SI)[0])
    w["ares_proj"] = w["ares_proj"][0]
    for name, rows, cols, lo in (("w1", I, L, 120), ("w3", I, L, 120), ("w2", L, I, 118)):
        for e in range(E):
            packed, scale, values = mxfp4_tensor(rng, rows, cols, lo, lo + 2)
            tensors[p + f"block_sparse_moe.experts.{e}.{name}.weight_packed"] = packed
            tensors[p + f"block_sparse_moe.experts.{e}.{name}.weight_scale"] = scale
            w[(name, e)] = values
    return tensors, w


def write_checkpoint(folder, tensors, shards=4):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json()))
    names = sorted(tensors)
    random.Random(7).shuffle(names)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: files[i % shards] for i, n in enumerate(names)}
    for f in files:
        save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == f}, str(folder / f))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# -- the independent float64 implementation ------------------------------------------


def rmsnorm(x, eps=EPS):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def situ(g, u):
    return 4 * np.tanh(g / 4) / (1 + np.exp(-g)) * 25 * np.tanh(u / 25)


def oracle(w, layer, core, prefix, blocks, routes=None):
    """float64, no rounding anywhere; ``routes`` overrides the top-k selection."""
    nb = layer // 12 + 1
    P = prefix + core @ w["o"].T
    out, ids_all = np.zeros_like(P), []
    for s in range(P.shape[0]):
        V = np.concatenate([blocks[s, :nb], P[s : s + 1]])
        scores = (rmsnorm(V) * w["ares_norm"] * w["ares_proj"]).sum(-1)
        a = np.exp(scores - scores.max())
        h = (a / a.sum()) @ V
        x = rmsnorm(h) * w["post_norm"]
        sc = 1 / (1 + np.exp(-(w["gate"] @ x)))
        order = sorted(range(len(sc)), key=lambda e: (-(sc[e] + w["bias"][e]), e))
        ids = sorted(order[: DIMS["K"]]) if routes is None else list(routes[s])
        ids_all.append(ids)
        weights = sc[ids] / sc[ids].sum()
        z = w["ld"] @ x
        acc = sum(wt * (w[("w2", e)] @ situ(w[("w1", e)] @ z, w[("w3", e)] @ z)) for wt, e in zip(weights, ids))
        routed = w["lu"] @ (rmsnorm(acc) * w["ln"])
        shared = w["sd"] @ situ(w["sg"] @ x, w["su"] @ x)
        out[s] = routed + shared
    return out, P, np.array(ids_all)


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    folder = tmp_path_factory.mktemp("foreign")
    rng = np.random.default_rng(2026)
    tensors, arrays = {}, {}
    for layer in LAYERS:
        t, arrays[layer] = foreign_layer(rng, layer)
        tensors.update(t)
    write_checkpoint(folder / "ckpt", tensors)
    return folder, arrays


def run_cli(folder, layer, tokens, impl, tp, seed):
    rng = np.random.default_rng(seed)
    d = DIMS
    nb_max = layer // 12 + 2  # one block more than the layer reads
    inputs = {
        "core": torch.from_numpy(rng.standard_normal((tokens, d["heads"] * d["v"]))).to(torch.bfloat16),
        "prefix": torch.from_numpy(rng.standard_normal((tokens, d["H"]))).to(torch.bfloat16),
        "blocks": torch.from_numpy(rng.standard_normal((tokens, nb_max, d["H"]))).to(torch.bfloat16),
    }
    path_in, path_out = folder / f"in-{seed}.safetensors", folder / f"out-{impl}-{tp}-{seed}.safetensors"
    save_file(inputs, str(path_in))
    args = ["run", "--checkpoint", str(folder / "ckpt"), "--layer", str(layer), "--inputs", str(path_in)]
    assert main(args + ["--out", str(path_out), "--tp", str(tp), "--impl", impl, "--device", "cpu"]) == 0
    return {k: v.double().numpy() for k, v in inputs.items()}, load_file(str(path_out))


@pytest.mark.parametrize("impl", ["reference", "staged"])
@pytest.mark.parametrize("layer", LAYERS)
def test_run_matches_independent_float64(foreign, layer, impl):
    folder, arrays = foreign
    w = arrays[layer]
    for tokens, seed in ((1, 1), (5, 2)):
        inputs, ref = run_cli(folder, layer, tokens, "reference", 1, seed)
        want, want_prefix, want_ids = oracle(w, layer, **inputs)
        ref_err = rel(ref["moe_out"].double().numpy(), want)
        assert np.array_equal(ref["route_ids"].numpy(), want_ids)
        assert 0 < ref_err < 3e-2
        for tp in (1, 2, 4):
            _, got = run_cli(folder, layer, tokens, impl, tp, seed)
            assert got["moe_out"].dtype == torch.bfloat16 and got["route_ids"].dtype == torch.int64
            assert np.array_equal(got["route_ids"].numpy(), want_ids), f"T={tp}"
            assert rel(got["moe_out"].double().numpy(), want) <= 2 * ref_err, f"T={tp}"
            assert rel(got["prefix"].double().numpy(), want_prefix) <= 2 * rel(ref["prefix"].double().numpy(), want_prefix)
            weights = got["route_weights"].double().numpy()
            assert np.allclose(weights.sum(-1), 1.0, atol=1e-6)
