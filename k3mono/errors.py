"""The one error type bad input raises, and the checks that raise it.

Every check runs before any work starts: a caller that gets a ``K3InputError``
has had nothing computed and nothing written.
"""

from __future__ import annotations

import torch


class K3InputError(ValueError):
    """Bad input: names the thing, states what was expected and what came."""


def expect_tensor(name: str, tensor, shape: tuple, dtype: torch.dtype) -> None:
    """Raise unless ``tensor`` is a torch tensor of exactly ``shape`` and ``dtype``."""
    if not isinstance(tensor, torch.Tensor):
        raise K3InputError(f"{name}: expected a tensor of shape {list(shape)} {dtype}, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise K3InputError(f"{name}: expected shape {list(shape)}, got {list(tensor.shape)}")
    if tensor.dtype != dtype:
        raise K3InputError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")


def expect_dtype(name: str, tensor, dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise K3InputError(f"{name}: expected a {dtype} tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise K3InputError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")


def check_unit_stride(*named) -> None:
    for name, t in named:
        if t.stride(-1) != 1:
            raise K3InputError(f"{name}: expected unit stride along the last dim, got strides {list(t.stride())}")


def check_same_device(*named) -> None:
    device = named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise K3InputError(f"{name}: expected device {device} (as {named[0][0]}), got {t.device}")
