"""What the mono kernel and the MXFP4 expert kernels cost an SM, read from
their sm_90a builds without a GPU (k3mono/offline.py).

    PYTHONPATH=. python benchmarks/resource_check.py [--tokens 1 8 16] [--tp 8] [--loopback]
        [--gate-up-rows 32] [--down-rows 32] [--prefetch 0] [--expert-mma] [--expert-f16 1] [--ctas-per-sm 3]
        [--tiles x_token_groups=1 x_group_tokens=8] [--mla m1b|m1c] [--mla-kv fp8]
    PYTHONPATH=. python benchmarks/resource_check.py --m1c-alone [--tokens 1 4 16]
    PYTHONPATH=. python benchmarks/resource_check.py --m1b-alone [--tokens 1 16] [--m1b-splits 16]

For the mono kernel: registers, spills (and whether the task loop or a step
loop pays them) and shared memory, hence the CTAs an
SM holds (its grid is planned for mono.default_ctas_per_sm(S), the build capped
at the registers that keep them resident; CTAs past what fits would wait for a
whole earlier CTA to end). For the expert kernels: the same, and
their hot loop's SASS: instructions a weight value, by opcode. With
--expert-mma: the mono build with TileChoice.expert_mma and the expert
kernels on tensor cores (weights in mma order). With --m1c-alone: M1c
launched alone (fp8 and bf16 cache), its context loop's instructions a
step, the shared-memory and tensor-core ones by opcode. With --m1b-alone:
M1b launched alone (bf16 w_v), and its SASS's memory instructions in program
order (offline.memory_order: which loads wait behind which).
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.pop("TRITON_INTERPRET", None)  # real builds, not the interpreter

from k3mono import offline  # noqa: E402
from k3mono.config import preset  # noqa: E402
from k3mono.mono import DEFAULT_PREFETCH, default_ctas_per_sm, default_options_with, parse_option_fields  # noqa: E402

M1C_SPLITS = {1: 264, 4: 66, 16: 16}  # bench_mla.fused_splits at 132 SMs
M1C_CONTEXT = 2048  # the build does not depend on it (runtime lengths)
M1C_OPCODES = ("LDS", "LDSM", "STS", "LDGSTS", "F2FP", "HMMA", "BAR")

def usage_text(compiled) -> str:
    usage = offline.resource_usage(compiled)
    fits = offline.ctas_per_sm(usage, compiled.metadata.num_warps)
    return (f"{compiled.metadata.num_warps} warps, {usage['registers']} registers, stack {usage['stack']} B, "
            f"shared {usage['shared']} B -> {fits} CTAs fit a SM")


def m1c_alone(tokens_list) -> int:
    for kv in ("fp8", "bf16"):
        for tokens in tokens_list:
            splits = M1C_SPLITS.get(tokens, 16)
            compiled, grid = offline.m1c_build(kv, tokens, splits, M1C_CONTEXT)
            loop = max(offline.sass_loops(compiled), key=len)
            ops = offline.opcode_counts(loop)
            named = ", ".join(f"{op} {ops[op]}" for op in M1C_OPCODES)
            print(f"M1c {kv} S={tokens:>2} {splits} splits: grid {grid[0] * grid[1] * grid[2]} programs, "
                  f"{usage_text(compiled)}; context step {len(loop)} instructions ({named})", flush=True)
    return 0


def m1b_alone(tokens_list, splits: int) -> int:
    for tokens in tokens_list:
        compiled, grid = offline.m1b_build(tokens, splits)
        order = " ".join(f"{op}x{n}" if n > 1 else op for op, n in offline.memory_order(compiled))
        print(f"M1b S={tokens:>2} {splits} splits: grid {math.prod(grid)} programs, {usage_text(compiled)}; "
              f"memory order: {order}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--loopback", action="store_true", help="the benchmarks' loopback mono build (NP = 1)")
    parser.add_argument("--mla", default="", choices=["", "m1b", "m1c"],
                        help="an MLA layer's mono build: M1b, or M1c and M1b, folded in")
    parser.add_argument("--mla-kv", default="bf16", choices=["bf16", "fp8"], help="the cache M1c reads (--mla m1c)")
    parser.add_argument("--gate-up-rows", type=int, default=None,
                        help="the mono build's TileChoice.gate_up_rows (default: mono.default_tiles(S)'s)")
    parser.add_argument("--down-rows", type=int, default=None,
                        help="the mono build's TileChoice.down_rows (default: mono.default_tiles(S)'s)")
    parser.add_argument("--prefetch", type=int, default=None, help="the mono prefetch mode (mono.MonoBuild.prefetch)")
    parser.add_argument("--expert-mma", action="store_true", help="the expert tasks on tensor cores (TileChoice.expert_mma)")
    parser.add_argument("--expert-f16", type=int, default=None, choices=[0, 1],
                        help="the expert loops summing in f16 (TileChoice.expert_f16; default: "
                             "mono.default_tiles(S)'s)")
    parser.add_argument("--ctas-per-sm", type=int, default=None,
                        help="CTAs a SM the mono build plans, its registers capped to keep them resident "
                             "(default: mono.default_ctas_per_sm(S))")
    parser.add_argument("--tiles", nargs="*", default=[], help="NAME=VALUE: more TileChoice fields")
    parser.add_argument("--m1c-alone", action="store_true", help="M1c launched alone instead (fp8 and bf16 cache)")
    parser.add_argument("--m1b-alone", action="store_true", help="M1b launched alone instead, its memory order")
    parser.add_argument("--m1b-splits", type=int, default=16, help="--m1b-alone's M1c splits")
    args = parser.parse_args()
    if args.m1c_alone:
        return m1c_alone(args.tokens)
    if args.m1b_alone:
        return m1b_alone(args.tokens, args.m1b_splits)
    cfg = preset("kimi-k3")
    print(f"sm_90a builds, preset kimi-k3, T={args.tp}; mono with {'loopback' if args.loopback else 'full'} peers, "
          f"on {offline.H200_SMS} SMs")
    prefetch = DEFAULT_PREFETCH if args.prefetch is None else args.prefetch
    for tokens in args.tokens:
        given = {"gate_up_rows": args.gate_up_rows, "down_rows": args.down_rows, "expert_mma": args.expert_mma or None,
                 "expert_f16": args.expert_f16}
        fields = {**{name: int(v) for name, v in given.items() if v is not None}, **parse_option_fields(args.tiles)}
        tiles = default_options_with(tokens, fields).tiles
        ctas = default_ctas_per_sm(tokens) if args.ctas_per_sm is None else args.ctas_per_sm
        compiled, grid = offline.mono_build(cfg, args.tp, tokens, args.loopback, args.mla, tiles=tiles,
                                             prefetch=prefetch, ctas_per_sm=ctas, kv=args.mla_kv)
        experts_text = ("expert tasks on tensor cores" if tiles.expert_mma
                        else f"gate/up rows {tiles.gate_up_rows}, down rows {tiles.down_rows}, "
                             f"{'f16' if tiles.expert_f16 else 'fp32'} sums")
        task_loop, step_loops = offline.stack_traffic(compiled)
        print(f"S={tokens:>2} mono{'+' + args.mla if args.mla else ''} ({experts_text}, prefetch {prefetch}): "
              f"grid {grid[0]} CTAs (planned {ctas} a SM), {usage_text(compiled)}; stack loads and stores: "
              f"task loop {task_loop}, step loops {step_loops or 'none'}", flush=True)
        f16 = tiles.expert_f16 and not args.expert_mma
        for name, compiled, values in offline.expert_builds(cfg, args.tp, tokens, mma=args.expert_mma, f16=f16):
            loop = max(offline.sass_loops(compiled), key=len)
            ops = offline.opcode_counts(loop)
            top = ", ".join(f"{op} {n / values:.2f}" for op, n in ops.most_common(5))
            print(f"S={tokens:>2} {name}: {usage_text(compiled)}; hot loop {len(loop)} instructions for {values} values "
                  f"a thread = {len(loop) / values:.2f} a value ({top})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
