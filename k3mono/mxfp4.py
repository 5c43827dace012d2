"""MXFP4 (E2M1 values, E8M0 scales, groups of 32) as compressed-tensors stores it.

``packed[o, i // 2]`` holds element ``2i`` in its low nibble and ``2i + 1`` in
its high nibble. A nibble is sign (bit 3), exponent (bits 2..1), mantissa
(bit 0): the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6. ``scale[o, g]`` multiplies
inputs ``32g .. 32g + 31`` of row ``o`` by ``2^(byte - 127)``.

Pure torch, no Triton: the reference and the checkpoint writer use it.
"""

from __future__ import annotations

import torch

from .config import MXFP4_GROUP
from .errors import K3InputError

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_MAX_EXPONENT = 2
"""6 = 1.5 * 2^2: a group's scale exponent is floor(log2(amax)) - 2 (the OCP MX rule)."""
E8M0_BIAS = 127


def e2m1_table(dtype=torch.float32, device=None) -> torch.Tensor:
    """The 16 nibble values, indexed by the nibble."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """[..., R, C/2] u8 + [..., R, C/32] u8 -> [..., R, C] exact values in ``dtype``."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise K3InputError(f"mxfp4: expected uint8 packed and scale, got {packed.dtype} and {scale.dtype}")
    cols = packed.shape[-1] * 2
    if scale.shape[-1] * MXFP4_GROUP != cols or scale.shape[:-1] != packed.shape[:-1]:
        raise K3InputError(
            f"mxfp4: scale shape {list(scale.shape)} does not cover packed shape {list(packed.shape)} "
            f"in groups of {MXFP4_GROUP}"
        )
    low = (packed & 0xF).long()
    high = (packed >> 4).long()
    nibbles = torch.stack([low, high], dim=-1).flatten(-2)
    values = e2m1_table(dtype, packed.device)[nibbles]
    factors = torch.exp2(scale.to(dtype) - E8M0_BIAS)
    return (values.unflatten(-1, (-1, MXFP4_GROUP)) * factors.unsqueeze(-1)).flatten(-2)


def quantize(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., R, C] float -> (packed [..., R, C/2] u8, scale [..., R, C/32] u8).

    Scale per group: 2^(floor(log2(amax)) - 2), so the group's largest value
    lands in [4, 8) before rounding (just under 4 where float32 log2 rounds an
    amax one step below a power of two up: a finer scale, never an overflow);
    values round to the nearest E2M1 value (ties to the smaller magnitude) and
    clip at 6. Only synthetic weights are made here, so the bytes need not
    match another quantiser's.
    """
    if weights.shape[-1] % MXFP4_GROUP:
        raise K3InputError(f"mxfp4: columns {weights.shape[-1]} are not a multiple of {MXFP4_GROUP}")
    w = weights.to(torch.float32)
    groups = w.unflatten(-1, (-1, MXFP4_GROUP))
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))), torch.zeros_like(amax))
    exponent = (exponent - E2M1_MAX_EXPONENT).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    index = (scaled.abs().clamp(max=E2M1_MAX).unsqueeze(-1) - mags).abs().argmin(dim=-1)
    nibbles = (index | ((scaled < 0) & (index > 0)).long() << 3).flatten(-2)
    packed = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)
    scale = (exponent + E8M0_BIAS).to(torch.uint8)
    return packed, scale
