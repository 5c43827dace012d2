"""MXFP4 in registers: jit helpers the expert stages dequantise with.

Layout (k3mono.mxfp4, compressed-tensors): a weight row of C inputs is C/2
bytes, element 2i in the low nibble of byte i; a nibble is sign (bit 3),
exponent (bits 2..1), mantissa (bit 0); byte ``scale[row, g]`` (E8M0)
multiplies inputs 32g .. 32g+31 by 2^(byte - 127).

Load shape. Packed bytes are read as little-endian int32 words: word w of a
group holds elements 8w .. 8w+7, element 8w + k in bits 4k .. 4k+3. A group
of 32 elements is 4 words = 16 contiguous bytes, so a tile
``words [G, R, 4]`` (G group columns, R rows) gives each thread one 128-bit
load per group, and ``scales [G, R]`` its one scale byte. Group columns lead
the shape: the compiler spreads lanes over the dims after the contiguous one
in order, so a warp's lanes read consecutive groups of a row, and a thread
keeps one group column over several rows, reusing its activations for each.
Activations (bf16) are read as int32 pairs: elements 2p and 2p + 1 of a
word's eight, one 4-byte load for two nibbles.

Bit placement (no table, no exp2, no select). Nibble k of a word goes to an
fp32 with its sign at bit 31 and its three other bits at bits 24..22 (the
two low exponent bits and the top mantissa bit):

    bits = ((word << (28 - 4k)) >>arith 6) & 0x81C00000

That fp32 is exactly E2M1 * 2^-126, the E2M1 subnormals included: exponent
field 0 makes 0.5 the fp32 subnormal 2^-127 and keeps 0 / -0 zeros; field
e >= 1 gives (1 + m/2) * 2^(e - 127). Three integer ops per value (ptxas: a
shift, SHF.R.S32 or SGXT, a LOP3; two for k = 7), then one FFMA.

The 2^-126 is never multiplied per value: activations carry a 2^63
pre-scale (``ACT_PRESCALE``, once per activation, shared by all rows of a
thread), a group's 32 products are summed, the sum is multiplied once by the
group's E8M0 factor 2^(s - 127) (an fp32 built from the scale byte's bits,
``s << 23``), and the finished dot by 2^63 (``OUT_RESCALE``). Every factor
is a power of two, so the result is the dot with ``mxfp4.dequantize`` up to
fp32 summation order, within these ranges:

* |activation| < 2^64, so that a * 2^63 stays finite;
* partial sums carry a 2^-63 factor: where one falls below the fp32 normal
  range (a group contribution under 2^-63 in magnitude) its rounding error
  is absolute, at most 2^-87 in true units per step, not relative;
* scale bytes 1 .. 254. Byte 0 (2^-127, only for groups whose largest
  weight is below 2^-125) reads as 0; byte 255 (E8M0 NaN) as +inf.

Two fp32 placements (constexpr ``DEQUANT``, bit-identical results; a third,
``DEQUANT_F16``, sums in f16 from bytes in another nibble order: see
"f16x2 placement" below):

* ``DEQUANT_SHIFT`` (0, the first scheme): the three ops above per value.
* ``DEQUANT_IMAD`` (1, default): a word is first split into four masked
  words holding one nibble pair 16 bits apart, (0, 4), (1, 5), (2, 6),
  (3, 7): ``w & 0x000F000F``, ``w & 0x00F000F0`` and the same of ``w >> 8``
  (five ops per eight values). In a masked word the pair's nibbles are the
  only bits, so one integer multiply by ``2^a + 2^(a - 6)`` writes the
  nibble twice, sign on bit 31 (copy ``2^a``) and the three other bits on
  24..22 (copy ``2^(a - 6)``), the two copies never overlapping (no
  carries), and the LOP3 keeps bits 31, 24..22:

      bits = (masked * (2^a + 2^(a - 6))) & 0x81C00000
      a = 28 (low nibble of the pair, even), 24 (low, odd), 12 (high, even), 8 (high, odd)

  Two ops a value (IMAD on the FMA pipe, LOP3 on the ALU pipe) plus 5/8:
  2.6 integer ops instead of 3, and the half-rate ALU pipe, which bounds
  the first scheme (SHF.R.S32 + LOP3, 2 of its 3), gets 1.6 a value.
  ptxas keeps the multiply an IMAD (a shift-add pair would cost what the
  first scheme does): tests/test_kernels_moe.py checks it in the SASS of an
  offline sm_90a build (k3mono/offline.py), and benchmarks/resource_check.py
  prints the instructions a value (4.5 gate/up, 5.7 down at TP8).

Why not tensor cores (bf16 placement + tl.dot): two nibbles 16 bits apart
go into one bf16x2 word in 4 ops (2 a value), but Triton then moves the
dequantised bf16 tile from its blocked layout into the mma operand layout
through shared memory (2 bytes written and read a value, beside the packed
bytes' cp.async round trip), and per-group scales force either one dot per
group or a bf16 multiply a value (exact only while 2^(s - 1) is a finite
bf16). Measured before (docs/PERF.md's brief): 27 % against 34 % for the
fp32 placement. The weights' fixed byte order rules out a load-time
shuffle; an mma.sync fragment fed in registers (inline PTX, K permuted so
a thread's fragment is one 32-bit word of a group) would avoid the
round trip but cannot run in the interpreter.

``mxfp4_dequant`` returns the exact dequantised values (tests, or a
tensor-core path): it undoes the 2^-126 before the scale, so every nibble
and every scale byte 1 .. 254 round-trips bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import MXFP4_GROUP
from .common import BF16_BY_BITS

_WORD_BITS = 32  # packed bytes are read as int32 words
_NIBBLE_BITS = 4  # one E2M1 value
_PACKING = 2  # E2M1 values per byte
_NIBBLES_PER_WORD = _WORD_BITS // _NIBBLE_BITS

GROUP = tl.constexpr(MXFP4_GROUP)  # inputs per E8M0 scale
NIBBLE_BITS = tl.constexpr(_NIBBLE_BITS)
NIBBLES_PER_WORD = tl.constexpr(_NIBBLES_PER_WORD)
WORDS_PER_GROUP = tl.constexpr(MXFP4_GROUP // _NIBBLES_PER_WORD)  # 4 words = 16 bytes: one 128-bit load per group
SIGN_TO_TOP = tl.constexpr(28)  # left shift 28 - 4k puts nibble k's sign (bit 4k+3) on bit 31
EXP_ALIGN = tl.constexpr(6)  # arithmetic right shift: bits 30..28 -> 24..22, the sign stays on bit 31
# Keep bit 31 (sign) and bits 24..22 (exponent bits 1..0, mantissa bit 22);
# written as the int32 it is, so the AND stays in int32.
PLACE_MASK = tl.constexpr(0x81C00000 - (1 << 32))
FP32_EXP_SHIFT = tl.constexpr(23)  # an E8M0 byte s in the fp32 exponent field is 2^(s - 127)
E2M1_UNPLACE = tl.constexpr(2.0**126)  # placed value * 2^126 = the E2M1 value
ACT_PRESCALE = tl.constexpr(2.0**63)  # half of 2^126 on the activations ...
OUT_RESCALE = tl.constexpr(2.0**63)  # ... and half on the finished dot
PAIR = tl.constexpr(2)  # bf16 activations per int32 load
BF16_SHIFT = tl.constexpr(16)  # a bf16 is the high half of an fp32
BF16_HIGH_HALF = tl.constexpr(0xFFFF0000 - (1 << 32))  # as the int32 it is

DEQUANT_SHIFT = 0  # shl, sar, and per value (the first scheme)
DEQUANT_IMAD = 1  # pair masks per word, then imad + and per value
DEFAULT_DEQUANT = DEQUANT_IMAD
_IMAD = tl.constexpr(DEQUANT_IMAD)
PAIR_MASK_EVEN = tl.constexpr(0x000F000F)  # nibbles 0 and 4 (of w, or 2 and 6 of w >> 8)
PAIR_MASK_ODD = tl.constexpr(0x00F000F0)  # nibbles 1 and 5 (of w, or 3 and 7 of w >> 8)
PAIR_SPLIT = tl.constexpr(8)  # w >> 8 brings nibbles 2, 3, 6, 7 to 0, 1, 4, 5


@triton.jit
def e2m1_place(words, NIBBLE: tl.constexpr):
    """Nibble NIBBLE of every int32 word as the fp32 E2M1 * 2^-126 (exact)."""
    bits = ((words << (SIGN_TO_TOP - NIBBLE_BITS * NIBBLE)) >> EXP_ALIGN) & PLACE_MASK
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_pair_word(words, NIBBLE: tl.constexpr):
    """The masked word holding nibble NIBBLE (and its partner 4 away) alone."""
    QUAD: tl.constexpr = NIBBLE % 4  # 0..3: which pair (nibbles k and k + 4 share a word)
    if QUAD >= 2:
        src = words >> PAIR_SPLIT  # arithmetic: the sign fill is masked off
    else:
        src = words
    if QUAD % 2 == 1:
        return src & PAIR_MASK_ODD
    else:
        return src & PAIR_MASK_EVEN


@triton.jit
def e2m1_place_imad(masked, NIBBLE: tl.constexpr):
    """e2m1_place from the pair word of NIBBLE (e2m1_pair_word): one
    multiply writes the nibble with its sign on bit 31 and its other bits
    on 24..22; the mask keeps those. Bit-identical to e2m1_place."""
    # The copy 2^a puts the nibble's sign (bit POS + 3 of its masked word) on
    # bit 31, the copy 2^(a - 6) its other bits on 24..22: a = 28 - POS, POS
    # = 0, 4 (low nibble of the pair, even / odd) or 16, 20 (high).
    # (NIBBLE counts in the word w; 2, 3, 6, 7 sit in w >> 8 like 0, 1, 4, 5.)
    if NIBBLE < 4:
        if NIBBLE % 2 == 0:
            COPIES: tl.constexpr = (1 << 28) + (1 << 22)
        else:
            COPIES: tl.constexpr = (1 << 24) + (1 << 18)
    else:
        if NIBBLE % 2 == 0:
            COPIES: tl.constexpr = (1 << 12) + (1 << 6)
        else:
            COPIES: tl.constexpr = (1 << 8) + (1 << 2)
    bits = (masked * COPIES) & PLACE_MASK
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_nibble(words, NIBBLE: tl.constexpr, DEQUANT: tl.constexpr):
    """Nibble NIBBLE of every word as the fp32 E2M1 * 2^-126 by any placement
    (the pair masks are common subexpressions across nibbles; DEQUANT_F16, the
    words in f16 order, through its f16x2 pair: for mxfp4_dequant, not a loop)."""
    if DEQUANT == _IMAD:
        return e2m1_place_imad(e2m1_pair_word(words, NIBBLE), NIBBLE)
    elif DEQUANT == _F16:
        low, high = _f16_halves(e2m1_f16x2(words, NIBBLE % 4))
        if NIBBLE >= 4:
            return high * F16_TO_FP32_PLACED
        else:
            return low * F16_TO_FP32_PLACED
    else:
        return e2m1_place(words, NIBBLE)


@triton.jit
def e8m0_scale(scale_bytes):
    """uint8 E8M0 bytes 1..254 -> fp32 2^(byte - 127), exact."""
    return (scale_bytes.to(tl.int32) << FP32_EXP_SHIFT).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_dequant(words, scale_bytes, NIBBLE: tl.constexpr, DEQUANT: tl.constexpr = DEFAULT_DEQUANT):
    """words [G, R, 4] int32, scale_bytes [G, R] uint8 -> fp32 [G, R, 4]:
    element 8w + NIBBLE of each group, exactly mxfp4.dequantize."""
    return e2m1_nibble(words, NIBBLE, DEQUANT) * E2M1_UNPLACE * e8m0_scale(scale_bytes)[:, :, None]


@triton.jit
def load_mxfp4_tile(
    packed_base,  # u8 * (scalar, or [G, 1] per group column): row 0 of the column's [rows, G_ROW * 16] matrix
    scale_base,  # u8 * (scalar, or [G, 1]): row 0 of its [rows, G_ROW] scales
    groups,  # [G] int32: each column's group within a row
    col_ok,  # [G] bool
    rows,  # [R] int32
    row_ok,  # [R] bool
    G_ROW: tl.constexpr,  # groups per row (inputs / 32)
    EVICT_FIRST: tl.constexpr = False,  # L2 policy evict_first: the bytes are read once
):
    """-> words [G, R, 4] int32, scales [G, R] uint8 (zeros where masked)."""
    word = tl.arange(0, WORDS_PER_GROUP)
    ok = col_ok[:, None] & row_ok[None, :]
    index = rows[None, :] * G_ROW + groups[:, None]
    word_ptrs = (packed_base.to(tl.pointer_type(tl.int32)) + index * WORDS_PER_GROUP)[:, :, None] + word[None, None, :]
    if EVICT_FIRST:
        words = tl.load(word_ptrs, mask=ok[:, :, None], other=0, eviction_policy="evict_first")
    else:
        words = tl.load(word_ptrs, mask=ok[:, :, None], other=0)
    # Left contiguous, the scale bytes would get a vector layout of their own
    # and a shared-memory round trip (with barriers) per step to meet the words.
    scale_ptrs = scale_base + tl.max_contiguous(index, [1, 1])
    if EVICT_FIRST:
        scales = tl.load(scale_ptrs, mask=ok, other=0, eviction_policy="evict_first")
    else:
        scales = tl.load(scale_ptrs, mask=ok, other=0)
    return words, scales


@triton.jit
def act_pair_ptrs(
    act_base,  # bf16 * (scalar, or [G, 1]): element 0 of the column's activation row
    groups,  # [G] int32
    col_ok,  # [G] bool
):
    """int32 pointers [G, 4] to elements (8w, 8w + 1) of each column's group
    (add p for the pair 2p, 2p + 1), and their mask [G, 4]."""
    word = tl.arange(0, WORDS_PER_GROUP)
    pairs = act_base.to(tl.pointer_type(tl.int32)) + (groups * (GROUP // PAIR))[:, None]
    ptrs = pairs + word[None, :] * (NIBBLES_PER_WORD // PAIR)
    ok = tl.broadcast_to(col_ok[:, None], ptrs.shape)
    return ptrs, ok


@triton.jit
def load_act_pairs(act_ptrs, act_ok):
    """A step's activations as loaded: the int32 pairs (2P, 2P + 1) of every
    word, P = 0 .. 3, each [G, 4] (act_pair_ptrs)."""
    return (tl.load(act_ptrs, mask=act_ok, other=0), tl.load(act_ptrs + 1, mask=act_ok, other=0),
            tl.load(act_ptrs + 2, mask=act_ok, other=0), tl.load(act_ptrs + 3, mask=act_ok, other=0))


@triton.jit
def _bf16_of_pair(both, HIGH: tl.constexpr):
    """The high (HIGH) or low bf16 of int32 pairs as fp32, exactly. A bf16 is the
    high half of its fp32: the low element moves up, the high one is masked in place."""
    if HIGH:
        return (both & BF16_HIGH_HALF).to(tl.float32, bitcast=True)
    else:
        return (both << BF16_SHIFT).to(tl.float32, bitcast=True)


@triton.jit
def _prescaled_pair(both):
    """Activations of nibbles 2P and 2P + 1 from their int32 pair ``both``, as
    fp32 * 2^63, each [G, 1, 4] (broadcast over rows)."""
    low = _bf16_of_pair(both, False) * ACT_PRESCALE
    high = _bf16_of_pair(both, True) * ACT_PRESCALE
    return low[:, None, :], high[:, None, :]


@triton.jit
def _pair_terms(part, words, low, high, P: tl.constexpr, DEQUANT: tl.constexpr):
    """part + nibbles 2P and 2P + 1 of every word times their activations (two FFMAs)."""
    part += e2m1_nibble(words, PAIR * P, DEQUANT) * low
    part += e2m1_nibble(words, PAIR * P + 1, DEQUANT) * high
    return part


@triton.jit
def mxfp4_group_dot(words, acts, DEQUANT: tl.constexpr = DEFAULT_DEQUANT):
    """words [G, R, 4] int32, a step's activations ``acts`` (load_act_pairs,
    loaded by the caller, a step ahead if it likes) -> [G, R] fp32: each
    group's sum of E2M1 * a * 2^-63 (scale not applied).

    Pairs in the order 0, 2, 1, 3: pairs P and P + 2 share the masked words
    of DEQUANT_IMAD, which then die before the next two are made (fewer
    live registers; the fp32 sum's order is the compiler's anyway)."""
    low, high = _prescaled_pair(acts[0])
    part = _pair_terms(tl.zeros(words.shape, tl.float32), words, low, high, 0, DEQUANT)
    low, high = _prescaled_pair(acts[2])
    part = _pair_terms(part, words, low, high, 2, DEQUANT)
    low, high = _prescaled_pair(acts[1])
    part = _pair_terms(part, words, low, high, 1, DEQUANT)
    low, high = _prescaled_pair(acts[3])
    part = _pair_terms(part, words, low, high, 3, DEQUANT)
    return tl.sum(part, axis=2)


@triton.jit
def mxfp4_group_dot_pair(words_a, words_b, acts, DEQUANT: tl.constexpr = DEFAULT_DEQUANT):
    """mxfp4_group_dot of two weight tiles against one step's activations
    ``acts`` (load_act_pairs: loaded by the caller, a step ahead if it likes)."""
    low, high = _prescaled_pair(acts[0])
    part_a = _pair_terms(tl.zeros(words_a.shape, tl.float32), words_a, low, high, 0, DEQUANT)
    part_b = _pair_terms(tl.zeros(words_b.shape, tl.float32), words_b, low, high, 0, DEQUANT)
    low, high = _prescaled_pair(acts[2])
    part_a = _pair_terms(part_a, words_a, low, high, 2, DEQUANT)
    part_b = _pair_terms(part_b, words_b, low, high, 2, DEQUANT)
    low, high = _prescaled_pair(acts[1])
    part_a = _pair_terms(part_a, words_a, low, high, 1, DEQUANT)
    part_b = _pair_terms(part_b, words_b, low, high, 1, DEQUANT)
    low, high = _prescaled_pair(acts[3])
    part_a = _pair_terms(part_a, words_a, low, high, 3, DEQUANT)
    part_b = _pair_terms(part_b, words_b, low, high, 3, DEQUANT)
    return tl.sum(part_a, axis=2), tl.sum(part_b, axis=2)


# -- tensor-core placement: bf16 pairs for tl.dot -----------------------------------
#
# Weights in mma order (k3mono.mxfp4.mma_order: word t of a group holds its
# elements 2t + 8q + h in nibble q + 4h). The pair masks above leave nibbles q
# and q + 4 of a word alone, 16 bits apart; one multiply copies each into a
# bf16 half, sign to bit 15 (31) and the other three bits to 8..6 (24..22):
# exponent field = the nibble's two exponent bits, top mantissa bit = its
# mantissa bit, so each half is E2M1 * 2^-126 as in the fp32 placement (field
# 0 gives the bf16 subnormal 0.5 * 2^-126, or zero). Two ops (IMAD, LOP3) a
# bf16 pair, five a word for the masks. The pair (low, high) is elements
# (2t + 8q, 2t + 8q + 1) of the group: the register pair an mma fragment holds,
# so the tile reaches tl.dot without a layout change (offline sm_90a builds:
# no shared-memory round trip in the loop, tests/test_kernels_moe.py).
#
# Per-group scales cannot ride on a dot over many groups, so a step's
# activations are laid out block-diagonally (load_block_diagonal): column j
# holds group j's inputs only, one tl.dot gives every group's partial in its
# own column, and the [rows, MMA_N] result is multiplied by the scales once.
# The activations come pre-scaled by 2^63 (ACT_PRESCALE, exact in bf16) from
# memory, so the operand needs no register pass: the products (E2M1 * 2^-126
# times a * 2^63) stay in the fp32 normal range, and the finished dot gives
# the 2^63 back (OUT_RESCALE).

MMA_N = tl.constexpr(16)  # tl.dot's least N: the block-diagonal activations' columns, a step's groups at most
BF16X2_PLACE_MASK = tl.constexpr(0x81C081C0 - (1 << 32))  # each half: sign, exponent bits 1..0, mantissa bit 6
BF16X2_COPIES_EVEN = tl.constexpr((1 << 12) + (1 << 6))  # nibbles at bits 0 and 16: bit 3 -> 15, bits 2..0 -> 8..6
BF16X2_COPIES_ODD = tl.constexpr((1 << 8) + (1 << 2))  # nibbles at bits 4 and 20
HALF_BITS = tl.constexpr(16)


@triton.jit
def _bf16_halves(pair_word):
    """int32 holding two bf16 bit patterns -> [..., 2] bf16 (low half first)."""
    low = pair_word.to(tl.int16).to(tl.bfloat16, bitcast=True)
    high = (pair_word >> HALF_BITS).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.join(low, high)


@triton.jit
def _bf16_pair(words, Q: tl.constexpr):
    """Nibbles Q and Q + 4 of every mma-order word as [..., 2] bf16 (E2M1 * 2^-126)."""
    masked = e2m1_pair_word(words, Q)
    if Q % 2 == 0:
        placed = (masked * BF16X2_COPIES_EVEN) & BF16X2_PLACE_MASK
    else:
        placed = (masked * BF16X2_COPIES_ODD) & BF16X2_PLACE_MASK
    return _bf16_halves(placed)


@triton.jit
def e2m1_mma_tile(words):
    """words [R, G, 4] int32 in mma order -> bf16 [R, G * 32]: E2M1 * 2^-126,
    the groups' elements in their natural order (a tl.dot operand)."""
    R: tl.constexpr = words.shape[0]
    G: tl.constexpr = words.shape[1]
    # q = 2 qa + qb; the joins append qb, then qa: [R, G, t, h, qb, qa]
    quads = tl.join(tl.join(_bf16_pair(words, 0), _bf16_pair(words, 1)),
                    tl.join(_bf16_pair(words, 2), _bf16_pair(words, 3)))
    # element 8q + 2t + h of its group
    return tl.reshape(tl.permute(quads, (0, 1, 5, 4, 2, 3)), (R, G * GROUP))


@triton.jit
def load_mma_tile(
    words_base,  # i32 * (scalar, or [1, G] per group column): row 0 of the column's [rows, G_ROW * 4] words
    scale_base,  # u8 * (scalar, or [1, MMA_N]): row 0 of its [rows, G_ROW] scales
    groups,  # [G] int32: each column's group within a row
    col_ok,  # [G] bool
    scale_groups,  # [MMA_N] int32: the same columns, then any (masked)
    scale_ok,  # [MMA_N] bool: col_ok, then False
    rows,  # [R] int32
    row_ok,  # [R] bool
    G_ROW: tl.constexpr,  # groups per row (inputs / 32)
):
    """-> words [R, G, 4] int32 (zeros where masked), scales [R, MMA_N] uint8
    (zeros where masked: a zero factor for the empty columns)."""
    word = tl.arange(0, WORDS_PER_GROUP)
    index = rows[:, None] * G_ROW + groups[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    words = tl.load((words_base + index * WORDS_PER_GROUP)[:, :, None] + word[None, None, :], mask=ok[:, :, None],
                    other=0)
    scales = tl.load(scale_base + rows[:, None] * G_ROW + scale_groups[None, :],
                     mask=row_ok[:, None] & scale_ok[None, :], other=0)
    return words, scales


@triton.jit
def load_block_diagonal(
    act_ptrs,  # bf16 * [G * 32]: a step's activations, group-major
    act_ok,  # [G * 32] bool
):
    """-> [G * 32, MMA_N] bf16: column j holds group j's 32 activations and
    zeros elsewhere (G <= MMA_N; columns G.. all zero). Loaded K-major and
    transposed: each group's 64 bytes are whole 16-byte copies or skipped, so the
    loop's pipeliner fills the operand with async copies, no register pass."""
    K_STEP: tl.constexpr = act_ptrs.shape[0]
    tl.static_assert(K_STEP <= MMA_N * GROUP)
    group = tl.arange(0, K_STEP) // GROUP
    column = tl.arange(0, MMA_N)
    on_diagonal = (group[None, :] == column[:, None]) & act_ok[None, :]
    return tl.trans(tl.load(act_ptrs[None, :] + 0 * column[:, None], mask=on_diagonal, other=0.0))


# -- f16x2 placement: weights in f16 order, two products an HFMA2 -------------------
#
# k3mono.mxfp4.f16_order turns each nibble's bits so that its sign is bit 0 and
# its two exponent bits and mantissa bit are bits 3..1 (an int8 tensor, so a
# launcher can tell the order from the checkpoint's uint8 bytes). The pair
# masks above leave nibbles J and J + 4 of a word alone, 16 bits apart, at bit
# p = 0 or 4 of each half; one multiply by 2^(15 - p) + 2^(8 - p) writes each
# nibble twice, its sign on bit 15 (31) and its other bits on 11..9 (27..25),
# the copies never overlapping, and the mask keeps those bits: an f16x2 word of
# E2M1 * 2^-14 (exponent field = the two exponent bits, top mantissa bit = the
# mantissa bit; field 0 gives the f16 subnormal 0.5 * 2^-14, or zero). Two ops
# a pair (IMAD, LOP3), the five mask ops a word, and one HFMA2 takes the pair's
# two products: 17 ops a word of 8 values where the fp32 placement takes 29.
#
# Sums in f16. The activations come as f16 times 2^t, t chosen so that they stay
# below 2^15 in magnitude (``f16_scale_for``): each half of a group's f16x2 sum
# holds 16 products of at most 6 * 2^15 * 2^-14, so at most 192, far from f16's
# 65504; f16 keeps 11 significant bits (bf16 8), rounding each of the 16 sums.
# The group's two halves are added in fp32 and scaled by the E8M0 factor there;
# the finished dot gives back 2^(14 - t). Under the interpreter (no inline PTX)
# the f16 sums are computed in fp32 and rounded to f16 (the product of two f16
# is exact in fp32), the hardware rounds once: they differ only where the fp32
# sum lands on an f16 tie.

DEQUANT_F16 = 2  # weights in f16 order (k3mono.mxfp4.f16_order): f16x2 pairs and HFMA2
_F16 = tl.constexpr(DEQUANT_F16)
F16X2_PLACE_MASK = tl.constexpr(0x8E008E00 - (1 << 32))  # each half: sign (15), exponent bits 1..0 and mantissa bit (11..9)
F16X2_COPIES_EVEN = tl.constexpr((1 << 15) + (1 << 8))  # nibbles at bits 0 and 16: bit 0 -> 15, bits 3..1 -> 11..9
F16X2_COPIES_ODD = tl.constexpr((1 << 11) + (1 << 4))  # nibbles at bits 4 and 20
F16_PLACED_EXPONENT = tl.constexpr(14)  # a placed nibble is E2M1 * 2^-14
F16_TO_FP32_PLACED = tl.constexpr(2.0**-112)  # E2M1 * 2^-14 -> the fp32 placement's E2M1 * 2^-126
F16_ACT_LIMIT_EXPONENT = tl.constexpr(15)  # activations times 2^t stay below 2^15
_F32_BIAS = tl.constexpr(127)
_F32_MAX_POWER = tl.constexpr(126)  # the largest t: 2^t and 2^(14 - t) both normal fp32
_BF16_EXPONENT_SHIFT = tl.constexpr(7)  # a bf16's exponent field sits above its 7 mantissa bits
_BF16_ABS = tl.constexpr(0x7FFF)
_HALF_MASK = tl.constexpr(0xFFFF)


@triton.jit
def e2m1_f16x2(words, J: tl.constexpr):
    """Nibbles J and J + 4 of every f16-order word as one f16x2 (bits in an
    int32): E2M1 * 2^-14 each, nibble J in the low half."""
    masked = e2m1_pair_word(words, J)
    if J % 2 == 0:
        return (masked * F16X2_COPIES_EVEN) & F16X2_PLACE_MASK
    else:
        return (masked * F16X2_COPIES_ODD) & F16X2_PLACE_MASK


@triton.jit
def _f16_halves(pairs):
    """f16x2 words -> (low, high) as fp32 (exact)."""
    low = pairs.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (pairs >> HALF_BITS).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _f16x2_of(low, high):
    """fp32 (low, high) -> f16x2 words, each rounded to nearest even."""
    low_bits = low.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & _HALF_MASK
    high_bits = high.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return low_bits | (high_bits << HALF_BITS)


@triton.jit
def pack_f16x2(low, high):
    """fp32 (low, high) -> f16x2 words (cvt.rn: one instruction a pair)."""
    if BF16_BY_BITS:
        return _f16x2_of(low, high)
    else:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [low, high], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def hfma2(a, b, c):
    """a * b + c on f16x2 words, each half rounded once (HFMA2)."""
    if BF16_BY_BITS:
        a_low, a_high = _f16_halves(a)
        b_low, b_high = _f16_halves(b)
        c_low, c_high = _f16_halves(c)
        return _f16x2_of(a_low * b_low + c_low, a_high * b_high + c_high)
    else:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def hadd2(a, b):
    """a + b on f16x2 words (HADD2)."""
    if BF16_BY_BITS:
        a_low, a_high = _f16_halves(a)
        b_low, b_high = _f16_halves(b)
        return _f16x2_of(a_low + b_low, a_high + b_high)
    else:
        return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def f16x2_sum(pairs):
    """low + high of f16x2 words, in fp32."""
    if BF16_BY_BITS:
        low, high = _f16_halves(pairs)
        return low + high
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; .reg .f32 x, y; mov.b32 {l, h}, $1; cvt.f32.f16 x, l; cvt.f32.f16 y, h; "
            "add.f32 $0, x, y; }", "=f,r", [pairs], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def power_of_two(exponent):
    """int32 exponent in -126 .. 127 -> fp32 2^exponent (exact)."""
    return ((exponent + _F32_BIAS) << FP32_EXP_SHIFT).to(tl.float32, bitcast=True)


@triton.jit
def f16_scale_for(abs_max_bits):
    """The activations' scale 2^t and the dot's rescale 2^(14 - t), fp32, from
    the bf16 bits of their largest magnitude (an int32): t puts that magnitude
    just below 2^15. All-zero (or subnormal) activations take t = 126."""
    exponent = abs_max_bits >> _BF16_EXPONENT_SHIFT  # biased: the largest is below 2^(exponent - 126)
    t = tl.minimum(F16_ACT_LIMIT_EXPONENT + _F32_BIAS - 1 - exponent, _F32_MAX_POWER)
    return power_of_two(t), power_of_two(-t + F16_PLACED_EXPONENT)


@triton.jit
def bf16_abs_max_bits(row_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    """The bf16 bits (int32) of the largest magnitude among row_ptr[0 .. N) (bf16)."""
    offsets = tl.arange(0, BLOCK)
    most = tl.zeros((BLOCK,), tl.int32)
    for start in tl.static_range(0, N, BLOCK):
        bits = tl.load(row_ptr.to(tl.pointer_type(tl.int16)) + start + offsets, mask=start + offsets < N, other=0)
        most = tl.maximum(most, bits.to(tl.int32) & _BF16_ABS)
    return tl.max(most, axis=0)


@triton.jit
def f16_act_pairs(acts, scale):
    """A step's bf16 activations (load_act_pairs: int32 pairs (2P, 2P + 1) of
    every word) times ``scale`` as the f16x2 pairs the placed nibbles J and
    J + 4 meet, J = 0 .. 3, each [G, 1, 4] (broadcast over rows)."""
    p0, p1, p2, p3 = acts
    pair0 = _scaled_f16x2(p0, p2, False, scale)
    pair1 = _scaled_f16x2(p0, p2, True, scale)
    pair2 = _scaled_f16x2(p1, p3, False, scale)
    pair3 = _scaled_f16x2(p1, p3, True, scale)
    return pair0[:, None, :], pair1[:, None, :], pair2[:, None, :], pair3[:, None, :]


@triton.jit
def _scaled_f16x2(low_pair, high_pair, HIGH: tl.constexpr, scale):
    """One bf16 of each int32 pair (the high halves with HIGH, else the low) times
    ``scale``, as an f16x2: low_pair's in the low half."""
    return pack_f16x2(_bf16_of_pair(low_pair, HIGH) * scale, _bf16_of_pair(high_pair, HIGH) * scale)


@triton.jit
def _f16_word_sums(words, pairs):
    """Each word's 8 products in f16x2 (4 a half), [G, R, 4] int32."""
    pair0, pair1, pair2, pair3 = pairs
    acc = hfma2(e2m1_f16x2(words, 0), pair0, tl.zeros(words.shape, tl.int32))
    acc = hfma2(e2m1_f16x2(words, 2), pair2, acc)
    acc = hfma2(e2m1_f16x2(words, 1), pair1, acc)
    return hfma2(e2m1_f16x2(words, 3), pair3, acc)


@triton.jit
def mxfp4_f16_group_dot(words, pairs):
    """words [G, R, 4] int32 in f16 order, a step's activation pairs
    (f16_act_pairs) -> [G, R] fp32: each group's sum of E2M1 * a * 2^(t - 14)
    (scale not applied)."""
    sums = _f16_word_sums(words, pairs)
    # the four words' sums pairwise: (0 + 1) + (2 + 3), all in the thread's registers
    even, odd = tl.split(tl.reshape(sums, (sums.shape[0], sums.shape[1], WORDS_PER_GROUP // 2, 2)))
    first, second = tl.split(hadd2(even, odd))
    return f16x2_sum(hadd2(first, second))


@triton.jit
def mxfp4_f16_group_dot_pair(words_a, words_b, pairs):
    """mxfp4_f16_group_dot of two weight tiles against one step's activation pairs."""
    return mxfp4_f16_group_dot(words_a, pairs), mxfp4_f16_group_dot(words_b, pairs)


@triton.jit
def _dequant_kernel(
    packed_ptr,  # u8 [R, C/2]
    scale_ptr,  # u8 [R, C/32]
    out_ptr,  # fp32 [R, C] out
    G_ROW: tl.constexpr,  # C / 32
    BLOCK_G: tl.constexpr,  # pow2 >= G_ROW
    DEQUANT: tl.constexpr,
):
    """One row per program: the exact dequantised values (a test of the helpers)."""
    row = tl.program_id(0)
    rows = row + tl.arange(0, 1)
    groups = tl.arange(0, BLOCK_G)
    words, scales = load_mxfp4_tile(packed_ptr, scale_ptr, groups, groups < G_ROW, rows, rows >= 0, G_ROW)
    word = tl.arange(0, WORDS_PER_GROUP)
    base = out_ptr + row * (G_ROW * GROUP) + groups[:, None] * GROUP + word[None, :] * NIBBLES_PER_WORD
    ok = tl.broadcast_to((groups < G_ROW)[:, None], (BLOCK_G, WORDS_PER_GROUP))
    for k in tl.static_range(NIBBLES_PER_WORD):
        values = mxfp4_dequant(words, scales, k, DEQUANT)
        tl.store(base + k, tl.reshape(values, (BLOCK_G, WORDS_PER_GROUP)), mask=ok)


def launch_dequant(packed, scale, out, dequant: int = DEFAULT_DEQUANT) -> None:
    """packed [R, C/2] u8 (i8 in f16 order for DEQUANT_F16), scale [R, C/32] u8 -> out [R, C] fp32 (exact values)."""
    rows, groups = scale.shape
    if packed.shape != (rows, groups * MXFP4_GROUP // _PACKING) or out.shape != (rows, groups * MXFP4_GROUP):
        raise ValueError(f"launch_dequant: shapes {list(packed.shape)}, {list(scale.shape)}, {list(out.shape)} disagree")
    if scale.dtype != torch.uint8 or packed.dtype not in (torch.uint8, torch.int8) or out.dtype != torch.float32:
        raise ValueError("launch_dequant: expected uint8 (or int8 in f16 order) packed, uint8 scale, fp32 out")
    if (packed.dtype == torch.int8) != (dequant == DEQUANT_F16):
        raise ValueError("launch_dequant: int8 packed (f16 order) goes with DEQUANT_F16, uint8 with the others")
    _dequant_kernel[(rows,)](packed, scale, out, G_ROW=groups, BLOCK_G=triton.next_power_of_2(groups), DEQUANT=dequant, num_warps=1)
