"""Would tensor cores run the MXFP4 gate/up stage faster? A probe, not a path
of the library: expert_gate_up written for tl.dot, timed against the library's
FMA stage (kernels/experts.py) at one rank of TP8, with its g and u checked
against the exactly dequantised weights.

    python benchmarks/expert_mma_probe.py [--tokens 1 8 16]

The probe's tile (S tokens, K top-k, L latent, I_R = I/T; a task is one
(token, expert) pair and ROWS intermediate rows of it, BLOCK_G groups a step):

    words [ROWS, BLOCK_G, 4] int32   the packed bytes, one 16-byte group a thread
    a     [ROWS, BLOCK_G * 32] bf16  E2M1 * 2^(s - 127) * 2^-63, K permuted in each word
    b     [BLOCK_G * 32, 16] bf16    the token's z in the same order, in column 0 (tl.dot's N >= 16)
    acc   [ROWS, 16] fp32 += a @ b   the 2^63 given back once at the end

A word's nibbles k and k + 4 sit 16 bits apart, so one integer multiply and
one AND place both into a bf16x2 (sign on 15 / 31, the other three bits on
8..6 / 24..22: E2M1 * 2^-126, kernels/mxfp4.py's trick at bf16 positions),
and one packed multiply by 2^(s - 64) applies the group's scale exactly
(for scale bytes 59..191). The inline PTX returns the four bf16x2 words of a
word as eight bf16, so element j of a word's eight holds nibble
(j >> 1) + 4 * (j & 1); b is read in that order. Offline (sm_90a SASS) the
hot loop is 3.07 instructions a weight value at 64 rows and 4 warps (the
FMA stage: 4.34); on the H200 it ran at half the FMA stage's speed
(docs/PERF.md, 2026-12-04 ninth session).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from k3mono import mxfp4
from k3mono.bench import WEIGHT_SETS
from k3mono.config import preset
from k3mono.kernels import experts
from k3mono.planner import stage_geometry
from k3mono.synthetic import random_shard
from k3mono.timing import copy_bandwidth, time_graph

BF16X2_PLACE_MASK = tl.constexpr(0x81C081C0 - (1 << 32))  # bits 31, 24..22, 15, 8..6, as the int32 it is
SCALE_BIAS = tl.constexpr(63)  # bf16 exponent field of 2^(s - 64): s + 63
BF16_EXP_SHIFT = tl.constexpr(7)
OUT_RESCALE = tl.constexpr(2.0**63)  # the 2^-63 the weights carry, given back once
N_PAD = 16  # tl.dot's smallest N
TILES = ((64, 8, 4), (64, 16, 4), (32, 8, 2), (128, 8, 4))  # (rows, groups a step, warps)


@triton.jit
def _word_to_bf16(words, factor):
    """[..., 8] int32 (one word repeated) and its bf16x2 scale factor -> the
    word's eight weights as bf16, nibble (j >> 1) + 4 (j & 1) at j."""
    return tl.inline_asm_elementwise(
        """{ .reg .b32 m0, m1, m2, m3, s;
        shr.b32 s, $4, 8;
        and.b32 m0, $4, 0x000F000F; and.b32 m1, $4, 0x00F000F0;
        and.b32 m2, s, 0x000F000F; and.b32 m3, s, 0x00F000F0;
        mul.lo.u32 m0, m0, 4160; mul.lo.u32 m1, m1, 260; mul.lo.u32 m2, m2, 4160; mul.lo.u32 m3, m3, 260;
        and.b32 m0, m0, 0x81C081C0; and.b32 m1, m1, 0x81C081C0;
        and.b32 m2, m2, 0x81C081C0; and.b32 m3, m3, 0x81C081C0;
        mul.rn.bf16x2 $0, m0, $12; mul.rn.bf16x2 $1, m1, $12;
        mul.rn.bf16x2 $2, m2, $12; mul.rn.bf16x2 $3, m3, $12; }""",
        "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", [words, factor], dtype=tl.bfloat16, is_pure=True, pack=8)


@triton.jit
def _mxfp4_bf16_tile(words, scales):
    """words [R, G, 4] int32, scales [R, G] u8 -> [R, G * 32] bf16 weights * 2^-63."""
    R: tl.constexpr = words.shape[0]
    G: tl.constexpr = words.shape[1]
    factor = (scales.to(tl.int32) + SCALE_BIAS) << BF16_EXP_SHIFT
    factor = tl.broadcast_to((factor | (factor << 16))[:, :, None, None], (R, G, 4, 8))
    repeated = tl.broadcast_to(words[:, :, :, None], (R, G, 4, 8))
    return tl.reshape(_word_to_bf16(repeated, factor), (R, G * 32))


@triton.jit
def _gate_up_mma_kernel(
    z_ptr,  # bf16 [S, L]
    ids_ptr,  # int32 [S, K]
    w1_ptr,  # u8 [E, I_R, L/2]
    w1_scale_ptr,  # u8 [E, I_R, L/32]
    w3_ptr,  # u8 [E, I_R, L/2]
    w3_scale_ptr,  # u8 [E, I_R, L/32]
    out_ptr,  # fp32 [2, S, K, I_R] out: g, u
    S: tl.constexpr,
    K: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    TILES_A_PAIR: tl.constexpr = I_R // ROWS
    G_ROW: tl.constexpr = L // 32
    pair = tl.program_id(0) // TILES_A_PAIR
    rows = (tl.program_id(0) % TILES_A_PAIR) * ROWS + tl.arange(0, ROWS)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w1 = (w1_ptr + expert * (I_R * L // 2)).to(tl.pointer_type(tl.int32))
    w3 = (w3_ptr + expert * (I_R * L // 2)).to(tl.pointer_type(tl.int32))
    w1_scale = w1_scale_ptr + expert * (I_R * G_ROW)
    w3_scale = w3_scale_ptr + expert * (I_R * G_ROW)
    column = tl.arange(0, BLOCK_G * 32)
    place = column % 8
    element = (column // 8) * 8 + (place >> 1) + 4 * (place & 1)
    n = tl.arange(0, 16)
    word = tl.arange(0, 4)
    gate = tl.zeros((ROWS, 16), tl.float32)
    up = tl.zeros((ROWS, 16), tl.float32)
    for g0 in range(0, G_ROW, BLOCK_G):
        index = rows[:, None] * G_ROW + (g0 + tl.arange(0, BLOCK_G))[None, :]
        word_index = index[:, :, None] * 4 + word[None, None, :]
        b = tl.load(z_ptr + (pair // K) * L + g0 * 32 + element[:, None] + n[None, :] * 0, mask=n[None, :] == 0,
                    other=0.0)
        gate = tl.dot(_mxfp4_bf16_tile(tl.load(w1 + word_index), tl.load(w1_scale + index)), b, gate)
        up = tl.dot(_mxfp4_bf16_tile(tl.load(w3 + word_index), tl.load(w3_scale + index)), b, up)
    tl.store(out_ptr + pair * I_R + rows, tl.sum(gate, axis=1) * OUT_RESCALE)
    tl.store(out_ptr + (S * K + pair) * I_R + rows, tl.sum(up, axis=1) * OUT_RESCALE)


def exact_gate_up(shard, ids, z) -> torch.Tensor:
    """[2, S, K, I_R] fp32: z @ w1[e].T and z @ w3[e].T from the exactly dequantised weights."""
    out = []
    for packed, scale in ((shard.w1_packed, shard.w1_scale), (shard.w3_packed, shard.w3_scale)):
        rows = [[mxfp4.dequantize(packed[e], scale[e]) @ z[s].float() for e in ids[s].tolist()]
                for s in range(ids.shape[0])]
        out.append(torch.stack([torch.stack(r) for r in rows]))
    return torch.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    E, K, L, I_R = cfg.num_experts, cfg.num_experts_per_token, cfg.routed_expert_hidden_size, \
        cfg.moe_intermediate_size // args.tp
    sets = [random_shard(cfg, args.tp, seed=s, device="cuda") for s in range(WEIGHT_SETS)]
    bandwidth = copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    for S in args.tokens:
        ids = torch.stack([torch.randperm(E, device="cuda", generator=generator)[:K] for _ in range(S)]).int()
        z = torch.randn(S, L, device="cuda", generator=generator).to(torch.bfloat16)
        exact = exact_gate_up(sets[0], ids, z)
        read = S * K * 2 * I_R * (L // 2 + L // 32)  # packed bytes and scales (distinct pairs)
        geom = stage_geometry(cfg, args.tp, S)
        act = torch.empty(S, K, I_R, dtype=torch.bfloat16, device="cuda")
        fma = time_graph([lambda w=w: experts.launch_expert_gate_up(z, ids, w.w1_packed, w.w1_scale, w.w3_packed,
                                                                     w.w3_scale, act, geom, cfg) for w in sets])
        cells = [f"S={S:>2} FMA stage {fma * 1e6:6.1f} us ({read / fma / bandwidth:4.0%})"]
        for rows, block_g, warps in TILES:
            out = torch.full((2, S, K, I_R), float("nan"), device="cuda")

            def call(w, rows=rows, block_g=block_g, warps=warps, out=out):
                _gate_up_mma_kernel[(S * K * (I_R // rows),)](
                    z, ids, w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, out, S=S, K=K, L=L, I_R=I_R,
                    ROWS=rows, BLOCK_G=block_g, num_warps=warps)

            call(sets[0])
            err = ((out - exact).abs().amax() / exact.abs().amax()).item()
            seconds = time_graph([lambda w=w: call(w) for w in sets])
            cells.append(f"mma {rows}x{block_g}x{warps} {seconds * 1e6:6.1f} us ({read / seconds / bandwidth:4.0%}, "
                         f"err {err:.1e})")
        print(", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
