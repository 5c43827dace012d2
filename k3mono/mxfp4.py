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


MMA_WORDS_PER_GROUP = MXFP4_GROUP // 8
"""A group's 16 bytes as int32 words, each 8 nibbles."""
_MMA_PAIRS = 4  # bf16 pairs a word holds (nibbles q and q + 4)
_NIBBLE_BITS = 4
_MMA_CHUNK_GROUPS = 1 << 20  # groups reordered at once (a shard's experts hold hundreds of millions)


def _mma_words(group_bytes: torch.Tensor) -> torch.Tensor:
    """[N, 16] u8 groups -> [N, 4] int32 words in mma order (mma_order)."""
    # Element 2t + 8q + h sits in byte t + 4q, low nibble for h = 0: word t takes
    # the low nibbles of bytes t, t + 4, t + 8, t + 12 into its low half, their
    # high nibbles into its high half.
    by_quad = group_bytes.view(-1, _MMA_PAIRS, MMA_WORDS_PER_GROUP).to(torch.int32)  # [N, q, t]
    shifts = (torch.arange(_MMA_PAIRS, device=group_bytes.device, dtype=torch.int32) * _NIBBLE_BITS)[:, None]
    low = ((by_quad & 0xF) << shifts).sum(dim=1, dtype=torch.int32)
    high = ((by_quad >> _NIBBLE_BITS) << shifts).sum(dim=1, dtype=torch.int32)
    return low | (high << 16)


def mma_order(packed: torch.Tensor) -> torch.Tensor:
    """[..., R, C/2] u8 (compressed-tensors order) -> [..., R, C/8] int32 words for
    the tensor-core expert loops (kernels/mxfp4.py e2m1_mma_tile).

    Only the order inside each group's 16 bytes changes: word t of a group holds
    the group's elements 2t + 8q + h in nibble q + 4h (q = 0..3, h = 0, 1). An mma
    operand fragment gives thread t of each quad the element pairs (2t, 2t + 1)
    and (2t + 8, 2t + 9) of every 16 inputs, so word t is that thread's share of
    the group, and nibbles q and q + 4, 16 bits apart, become one bf16 pair. The
    scales are unchanged. An int32 tensor, so a launcher told to expect this
    order can tell it from the checkpoint's bytes."""
    if packed.dtype != torch.uint8 or packed.shape[-1] * 2 % MXFP4_GROUP:
        raise K3InputError(f"mma_order: expected uint8 [..., R, C/2] with C a multiple of {MXFP4_GROUP}, "
                           f"got {packed.dtype} {list(packed.shape)}")
    group_bytes = packed.contiguous().view(-1, MXFP4_GROUP // 2)
    words = torch.cat([_mma_words(chunk) for chunk in group_bytes.split(_MMA_CHUNK_GROUPS)])
    return words.view(*packed.shape[:-1], packed.shape[-1] // 4)


_NIBBLE_LOW_BITS = 0x77  # each nibble's exponent and mantissa bits (2..0)
_NIBBLE_SIGNS = 0x88  # each nibble's sign (bit 3)
_SIGN_TO_BIT0 = 3
_F16_CHUNK_BYTES = 1 << 26  # bytes turned at once (a shard's experts hold gigabytes: temporaries stay small)
F16_ORDER_DTYPE = torch.int8
"""The dtype of bytes in f16 order: a launcher tells them from the checkpoint's uint8 by it."""


def f16_order(packed: torch.Tensor) -> torch.Tensor:
    """[..., R, C/2] u8 (compressed-tensors order) -> the same bytes with each
    nibble's bits turned for the f16x2 expert loops (kernels/mxfp4.py
    e2m1_f16x2): sign from bit 3 to bit 0, exponent and mantissa bits from 2..0
    to 3..1. The elements and scales keep their places. An int8 tensor, so a
    launcher told to expect this order can tell it from the checkpoint's bytes."""
    _check_checkpoint_bytes("f16_order", packed)
    flat = packed.contiguous().view(-1)
    turned = torch.empty_like(flat)
    for source, target in zip(flat.split(_F16_CHUNK_BYTES), turned.split(_F16_CHUNK_BYTES)):
        _turn_nibbles(source, target)
    return turned.view(F16_ORDER_DTYPE).view(packed.shape)


def f16_order_(packed: torch.Tensor) -> torch.Tensor:
    """f16_order in place, for an engine that loads its experts once: the same
    storage turned chunk by chunk (no copy of the experts), returned as its int8
    view. ``packed`` (uint8, contiguous) must not be read as the checkpoint's
    bytes afterwards."""
    _check_checkpoint_bytes("f16_order_", packed)
    if not packed.is_contiguous():
        raise K3InputError(f"f16_order_: expected a contiguous tensor, got strides {list(packed.stride())}")
    for chunk in packed.view(-1).split(_F16_CHUNK_BYTES):
        _turn_nibbles(chunk, chunk)
    return packed.view(F16_ORDER_DTYPE)


def _check_checkpoint_bytes(name: str, packed) -> None:
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.shape[-1] * 2 % MXFP4_GROUP:
        got = f"{packed.dtype} {list(packed.shape)}" if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise K3InputError(f"{name}: expected uint8 [..., R, C/2] with C a multiple of {MXFP4_GROUP}, got {got}")


def _turn_nibbles(source: torch.Tensor, target: torch.Tensor) -> None:
    """target = source's bytes with each nibble's sign moved to bit 0 (target may be source)."""
    torch.bitwise_or((source & _NIBBLE_LOW_BITS) << 1, (source & _NIBBLE_SIGNS) >> _SIGN_TO_BIT0, out=target)


class ExpertOrderCache:
    """``order`` (mma_order or f16_order) of each distinct packed tensor, made once and shared;
    a tensor already of the order's ``dtype`` (turned by its owner, f16_order_ at load time)
    is taken as it is.

    The ranks of one runner and its staged layer often hold the same tensors
    (the benchmarks' loopback ranks all share rank 0's shard); converting each
    again would hold T + T copies of a shard's experts on the device. A hit
    needs the same storage, shape, stride and dtype; the cache keeps the source
    alive, so its address cannot be reused by another tensor while cached. The
    sources are weights: written in place afterwards, they need a new cache."""

    def __init__(self, order, dtype: torch.dtype):
        self.order, self.dtype = order, dtype
        self._made: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, packed: torch.Tensor) -> torch.Tensor:
        if packed.dtype == self.dtype:
            return packed
        key = (packed.device, packed.data_ptr(), packed.dtype, tuple(packed.shape), packed.stride())
        if key not in self._made:
            self._made[key] = (packed, self.order(packed))
        return self._made[key][1]

    @property
    def conversions(self) -> int:
        """Distinct tensors converted so far."""
        return len(self._made)


def expert_order(tiles) -> tuple:
    """The order a build's expert loops read their weights in (planner.TileChoice):
    (the conversion from the checkpoint's bytes, or None; its dtype; its name)."""
    if tiles.expert_mma:
        return mma_order, torch.int32, "mma order (k3mono.mxfp4.mma_order), as the build's tiles.expert_mma says"
    if tiles.expert_f16:
        return f16_order, F16_ORDER_DTYPE, "f16 order (k3mono.mxfp4.f16_order), as the build's tiles.expert_f16 says"
    return None, torch.uint8, "the checkpoint's bytes, as the build's tiles say"


def expert_order_cache(tiles) -> ExpertOrderCache | None:
    """A cache of the conversion expert_order names, or None for the checkpoint's bytes."""
    convert, dtype, _ = expert_order(tiles)
    return ExpertOrderCache(convert, dtype) if convert is not None else None
