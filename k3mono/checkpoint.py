"""Read and write one MoE layer's layer_post tensors in the released checkpoint layout.

Layout: ``config.json``, ``model.safetensors.index.json`` (``weight_map``:
tensor name -> shard file) and shards ``model-0000N-of-0000M.safetensors``; a
single ``model.safetensors`` without an index is accepted too. Routed experts
are stored one tensor per expert and matrix; ``LayerWeights`` stacks them.

The loader checks everything it can from the index and the shard headers
(names, files, shapes, dtypes) before it reads any tensor data, so a bad
checkpoint fails in seconds, not after reading a terabyte.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import MXFP4_GROUP, K3Config
from .errors import K3InputError
from .weights import BF16, FP32, U8, LayerWeights, check_weights

LAYER_PREFIX = "language_model.model.layers.{layer}."
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 2**30

# Same bits as uint8; some exporters store E8M0 scales with the float8 dtype.
E8M0 = getattr(torch, "float8_e8m0fnu", None)

_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E8M0": E8M0,
}


@dataclass(frozen=True)
class TensorSpec:
    """One released tensor: where it goes in ``LayerWeights`` and what it must be."""

    name: str  # full released name
    field: str  # LayerWeights field it feeds
    expert: int | None  # index into the field's expert axis, None for whole-field tensors
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def feeds(self) -> str:
        return self.field if self.expert is None else f"{self.field}[{self.expert}]"

    @property
    def accepted_dtypes(self) -> tuple[torch.dtype, ...]:
        if self.field.endswith("_scale") and E8M0 is not None:
            return (U8, E8M0)
        return (self.dtype,)


def _layer_table(cfg: K3Config) -> tuple[list, list]:
    """The released per-layer tensors (suffix, field, shape, dtype), derived from cfg."""
    H, C, E, L, I, SI = cfg.matrix_dims
    G = MXFP4_GROUP
    whole = [
        ("self_attn.o_proj.weight", "o_proj", (H, C), BF16),
        ("mlp_res_norm.weight", "ares_norm", (H,), BF16),
        ("mlp_res_proj.weight", "ares_proj", (1, H), BF16),
        ("post_attention_layernorm.weight", "post_norm", (H,), BF16),
        ("block_sparse_moe.gate.weight", "router", (E, H), BF16),
        ("block_sparse_moe.gate.e_score_correction_bias", "router_bias", (E,), FP32),
        ("block_sparse_moe.routed_expert_down_proj.weight", "latent_down", (L, H), BF16),
        ("block_sparse_moe.routed_expert_norm.weight", "latent_norm", (L,), BF16),
        ("block_sparse_moe.routed_expert_up_proj.weight", "latent_up", (H, L), BF16),
        ("block_sparse_moe.shared_experts.gate_proj.weight", "shared_gate", (SI, H), BF16),
        ("block_sparse_moe.shared_experts.up_proj.weight", "shared_up", (SI, H), BF16),
        ("block_sparse_moe.shared_experts.down_proj.weight", "shared_down", (H, SI), BF16),
    ]
    # Suffixes after "block_sparse_moe.experts.{e}."
    per_expert = [
        ("w1.weight_packed", "w1_packed", (I, L // 2), U8),
        ("w1.weight_scale", "w1_scale", (I, L // G), U8),
        ("w3.weight_packed", "w3_packed", (I, L // 2), U8),
        ("w3.weight_scale", "w3_scale", (I, L // G), U8),
        ("w2.weight_packed", "w2_packed", (L, I // 2), U8),
        ("w2.weight_scale", "w2_scale", (L, I // G), U8),
    ]
    return whole, per_expert


def tensor_specs(cfg: K3Config, layer: int) -> list[TensorSpec]:
    """Every released tensor ``layer``'s layer_post reads, in checkpoint order."""
    prefix = LAYER_PREFIX.format(layer=layer)
    whole, per_expert = _layer_table(cfg)
    specs = [TensorSpec(prefix + suffix, field, None, shape, dtype) for suffix, field, shape, dtype in whole]
    for e in range(cfg.num_experts):
        for suffix, field, shape, dtype in per_expert:
            name = f"{prefix}block_sparse_moe.experts.{e}.{suffix}"
            specs.append(TensorSpec(name, field, e, shape, dtype))
    return specs


def tensor_names(cfg: K3Config, layer: int) -> dict[str, str]:
    """Released tensor name -> the LayerWeights field it feeds (``w1_packed[e]`` for experts)."""
    return {spec.name: spec.feeds for spec in tensor_specs(cfg, layer)}


# -- loading -------------------------------------------------------------------


def load_config(ckpt_dir) -> K3Config:
    return K3Config.from_file(Path(ckpt_dir) / CONFIG_FILE)


def check_layer(ckpt_dir, layer: int, cfg: K3Config | None = None) -> tuple[K3Config, dict[str, list[TensorSpec]]]:
    """Without reading tensors: the config, and shard file -> the layer's specs in it;
    K3InputError on a layer out of range, a tensor not mapped or a shard file missing."""
    ckpt_dir = Path(ckpt_dir)
    cfg = cfg if cfg is not None else load_config(ckpt_dir)
    cfg.validate_layer(layer)
    return cfg, _locate(ckpt_dir, tensor_specs(cfg, layer))


def load_layer(ckpt_dir, layer: int, cfg: K3Config | None = None) -> tuple[K3Config, LayerWeights]:
    """The whole layer (tp = 1) from a checkpoint folder; K3InputError on anything wrong."""
    ckpt_dir = Path(ckpt_dir)
    cfg, by_shard = check_layer(ckpt_dir, layer, cfg)
    with contextlib.ExitStack() as stack:
        handles = {shard: stack.enter_context(_open_shard(ckpt_dir / shard)) for shard in by_shard}
        for shard, shard_specs in by_shard.items():
            names = set(handles[shard].keys())
            for spec in shard_specs:
                _check_header(handles[shard], names, shard, spec)
        fields = _read(handles, by_shard, cfg)
    return cfg, LayerWeights(tp=1, rank=0, **fields)


def _weight_map(ckpt_dir: Path, specs: list[TensorSpec]) -> tuple[str, dict[str, str]]:
    """(where the map came from, name -> shard file)."""
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as err:
            raise K3InputError(f"{INDEX_FILE}: {index} is not a JSON object ({err})") from None
        if not isinstance(weight_map, dict):
            raise K3InputError(f"{INDEX_FILE}: expected a 'weight_map' object, got {type(weight_map).__name__}")
        return INDEX_FILE, weight_map
    if (ckpt_dir / SINGLE_FILE).is_file():
        # Unsharded: everything is in the one file; the header check finds what is not.
        return SINGLE_FILE, {spec.name: SINGLE_FILE for spec in specs}
    raise K3InputError(f"checkpoint {ckpt_dir}: expected {INDEX_FILE} (or a single {SINGLE_FILE}), found neither")


def _locate(ckpt_dir: Path, specs: list[TensorSpec]) -> dict[str, list[TensorSpec]]:
    """Shard file -> the specs it holds, after checking every name is mapped and every file exists."""
    source, weight_map = _weight_map(ckpt_dir, specs)
    by_shard: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        if spec.name not in weight_map:
            raise K3InputError(f"checkpoint: tensor {spec.name} is missing from {source}")
        by_shard.setdefault(weight_map[spec.name], []).append(spec)
    for shard, shard_specs in by_shard.items():
        if not (ckpt_dir / shard).is_file():
            raise K3InputError(
                f"checkpoint: shard file {shard} (named by {source} for {shard_specs[0].name}) "
                f"not found in {ckpt_dir}"
            )
    return by_shard


@contextlib.contextmanager
def _open_shard(path: Path):
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise K3InputError(f"checkpoint: shard file {path.name} is not a readable safetensors file ({err})") from None
    with handle as opened:
        yield opened


def _check_header(handle, names: set[str], shard: str, spec: TensorSpec) -> None:
    """Shape and dtype from the shard header, before any data is read."""
    if spec.name not in names:
        raise K3InputError(f"checkpoint: tensor {spec.name} is not in shard file {shard}, where the index puts it")
    header = handle.get_slice(spec.name)
    raw_dtype = header.get_dtype()
    dtype = _SAFETENSORS_DTYPES.get(raw_dtype)
    if dtype not in spec.accepted_dtypes:
        expected = " or ".join(str(d) for d in spec.accepted_dtypes)
        raise K3InputError(f"checkpoint: tensor {spec.name}: expected dtype {expected}, got {dtype or raw_dtype}")
    shape = tuple(header.get_shape())
    if shape != spec.shape:
        raise K3InputError(f"checkpoint: tensor {spec.name}: expected shape {list(spec.shape)}, got {list(shape)}")


def _read(handles: dict, by_shard: dict[str, list[TensorSpec]], cfg: K3Config) -> dict[str, torch.Tensor]:
    """LayerWeights fields from the open shards; experts stacked into [E, ...] in place."""
    experts: dict[str, torch.Tensor] = {}
    fields: dict[str, torch.Tensor] = {}
    for shard, shard_specs in by_shard.items():
        for spec in shard_specs:
            tensor = handles[shard].get_tensor(spec.name)
            if spec.expert is None:
                fields[spec.field] = tensor
                continue
            if spec.field not in experts:
                # Preallocated so the stack never holds two copies of the experts.
                experts[spec.field] = torch.empty((cfg.num_experts, *spec.shape), dtype=spec.dtype)
            experts[spec.field][spec.expert] = tensor.view(torch.uint8)  # E8M0 scales: same bits
    fields["ares_proj"] = fields["ares_proj"].reshape(cfg.hidden_size)  # stored [1, H]
    return fields | experts


# -- writing -------------------------------------------------------------------


def write_checkpoint(
    ckpt_dir, cfg: K3Config, layers: dict[int, LayerWeights], shard_bytes: int = DEFAULT_SHARD_BYTES
) -> None:
    """config.json, shards filled in order up to ``shard_bytes`` each, and the index."""
    cfg.validate()
    for layer, weights in layers.items():
        cfg.validate_layer(layer)
        if weights.tp != 1:
            raise K3InputError(
                f"write_checkpoint: layer {layer}: expected whole-layer weights (tp=1), got tp={weights.tp}"
            )
        check_weights(weights, cfg)
    if shard_bytes <= 0:
        raise K3InputError(f"write_checkpoint: shard_bytes: expected a positive size, got {shard_bytes}")
    entries = [(spec, weights) for layer, weights in sorted(layers.items()) for spec in tensor_specs(cfg, layer)]
    shards = _pack(entries, shard_bytes)
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    weight_map = {}
    for n, shard in enumerate(shards, start=1):
        filename = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        # A fresh contiguous CPU copy each: safetensors refuses tensors that share
        # storage, and expert slices of one stacked tensor do.
        tensors = {
            spec.name: _released(spec, weights).to("cpu", copy=True, memory_format=torch.contiguous_format)
            for spec, weights in shard
        }
        save_file(tensors, str(ckpt_dir / filename), metadata={"format": "pt"})
        weight_map.update({spec.name: filename for spec, _ in shard})
    total = sum(_nbytes(spec) for spec, _ in entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (ckpt_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(spec: TensorSpec) -> int:
    return torch.Size(spec.shape).numel() * spec.dtype.itemsize


def _pack(entries: list, shard_bytes: int) -> list[list]:
    """Split entries in order into shards of at most shard_bytes (a bigger tensor gets its own)."""
    shards: list[list] = [[]]
    used = 0
    for entry in entries:
        size = _nbytes(entry[0])
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += size
    return shards


def _released(spec: TensorSpec, weights: LayerWeights) -> torch.Tensor:
    """The tensor as the release stores it: [1, H] mlp_res_proj, one tensor per expert."""
    tensor = getattr(weights, spec.field)
    if spec.expert is not None:
        tensor = tensor[spec.expert]
    return tensor.reshape(spec.shape)
