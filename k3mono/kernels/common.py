"""Small jit helpers shared by the stage kernels.

The CPU interpreter (TRITON_INTERPRET=1) multiplies bf16 bit patterns in
tl.dot, so interpreter builds upcast dot operands to fp32 first
(``UPCAST_DOT``); compiled builds feed bf16 to the tensor cores.

The interpreter (Triton 3.6) also converts between fp32 and bf16 wrongly:
``x.to(tl.bfloat16)`` truncates instead of rounding to nearest even, and the
bf16 -> fp32 upcast mangles subnormals. Every bf16 rounding of k3-math.md must
be bit-exact, so kernels convert through ``to_bf16`` / ``as_f32``: integer bit
arithmetic in interpreter builds (``BF16_BY_BITS``), the hardware conversion
(cvt.rn, already round-to-nearest-even) in compiled ones. The same holds for
``e4m3_pairs_to_fp16``: bit placement in the interpreter (which cannot run
inline PTX), cvt.rn.f16x2.e4m3x2 in compiled builds; both are exact.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
UPCAST_DOT = INTERPRET
BF16_BY_BITS = tl.constexpr(INTERPRET)
RANGE_BY_WHILE = tl.constexpr(INTERPRET)
"""The interpreter cannot run tl.range over bounds computed at run time (with
numpy 2 it calls int() on a one-element array and fails): such loops run as
while loops there and as software-pipelined for loops in compiled builds,
both over the same step function."""


def register_cap(max_registers: int | None) -> dict:
    """The maxnreg launch option where a cap is set (compiled builds only: the interpreter takes none)."""
    return {} if max_registers is None or INTERPRET else {"maxnreg": max_registers}


_BF16_SHIFT = tl.constexpr(16)  # a bf16 is the high half of an fp32
_BF16_HALF_ULP = tl.constexpr(0x7FFF)  # round-to-nearest: half an ulp, less one, plus the odd bit
_F32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
_F32_INF_BITS = tl.constexpr(0x7F800000)
_BF16_QUIET_BIT = tl.constexpr(0x40)  # keeps a NaN a NaN when its payload sits in the low half
_E4M3_SIGN_TO_FP16 = tl.constexpr(8)  # an e4m3 code's sign bit 7 goes to an fp16's bit 15
_E4M3_BITS_TO_FP16 = tl.constexpr(7)  # its exponent and mantissa bits 6..0 go to bits 13..7
_FP16_SIGN = tl.constexpr(0x8000)
_FP16_E4M3_FIELD = tl.constexpr(0x3F80)  # bits 13..7
_E4M3_IN_FP16 = tl.constexpr(256.0)  # the bits so placed read as the e4m3 value / 2^8 (fp16's exponent bias is 8 more)


@triton.jit
def to_bf16(x):
    """bf16(x), round to nearest even (x fp32); NaN stays NaN."""
    if BF16_BY_BITS:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        odd = (bits >> _BF16_SHIFT) & 1
        rounded = (bits + _BF16_HALF_ULP + odd) >> _BF16_SHIFT
        is_nan = (bits & _F32_ABS_MASK) > _F32_INF_BITS
        rounded = tl.where(is_nan, (bits >> _BF16_SHIFT) | _BF16_QUIET_BIT, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def e4m3_pairs_to_fp16(pairs):
    """(even, odd) fp16 values of uint16 pairs of e4m3 codes (little-endian: the even
    column's code in the low byte), exactly: every e4m3 value is an fp16 one.

    Compiled, two pairs (p, p') a call: one byte permute gathers (even, even') and
    (odd, odd'), and each converts to an fp16x2 register as the dots' operands hold
    them. A pair a call made two fp16 that were packed again: two permutes for four
    values instead of one (offline sm_90a, M1c's step: 130 PRMT against 66)."""
    if BF16_BY_BITS:
        low = ((pairs << _E4M3_SIGN_TO_FP16) & _FP16_SIGN) | ((pairs << _E4M3_BITS_TO_FP16) & _FP16_E4M3_FIELD)
        high = (pairs & _FP16_SIGN) | ((pairs >> (_E4M3_SIGN_TO_FP16 - _E4M3_BITS_TO_FP16)) & _FP16_E4M3_FIELD)
        return (low.to(tl.float16, bitcast=True) * _E4M3_IN_FP16,
                high.to(tl.float16, bitcast=True) * _E4M3_IN_FP16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {lo, hi}, t; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def as_f32(x):
    """x as fp32, exactly (x bf16 or fp32)."""
    if BF16_BY_BITS and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << _BF16_SHIFT).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def rsqrt_rn(x):
    """1 / sqrt(x), both steps correctly rounded: closer to torch.rsqrt than the
    hardware approximation; norms call it once per token, so the cost is nil."""
    return tl.div_rn(1.0, tl.sqrt_rn(x))


@triton.jit
def rms_value(v, weight, scale):
    """bf16(weight * bf16(v * scale)): k3-math's rms once its scale is known (v, weight fp32)."""
    return to_bf16(weight * as_f32(to_bf16(v * scale)))


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation: a [M, K], b [K, N] (bf16 or fp32)."""
    if UPCAST:
        return tl.dot(as_f32(a), as_f32(b), acc)
    return tl.dot(a, b, acc)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    """tanh from exp, stable for any x (tl has no tanh in every backend)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def situ(gate, up, BETA: tl.constexpr, LINEAR_BETA: tl.constexpr):
    """BETA*tanh(g/BETA)*sigmoid(g) * LINEAR_BETA*tanh(u/LINEAR_BETA), fp32 (unrounded)."""
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    return BETA * tanh(g / BETA) * sigmoid(g) * (LINEAR_BETA * tanh(u / LINEAR_BETA))


BULK_PREFETCH = tl.constexpr(not INTERPRET)  # prefetch_l2 is PTX: compiled builds only
PREFETCH_ALIGN = tl.constexpr(16)  # cp.async.bulk's address and size granule (bytes)


@triton.jit
def prefetch_l2(
    first_ptr,  # any element type: the range's first element
    end_ptr,  # the same type: one past its last element
):
    """Have the SM's copy engine pull the bytes [first_ptr, end_ptr) into L2
    (cp.async.bulk.prefetch, sm_90): one instruction from one thread, nothing
    held in registers and nothing waited for, so a CTA about to wait (or about
    to stream the range itself) keeps HBM busy at no cost of its own. The range
    is widened to the 16-byte bounds the instruction needs; the allocator's
    blocks are larger, so the widened range stays inside the allocation.
    Interpreter builds skip it (no PTX there)."""
    if BULK_PREFETCH:
        first = first_ptr.to(tl.int64) & -PREFETCH_ALIGN
        end = (end_ptr.to(tl.int64) + (PREFETCH_ALIGN - 1)) & -PREFETCH_ALIGN
        tl.inline_asm_elementwise(
            "{ .reg .pred lead; .reg .u32 tid; mov.u32 tid, %tid.x; setp.eq.u32 lead, tid, 0; "
            "@lead cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [first, (end - first).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

