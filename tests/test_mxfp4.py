"""MXFP4 layout and rounding against hand-computed bytes and the spec in k3-math.md."""

import pytest
import torch

from k3mono.errors import K3InputError
from k3mono.mxfp4 import ExpertOrderCache, dequantize, e2m1_table, f16_order, f16_order_, mma_order, quantize

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _row(*values: float) -> torch.Tensor:
    """One 32-wide group: ``values`` then zeros, as a [1, 32] row."""
    row = torch.zeros(1, 32)
    row[0, : len(values)] = torch.tensor(values)
    return row


def test_quantize_hand_computed_bytes():
    # amax 6 = 1.5 * 2^2 -> scale exponent 0 -> byte 127 = 0x7F.
    # 0.5 -> nibble 0x1, -1 -> 0x8 | 0x2 = 0xA, 6 -> 0x7, 3 -> 0x5.
    packed, scale = quantize(_row(0.5, -1.0, 6.0, 3.0))
    assert scale.tolist() == [[0x7F]]
    # Element 0 in the low nibble, element 1 in the high nibble.
    assert packed[0, :3].tolist() == [0xA1, 0x57, 0x00]
    assert packed[0, 3:].eq(0).all()


def test_quantize_scale_per_group():
    # Group 0 scaled by 1/4: amax 1.5 -> exponent floor(log2 1.5) - 2 = -2 -> byte 125 = 0x7D.
    # Group 1: amax 12 -> exponent 3 - 2 = 1 -> byte 0x80; -12/2 = -6 -> 0xF, 2/2 = 1 -> 0x2.
    row = torch.cat([_row(0.125, -0.25, 1.5, 0.75), _row(-12.0, 2.0)], dim=1)
    packed, scale = quantize(row)
    assert scale.tolist() == [[0x7D, 0x80]]
    assert packed[0, :2].tolist() == [0xA1, 0x57]
    assert packed[0, 16].item() == 0x2F


def test_dequantize_hand_computed_bytes():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0], packed[0, 1] = 0xA1, 0x57
    scale = torch.tensor([[0x7E]], dtype=torch.uint8)  # 2^-1
    values = dequantize(packed, scale)
    assert values[0, :4].tolist() == [0.25, -0.5, 3.0, 1.5]
    assert values[0, 4:].eq(0).all()


def test_every_nibble_decodes_to_its_table_value():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    nibbles = torch.arange(16, dtype=torch.uint8)
    # Each nibble once as a low nibble (even element) and once as a high nibble (odd element).
    packed = (nibbles | ((15 - nibbles) << 4)).reshape(1, 16)
    values = dequantize(packed, torch.tensor([[127]], dtype=torch.uint8))[0]
    assert values[0::2].tolist() == expected
    assert values[1::2].tolist() == expected[::-1]
    assert torch.signbit(values[16]) and not torch.signbit(values[0])  # nibble 8 is -0
    assert e2m1_table().tolist() == expected


def test_round_trip_exact_on_scaled_grid():
    g = torch.Generator().manual_seed(1)
    rows, groups = 64, 6
    codes = torch.randint(0, 16, (rows, groups * 32), generator=g)
    codes[3, :32] = 0  # an all-zero group
    exponents = torch.randint(-20, 20, (rows, groups, 1), generator=g).float()
    x = (e2m1_table()[codes].unflatten(-1, (groups, 32)) * torch.exp2(exponents)).flatten(-2)
    packed, scale = quantize(x)
    assert torch.equal(dequantize(packed, scale), x)


def test_round_trip_error_within_half_a_grid_step():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 128, generator=g) * torch.exp2(torch.randint(-8, 8, (256, 1), generator=g).float())
    packed, scale = quantize(x)
    got = dequantize(packed, scale)
    step = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)  # [R, C] the group's unit
    scaled = x.abs() / step
    # Largest value per group lands in [4, 8) before rounding (the OCP MX scale rule).
    group_max = scaled.unflatten(-1, (-1, 32)).amax(-1)
    assert group_max.ge(4).all() and group_max.lt(8).all()
    # Inside the grid: error at most half the gap between the two neighbouring grid values.
    upper = torch.bucketize(scaled.clamp(max=6), GRID).clamp(min=1)
    half_gap = (GRID[upper] - GRID[upper - 1]) / 2
    inside = scaled <= 6
    assert ((got - x).abs() / step)[inside].le(half_gap[inside]).all()
    # Beyond 6 it clips to +-6 units, keeping the sign.
    assert torch.equal(got[~inside], torch.sign(x[~inside]) * 6 * step[~inside])


def test_mma_order_hand_computed_words():
    # Bytes 0, 4, 8, 12 of a group hold elements (0, 1), (8, 9), (16, 17), (24, 25):
    # word 0 takes their low nibbles (elements 0, 8, 16, 24) into nibbles 0..3 and
    # their high nibbles (elements 1, 9, 17, 25) into nibbles 4..7.
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0], packed[0, 4], packed[0, 8], packed[0, 12] = 0x21, 0x43, 0x65, 0x87
    packed[0, 3] = 0xF9  # word 3, nibbles 0 and 4
    words = mma_order(packed)
    assert words.dtype == torch.int32 and words.shape == (1, 4)
    assert words[0].tolist() == [0x86427531 - (1 << 32), 0, 0, 0x000F0009]


def test_mma_order_moves_each_element_to_its_fragment_nibble():
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (2, 3, 48), generator=g, dtype=torch.uint8)  # 3 groups a row
    words = mma_order(packed).long() & 0xFFFFFFFF
    elements = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    for t in range(4):
        for q in range(4):
            for h in range(2):
                nibble = (words[..., t::4] >> (4 * (q + 4 * h))) & 0xF
                assert torch.equal(nibble, elements[..., 2 * t + 8 * q + h :: 32])


def test_mma_order_rejects_other_layouts():
    with pytest.raises(K3InputError, match="mma_order"):
        mma_order(torch.zeros(2, 8, dtype=torch.uint8))  # 16 values a row: not whole groups
    with pytest.raises(K3InputError, match="mma_order"):
        mma_order(torch.zeros(2, 16, dtype=torch.int32))


def test_mma_order_cache_converts_each_distinct_tensor_once():
    """Ranks sharing a shard share its words; another view of the same storage is another tensor."""
    packed = torch.randint(0, 256, (4, 3, 32), dtype=torch.uint8)
    cache = ExpertOrderCache(mma_order, torch.int32)
    words = cache(packed)
    assert torch.equal(words, mma_order(packed))
    assert cache(packed) is words and cache.conversions == 1
    second_expert = cache(packed[1])
    assert torch.equal(second_expert, mma_order(packed[1])) and cache.conversions == 2


def test_f16_order_turns_every_nibble_and_keeps_its_place():
    """Each nibble s e1 e0 m becomes e1 e0 m s (sign to bit 0) where it was, as int8;
    the cache converts each distinct tensor once."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(2, 1)  # every byte: every nibble in both halves
    turned = f16_order(packed)
    assert turned.dtype == torch.int8 and turned.shape == packed.shape
    for half in (0, 4):
        nibble = (packed.int() >> half) & 0xF
        want = ((nibble & 0x7) << 1) | (nibble >> 3)
        assert torch.equal((turned.view(torch.uint8).int() >> half) & 0xF, want)
    cache = ExpertOrderCache(f16_order, torch.int8)
    assert cache(packed) is cache(packed) and cache.conversions == 1


def test_f16_order_in_place_turns_the_same_storage_and_the_cache_takes_it_as_it_is():
    """f16_order_ writes f16_order's bytes over the checkpoint's (no copy of the
    experts) and returns their int8 view; a tensor already in the order's dtype
    passes the cache unconverted; what it cannot turn in place is named."""
    packed = torch.randint(0, 256, (3, 4, 32), dtype=torch.uint8)
    want = f16_order(packed)
    storage = packed.data_ptr()
    turned = f16_order_(packed)
    assert turned.dtype == torch.int8 and turned.data_ptr() == storage and torch.equal(turned, want)
    cache = ExpertOrderCache(f16_order, torch.int8)
    assert cache(turned) is turned and cache.conversions == 0
    with pytest.raises(K3InputError, match="^f16_order_: expected uint8"):
        f16_order_(turned)
    with pytest.raises(K3InputError, match="^f16_order_: expected a contiguous tensor"):
        f16_order_(torch.zeros(4, 64, dtype=torch.uint8)[:, :32])
