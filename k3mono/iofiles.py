"""The CLI's input and output files (safetensors).

Inputs: ``core`` [S, C], ``prefix`` [S, H], ``blocks`` [S, nb_max, H], all bf16,
1 <= S <= MAX_TOKENS, nb_max >= the layer's AttnRes block count.
Outputs: ``moe_out`` [S, H] bf16, ``prefix`` [S, H] bf16 (updated), ``route_ids``
[S, K] int64, ``route_weights`` [S, K] fp32. Outputs are written atomically:
a reader sees the old file or the whole new one, never a partial one.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import K3Config
from .errors import K3InputError, expect_dtype, expect_tensor
from .validate import check_layer_inputs
from .weights import BF16, FP32

INPUT_NAMES = ("core", "prefix", "blocks")
OUTPUT_NAMES = ("moe_out", "prefix", "route_ids", "route_weights")


def read_inputs(path, cfg: K3Config, layer: int) -> dict[str, torch.Tensor]:
    """core/prefix/blocks from ``path``, checked against cfg and layer (extra tensors are ignored)."""
    cfg.validate_layer(layer)
    tensors = _load(Path(path))
    for name in INPUT_NAMES:
        if name not in tensors:
            raise K3InputError(f"inputs {path}: tensor {name} is missing (expected {', '.join(INPUT_NAMES)})")
    inputs = {name: tensors[name] for name in INPUT_NAMES}
    check_layer_inputs(cfg, layer, **inputs)
    return inputs


def _load(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise K3InputError(f"inputs: file {path} not found")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise K3InputError(f"inputs: {path} is not a readable safetensors file ({err})") from None


def write_outputs(path, moe_out, prefix, route_ids, route_weights) -> None:
    """Validate, then write atomically; a failure leaves no file behind."""
    expect_dtype("outputs moe_out", moe_out, BF16)
    if moe_out.dim() != 2:
        raise K3InputError(f"outputs moe_out: expected shape [S, H], got {list(moe_out.shape)}")
    expect_tensor("outputs prefix", prefix, tuple(moe_out.shape), BF16)
    expect_dtype("outputs route_ids", route_ids, torch.int64)
    if route_ids.dim() != 2 or route_ids.shape[0] != moe_out.shape[0]:
        raise K3InputError(f"outputs route_ids: expected shape [{moe_out.shape[0]}, K], got {list(route_ids.shape)}")
    expect_tensor("outputs route_weights", route_weights, tuple(route_ids.shape), FP32)
    tensors = dict(zip(OUTPUT_NAMES, (moe_out, prefix, route_ids, route_weights)))
    _save_atomic(Path(path), tensors, "outputs")


def write_inputs(path, inputs: dict[str, torch.Tensor]) -> None:
    """Save ``inputs`` as given, unchecked, so tests can also write bad input files."""
    _save_atomic(Path(path), inputs, "inputs")


def _save_atomic(path: Path, tensors: dict[str, torch.Tensor], what: str) -> None:
    if not path.parent.is_dir():
        raise K3InputError(f"{what}: folder {path.parent} does not exist")
    # Fresh contiguous CPU copies: results may live on a GPU or share storage,
    # and safetensors takes neither.
    cpu = {
        name: t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format) for name, t in tensors.items()
    }
    # Same folder, so os.replace is a rename within one filesystem (atomic).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(cpu, str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
