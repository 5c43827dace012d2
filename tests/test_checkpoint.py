"""Checkpoint layout I/O, synthetic weights, and the CLI's input/output files."""

import json
import random
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from k3mono import checkpoint
from k3mono.checkpoint import INDEX_FILE, load_config, load_layer, tensor_names, write_checkpoint
from k3mono.config import K3Config, preset
from k3mono.errors import K3InputError
from k3mono.iofiles import read_inputs, write_inputs, write_outputs
from k3mono.mxfp4 import dequantize
from k3mono.synthetic import make_checkpoint, random_inputs, random_layer
from k3mono.weights import check_weights, shard

E8M0 = getattr(torch, "float8_e8m0fnu", None)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    # Bytes, not values: torch.equal calls -0 == +0 and would miss a flipped sign bit.
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), what


# -- a checkpoint written without k3mono's writer ---------------------------------

# Dimensions unlike any preset, so nothing can be read off a preset by accident.
TEXT = {
    "hidden_size": 64,
    "num_attention_heads": 2,
    "v_head_dim": 32,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 64,
    "num_shared_experts": 1,
    "routed_expert_hidden_size": 32,
    "attn_res_block_size": 12,
    "num_hidden_layers": 5,
    "first_k_dense_replace": 1,
}
LAYER = 2
PREFIX = f"language_model.model.layers.{LAYER}."


def released_config(**overrides) -> dict:
    """config.json as the release writes it: text_config plus compressed-tensors quantization."""
    text = {
        "model_type": "kimi_k3",
        **TEXT,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-5,
        **overrides,
    }
    weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True}
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "weights": weights}},
    }
    return {"architectures": ["KimiK3ForConditionalGeneration"], "text_config": text, "quantization_config": quant}


def np_pack(codes: np.ndarray) -> np.ndarray:
    """[R, C] nibble codes -> [R, C/2] u8: element 2i low nibble, 2i + 1 high nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def np_decode(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """E2M1 from its bit fields (sign bit 3, exponent bits 2..1, mantissa bit 0) times 2^(byte - 127)."""
    sign = np.where(codes & 8, -1.0, 1.0)
    exp, man = (codes >> 1) & 3, codes & 1
    magnitude = np.where(exp == 0, 0.5 * man, (1 + 0.5 * man) * 2.0 ** (exp - 1))
    return sign * magnitude * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)


def foreign_layer(seed: int = 0):
    """(released name -> tensor, LayerWeights field -> expected tensor, name -> decoded expert values)."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    H, C, E, I, L = 64, 64, 8, 64, 32
    SI = I

    def bf16(*shape):
        return torch.randn(shape, generator=g).to(torch.bfloat16)

    tensors = {
        "self_attn.o_proj.weight": bf16(H, C),
        "mlp_res_norm.weight": bf16(H),
        "mlp_res_proj.weight": bf16(1, H),
        "post_attention_layernorm.weight": bf16(H),
        "block_sparse_moe.gate.weight": bf16(E, H),
        "block_sparse_moe.gate.e_score_correction_bias": torch.randn(E, generator=g),
        "block_sparse_moe.routed_expert_down_proj.weight": bf16(L, H),
        "block_sparse_moe.routed_expert_norm.weight": bf16(L),
        "block_sparse_moe.routed_expert_up_proj.weight": bf16(H, L),
        "block_sparse_moe.shared_experts.gate_proj.weight": bf16(SI, H),
        "block_sparse_moe.shared_experts.up_proj.weight": bf16(SI, H),
        "block_sparse_moe.shared_experts.down_proj.weight": bf16(H, SI),
    }
    fields = {
        "o_proj": "self_attn.o_proj.weight",
        "ares_norm": "mlp_res_norm.weight",
        "post_norm": "post_attention_layernorm.weight",
        "router": "block_sparse_moe.gate.weight",
        "router_bias": "block_sparse_moe.gate.e_score_correction_bias",
        "latent_down": "block_sparse_moe.routed_expert_down_proj.weight",
        "latent_norm": "block_sparse_moe.routed_expert_norm.weight",
        "latent_up": "block_sparse_moe.routed_expert_up_proj.weight",
        "shared_gate": "block_sparse_moe.shared_experts.gate_proj.weight",
        "shared_up": "block_sparse_moe.shared_experts.up_proj.weight",
        "shared_down": "block_sparse_moe.shared_experts.down_proj.weight",
    }
    expected = {field: tensors[name] for field, name in fields.items()}
    expected["ares_proj"] = tensors["mlp_res_proj.weight"].reshape(H)
    decoded = {}
    for w, (rows, cols) in {"w1": (I, L), "w3": (I, L), "w2": (L, I)}.items():
        packed_all, scale_all = [], []
        for e in range(E):
            codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
            scale = rng.integers(117, 138, (rows, cols // 32), dtype=np.uint8)
            packed = torch.from_numpy(np_pack(codes))
            scale_t = torch.from_numpy(scale)
            packed_all.append(packed)
            scale_all.append(scale_t)
            base = f"block_sparse_moe.experts.{e}.{w}."
            tensors[base + "weight_packed"] = packed
            # Some exporters store E8M0 scales with torch's float8 dtype: same bits.
            on_disk = scale_t.view(E8M0) if E8M0 is not None and e % 2 else scale_t
            tensors[base + "weight_scale"] = on_disk
            decoded[(w, e)] = np_decode(codes, scale)
        expected[f"{w}_packed"] = torch.stack(packed_all)
        expected[f"{w}_scale"] = torch.stack(scale_all)
    return {PREFIX + name: t for name, t in tensors.items()}, expected, decoded


def write_foreign(ckpt_dir, tensors: dict, config: dict | None = None, shards: int = 3, seed: int = 0) -> dict:
    """Shuffle the tensors over ``shards`` files with plain safetensors calls; returns the weight_map."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "config.json").write_text(json.dumps(config or released_config()))
    extra = {
        "language_model.model.embed_tokens.weight": torch.zeros(4, 64, dtype=torch.bfloat16),
        "language_model.model.layers.0.mlp.gate_proj.weight": torch.zeros(8, 64, dtype=torch.bfloat16),
    }
    names = list(tensors) + list(extra)
    random.Random(seed).shuffle(names)
    everything = tensors | extra
    files = [f"model-{n + 1:05d}-of-{shards:05d}.safetensors" for n in range(shards)]
    weight_map = {name: files[i % shards] for i, name in enumerate(names)}
    for file in files:
        save_file({n: everything[n] for n in names if weight_map[n] == file}, str(ckpt_dir / file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (ckpt_dir / INDEX_FILE).write_text(json.dumps(index))
    return weight_map


def test_loads_a_checkpoint_written_without_k3mono(tmp_path):
    tensors, expected, decoded = foreign_layer()
    write_foreign(tmp_path, tensors)
    cfg, weights = load_layer(tmp_path, LAYER)
    assert cfg == K3Config(**TEXT)
    assert (weights.tp, weights.rank) == (1, 0)
    check_weights(weights, cfg)
    for field, want in expected.items():
        assert_same_bits(getattr(weights, field), want, field)
    # The loaded bytes mean what k3-math.md says they mean.
    for (w, e), values in decoded.items():
        got = dequantize(getattr(weights, f"{w}_packed")[e], getattr(weights, f"{w}_scale")[e], torch.float64)
        assert np.array_equal(got.numpy(), values), (w, e)


def test_single_file_checkpoint_without_index(tmp_path):
    tensors, expected, _ = foreign_layer()
    (tmp_path / "config.json").write_text(json.dumps(released_config()))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _, weights = load_layer(tmp_path, LAYER)
    for field, want in expected.items():
        assert_same_bits(getattr(weights, field), want, field)


def test_no_tensor_data_is_read_before_every_check_passes(tmp_path, monkeypatch):
    tensors, _, _ = foreign_layer()
    last = PREFIX + "block_sparse_moe.experts.7.w2.weight_scale"  # the last spec checked
    tensors[last] = tensors[last][:, :1].contiguous()
    write_foreign(tmp_path, tensors)
    reads = []
    real_open = checkpoint.safe_open

    class Spy:
        def __init__(self, path, framework):
            self.inner = real_open(path, framework=framework)

        def __enter__(self):
            self.opened = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.opened.keys()

        def get_slice(self, name):
            return self.opened.get_slice(name)

        def get_tensor(self, name):
            reads.append(name)
            return self.opened.get_tensor(name)

    monkeypatch.setattr(checkpoint, "safe_open", Spy)
    with pytest.raises(K3InputError, match=re.escape(last)):
        load_layer(tmp_path, LAYER)
    assert reads == []


# -- k3mono's own writer ----------------------------------------------------------


def test_write_load_round_trip_is_bit_exact(tmp_path):
    cfg = make_checkpoint(tmp_path, "tiny", layers=(1, 13), seed=5, shard_bytes=300_000)
    assert load_config(tmp_path) == cfg
    for layer in (1, 13):
        want = random_layer(cfg, 5 + layer)
        got_cfg, got = load_layer(tmp_path, layer)
        assert got_cfg == cfg
        for field, tensor in want.tensors().items():
            assert_same_bits(getattr(got, field), tensor, f"layer {layer} {field}")


def test_written_layout_matches_the_release(tmp_path):
    cfg = preset("tiny")
    layers = {1: random_layer(cfg, 1), 13: random_layer(cfg, 13)}
    write_checkpoint(tmp_path, cfg, layers, shard_bytes=300_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(tensor_names(cfg, 1)) | set(tensor_names(cfg, 13))
    files = sorted(set(weight_map.values()))
    assert len(files) > 2
    assert files == [f"model-{n:05d}-of-{len(files):05d}.safetensors" for n in range(1, len(files) + 1)]
    total = 0
    for file in files:
        stored = load_file(str(tmp_path / file))
        size = sum(t.numel() * t.element_size() for t in stored.values())
        assert size <= 300_000 or len(stored) == 1
        assert {n for n, f in weight_map.items() if f == file} == set(stored)
        total += size
    assert index["metadata"]["total_size"] == total
    # Shards are filled in order: layer 1's tensors all come before layer 13's.
    assert weight_map["language_model.model.layers.1.self_attn.o_proj.weight"] == files[0]
    last_name = f"language_model.model.layers.13.block_sparse_moe.experts.{cfg.num_experts - 1}.w2.weight_scale"
    assert weight_map[last_name] == files[-1]
    first = load_file(str(tmp_path / files[0]))
    H, I, L = cfg.hidden_size, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    assert first["language_model.model.layers.1.mlp_res_proj.weight"].shape == (1, H)
    last = load_file(str(tmp_path / files[-1]))
    w2_scale = last[last_name]
    assert (w2_scale.shape, w2_scale.dtype) == ((L, I // 32), torch.uint8)


def test_tensor_names_cover_the_layer():
    cfg = preset("tiny")
    names = tensor_names(cfg, 7)
    assert len(names) == 12 + 6 * cfg.num_experts
    assert names["language_model.model.layers.7.block_sparse_moe.gate.e_score_correction_bias"] == "router_bias"
    assert names["language_model.model.layers.7.block_sparse_moe.experts.3.w2.weight_scale"] == "w2_scale[3]"
    assert names["language_model.model.layers.7.mlp_res_proj.weight"] == "ares_proj"


def test_writer_rejects_tensor_parallel_shards(tmp_path):
    cfg = preset("tiny")
    part = shard(random_layer(cfg, 0), cfg, 2, 0)
    with pytest.raises(K3InputError, match="tp=1"):
        write_checkpoint(tmp_path, cfg, {1: part})


# -- bad checkpoints --------------------------------------------------------------


def _load_error(ckpt_dir, layer=LAYER) -> str:
    with pytest.raises(K3InputError) as err:
        load_layer(ckpt_dir, layer)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_tensor_names_it(tmp_path):
    tensors, _, _ = foreign_layer()
    name = PREFIX + "block_sparse_moe.experts.5.w3.weight_packed"
    del tensors[name]
    write_foreign(tmp_path, tensors)
    assert name in _load_error(tmp_path)


def test_tensor_absent_from_the_shard_the_index_names(tmp_path):
    tensors, _, _ = foreign_layer()
    weight_map = write_foreign(tmp_path, tensors)
    name = PREFIX + "block_sparse_moe.gate.weight"
    weight_map[name] = next(f for f in set(weight_map.values()) if f != weight_map[name])
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    message = _load_error(tmp_path)
    assert name in message and weight_map[name] in message


def test_missing_shard_file_names_file_and_a_tensor(tmp_path):
    tensors, _, _ = foreign_layer()
    weight_map = write_foreign(tmp_path, tensors)
    file = "model-00002-of-00003.safetensors"
    (tmp_path / file).unlink()
    message = _load_error(tmp_path)
    assert file in message
    assert any(name in message for name, f in weight_map.items() if f == file)


@pytest.mark.parametrize(
    "suffix, bad, expected, got",
    [
        ("self_attn.o_proj.weight", lambda t: t.float(), "torch.bfloat16", "torch.float32"),
        ("block_sparse_moe.gate.e_score_correction_bias", lambda t: t.bfloat16(), "torch.float32", "torch.bfloat16"),
        ("block_sparse_moe.experts.0.w1.weight_scale", lambda t: t.view(torch.int8), "torch.uint8", "torch.int8"),
        ("block_sparse_moe.gate.weight", lambda t: t.t().contiguous(), "[8, 64]", "[64, 8]"),
        ("mlp_res_proj.weight", lambda t: t.reshape(64), "[1, 64]", "[64]"),
        ("block_sparse_moe.experts.3.w2.weight_packed", lambda t: t[:, :-1].contiguous(), "[32, 32]", "[32, 31]"),
    ],
)
def test_wrong_dtype_or_shape(tmp_path, suffix, bad, expected, got):
    tensors, _, _ = foreign_layer()
    tensors[PREFIX + suffix] = bad(tensors[PREFIX + suffix])
    write_foreign(tmp_path, tensors)
    message = _load_error(tmp_path)
    assert PREFIX + suffix in message and expected in message and message.endswith(got)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"n_group": 8}, "n_group"),
    ],
)
def test_unsupported_config(tmp_path, overrides, field):
    tensors, _, _ = foreign_layer()
    write_foreign(tmp_path, tensors, config=released_config(**overrides))
    with pytest.raises(K3InputError, match=field):
        load_config(tmp_path)
    assert field in _load_error(tmp_path)


@pytest.mark.parametrize("layer", [0, 5, -1])
def test_not_an_moe_layer(tmp_path, layer):
    tensors, _, _ = foreign_layer()
    write_foreign(tmp_path, tensors)
    assert "MoE layer" in _load_error(tmp_path, layer)


def test_missing_config_json(tmp_path):
    tensors, _, _ = foreign_layer()
    write_foreign(tmp_path, tensors)
    (tmp_path / "config.json").unlink()
    assert "config.json" in _load_error(tmp_path)


def test_missing_index(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(released_config()))
    assert INDEX_FILE in _load_error(tmp_path)


# -- synthetic data ---------------------------------------------------------------


def test_random_layer_is_deterministic_and_well_formed():
    cfg = preset("tiny")
    a, b, c = random_layer(cfg, 3), random_layer(cfg, 3), random_layer(cfg, 4)
    check_weights(a, cfg)
    for field, tensor in a.tensors().items():
        assert_same_bits(getattr(b, field), tensor, field)
    assert not torch.equal(a.o_proj, c.o_proj) and not torch.equal(a.w2_packed, c.w2_packed)


def test_random_inputs_shapes():
    cfg = preset("tiny")
    inputs = random_inputs(cfg, 5, 13, seed=0, nb_max=8)
    assert {k: (tuple(v.shape), v.dtype) for k, v in inputs.items()} == {
        "core": ((5, cfg.core_width), torch.bfloat16),
        "prefix": ((5, cfg.hidden_size), torch.bfloat16),
        "blocks": ((5, 8, cfg.hidden_size), torch.bfloat16),
    }
    assert random_inputs(cfg, 2, 25, seed=0)["blocks"].shape[1] == 3


# -- the CLI's input and output files ----------------------------------------------


def test_inputs_round_trip(tmp_path):
    cfg = preset("tiny")
    inputs = random_inputs(cfg, 16, 13, seed=1, nb_max=8)
    write_inputs(tmp_path / "in.safetensors", inputs)
    got = read_inputs(tmp_path / "in.safetensors", cfg, 13)
    for name, tensor in inputs.items():
        assert_same_bits(got[name], tensor, name)


def _bad_inputs(cfg, name, tensor):
    inputs = random_inputs(cfg, 3, 13, seed=2)
    if tensor is None:
        del inputs[name]
    else:
        inputs[name] = tensor
    return inputs


@pytest.mark.parametrize(
    "name, tensor, message",
    [
        ("core", None, "core is missing"),
        ("core", torch.zeros(3, 128), "expected dtype torch.bfloat16, got torch.float32"),
        ("blocks", torch.zeros(3, 2, 224, dtype=torch.float16), "blocks: expected dtype torch.bfloat16"),
        ("core", torch.zeros(3, 129, dtype=torch.bfloat16), "core: expected shape [S, 128], got [3, 129]"),
        ("prefix", torch.zeros(4, 224, dtype=torch.bfloat16), "prefix: expected shape [3, 224], got [4, 224]"),
        ("blocks", torch.zeros(2, 2, 224, dtype=torch.bfloat16), "blocks: expected shape [3, nb_max, 224]"),
        ("blocks", torch.zeros(3, 1, 224, dtype=torch.bfloat16), "at least 2 AttnRes blocks for layer 13, got 1"),
        ("core", torch.zeros(0, 128, dtype=torch.bfloat16), "expected at least 1 token, got 0"),
    ],
)
def test_bad_inputs(tmp_path, name, tensor, message):
    cfg = preset("tiny")
    path = tmp_path / "in.safetensors"
    write_inputs(path, _bad_inputs(cfg, name, tensor))
    with pytest.raises(K3InputError, match=re.escape(message)):
        read_inputs(path, cfg, 13)


def test_too_many_tokens(tmp_path):
    cfg = preset("tiny")
    path = tmp_path / "in.safetensors"
    write_inputs(path, random_inputs(cfg, 17, 13, seed=0))
    with pytest.raises(K3InputError, match="too many tokens: expected at most 16, got 17"):
        read_inputs(path, cfg, 13)


def test_inputs_file_missing(tmp_path):
    with pytest.raises(K3InputError, match="not found"):
        read_inputs(tmp_path / "absent.safetensors", preset("tiny"), 13)


def _outputs(S=4, H=224, K=6):
    return (
        torch.randn(S, H).bfloat16(),
        torch.randn(S, H).bfloat16(),
        torch.randint(0, 56, (S, K)),
        torch.rand(S, K),
    )


def test_write_outputs(tmp_path):
    path = tmp_path / "out.safetensors"
    outputs = _outputs()
    write_outputs(path, *outputs)
    stored = load_file(str(path))
    for name, tensor in zip(("moe_out", "prefix", "route_ids", "route_weights"), outputs):
        assert_same_bits(stored[name], tensor, name)
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


@pytest.mark.parametrize(
    "index, bad",
    [
        (0, torch.zeros(4, 224)),  # moe_out fp32
        (1, torch.zeros(4, 225, dtype=torch.bfloat16)),  # prefix shape
        (2, torch.zeros(4, 6, dtype=torch.int32)),  # route_ids int32
        (3, torch.zeros(4, 5)),  # route_weights shape
    ],
)
def test_write_outputs_leaves_no_file_when_validation_fails(tmp_path, index, bad):
    outputs = list(_outputs())
    outputs[index] = bad
    with pytest.raises(K3InputError):
        write_outputs(tmp_path / "out.safetensors", *outputs)
    assert list(tmp_path.iterdir()) == []
