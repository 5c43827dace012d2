"""Small jit helpers shared by the stage kernels.

The CPU interpreter (TRITON_INTERPRET=1) multiplies bf16 bit patterns in
tl.dot, so interpreter builds upcast dot operands to fp32 first
(``UPCAST_DOT``); compiled builds feed bf16 to the tensor cores.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
UPCAST_DOT = INTERPRET


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation: a [M, K], b [K, N] (bf16 or fp32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
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
