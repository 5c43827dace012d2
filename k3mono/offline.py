"""Builds for a GPU this machine need not have: a kernel compiled for Hopper
(sm_90a) from the arguments its real launcher passes, then read back.

Triton compiles for any target it is told; ptxas, cuobjdump and nvdisasm ship
in the Triton wheel. So on a CPU-only machine one can see what the device
would run: registers, spills and shared memory (how many CTAs fit a SM), and
the SASS of a hot loop (instructions a value). The launch itself is
intercepted: the launcher validates and packs its arguments as always, the
kernel is compiled instead of run.

This needs real builds: import the kernels with TRITON_INTERPRET unset (the
interpreter's kernels cannot compile), e.g. in a subprocess of the tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile, make_backend
from triton.runtime.jit import create_function_from_signature

import torch

from .planner import SM_REGISTERS, TileChoice

HOPPER = GPUTarget("cuda", 90, 32)
SM_SHARED_BYTES = 228 * 1024
SM_MAX_THREADS = 2048
_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def capture_launch(kernel, launch) -> tuple[tuple, dict, tuple]:
    """(args, kwargs, grid) that ``launch()`` passes to ``kernel`` (not run)."""
    if not hasattr(kernel, "params"):
        raise RuntimeError("offline builds need TRITON_INTERPRET unset before the kernels are imported")
    captured = {}

    def intercept(*args, grid, warmup, **kwargs):
        captured.update(args=args, kwargs=kwargs, grid=grid)

    kernel.run, saved = intercept, kernel.run
    try:
        launch()
    finally:
        kernel.run = saved
    return captured["args"], captured["kwargs"], captured["grid"]


def compile_hopper(kernel, args, kwargs):
    """The kernel as the launch would build it, for sm_90a (a triton CompiledKernel)."""
    backend = make_backend(HOPPER)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False, instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER, options=options.__dict__)


def build_launch(kernel, launch):
    """compile_hopper of what ``launch()`` would launch: (compiled, grid)."""
    args, kwargs, grid = capture_launch(kernel, launch)
    return compile_hopper(kernel, args, kwargs), grid


def _cuobjdump(compiled, *flags) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        tool = os.path.join(_TOOLS, "cuobjdump")
        return subprocess.run([tool, *flags, cubin.name], capture_output=True, text=True, check=True).stdout


def resource_usage(compiled) -> dict:
    """ptxas's count: registers, stack bytes (spills land there), shared bytes (static + dynamic)."""
    found = dict(re.findall(r"(REG|STACK):(\d+)", _cuobjdump(compiled, "-res-usage")))
    return {"registers": int(found["REG"]), "stack": int(found["STACK"]), "shared": compiled.metadata.shared}


def ctas_per_sm(usage: dict, num_warps: int) -> int:
    """CTAs of this build an SM holds at once (registers, shared memory, threads)."""
    threads = 32 * num_warps
    by_registers = SM_REGISTERS // (usage["registers"] * threads)
    by_shared = SM_SHARED_BYTES // max(usage["shared"], 1)
    return min(by_registers, by_shared, SM_MAX_THREADS // threads)


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


def sass_loops(compiled) -> list[list[str]]:
    """The opcodes of every loop body in the SASS: the instructions from a
    backward branch's target to the branch (cuobjdump names targets by address)."""
    code = []
    for line in _cuobjdump(compiled, "-sass").splitlines():
        found = _INSTRUCTION.search(line)
        if found:
            code.append((int(found.group(1), 16), found.group(2), found.group(3)))
    loops = []
    for at, (address, opcode, operands) in enumerate(code):
        target = _BRANCH_TARGET.search(operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            start = next(i for i, (a, _, _) in enumerate(code) if a >= int(target.group(1), 16))
            loops.append([op for _, op, _ in code[start : at + 1]])
    return loops


def stack_traffic(compiled) -> tuple[int, list[int]]:
    """Local loads and stores (spills) inside the task loop (the longest loop: once a
    task) and inside each shorter loop with any (step loops: every step)."""
    spills = [sum(op.startswith(("LDL", "STL")) for op in body) for body in sorted(sass_loops(compiled), key=len)]
    return (spills[-1] if spills else 0), [n for n in spills[:-1] if n]


_ASYNC_WAIT = re.compile(r"ttg\.async_wait.*?\{num = (\d+) : i32\}")


def copies_left_in_flight(compiled) -> int:
    """The most cp.async groups any wait of the build leaves in flight (the TTGIR's
    async_wait num): 0 when every wait drains every copy, as a pipelined loop does
    whose copies' addresses need a load of their own step."""
    return max((int(n) for n in _ASYNC_WAIT.findall(compiled.asm["ttgir"])), default=0)


def opcode_counts(body: list[str]) -> Counter:
    """Opcodes by their base name (IMAD.SHL.U32 -> IMAD.SHL, LDG.E.128 -> LDG)."""
    def base(op: str) -> str:
        head, _, rest = op.partition(".")
        return f"{head}.{rest.split('.')[0]}" if head == "IMAD" and rest else head

    return Counter(base(op) for op in body)


# -- builds of this project's kernels at a config's shapes ------------------------------------

H200_SMS = 132
LAYER = 13  # any MoE layer with two AttnRes blocks


def empty_shard(cfg, tp: int):
    """A rank's shard of the right shapes and dtypes (a build reads no values)."""
    from .weights import LayerWeights, shard_shapes

    tensors = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in shard_shapes(cfg, tp).items()}
    return LayerWeights(tp=tp, rank=0, **tensors)


MLA_CONTEXT = 1024  # a build reads no lengths: any context compiles the same kernel


def mono_build(cfg, tp: int, tokens: int, loopback: bool, mla: str = "", max_registers: int | None = None,
               tiles: TileChoice | None = None, trace: bool = False, poll_sleep_ns: int | None = None,
               prefetch: int | None = None, ctas_per_sm: int | None = None, kv: str = "bf16"):
    """The mono kernel of rank 0 as the host path launches it: (compiled, grid).
    ``mla``: "" a plain layer, "m1b" M1b folded in, "m1c" M1c and M1b folded in
    (bench_mla's inputs: one request a token, its splits and page size, a ``kv``
    cache, "bf16" or "fp8", and bf16 w_v); ``max_registers`` the maxnreg cap (mono.MonoBuild; None: the one
    that keeps the planned CTAs resident); ``tiles``, ``poll_sleep_ns`` and
    ``ctas_per_sm`` MonoOptions' (None: mono.default_options');
    ``trace`` a trace build (k3mono/trace.py); ``prefetch`` the prefetch mode
    (mono.MonoBuild; None: mono.DEFAULT_PREFETCH)."""
    from .bench_mla import FOLD_SPLITS, PAGE_SIZE, m1b_inputs, mla_layer_inputs
    from .kernels import mono as mono_kernels
    from .mono import DEFAULT_PREFETCH, MonoRank, RankBuffers, buffer_bytes, build, default_options, mono_key
    from .planner import M1bShape, M1cShape
    from .synthetic import random_inputs

    m1b = M1bShape(splits=FOLD_SPLITS, latent=512) if mla else None
    m1c = M1cShape(page_size=PAGE_SIZE, requests=tokens, kv_fp8=kv == "fp8") if mla == "m1c" else None
    chosen = {name: value for name, value in (("tiles", tiles), ("poll_sleep_ns", poll_sleep_ns),
                                              ("ctas_per_sm", ctas_per_sm)) if value is not None}
    options = default_options(tokens, m1b=m1b, m1c=m1c, **chosen)
    key = mono_key(cfg, tokens, tp, LAYER, loopback=loopback, sms=H200_SMS, options=options, max_registers=max_registers,
                   trace=trace, prefetch=DEFAULT_PREFETCH if prefetch is None else prefetch)
    buffers = [torch.zeros(buffer_bytes(build(key).peer), dtype=torch.uint8) for _ in range(1 if loopback else tp)]
    rank = MonoRank(key, empty_shard(cfg, tp), 0, RankBuffers.allocate(build(key), buffers[0], buffers), layer=LAYER,
                    spin_limit=1)
    inputs = random_inputs(cfg, tokens, LAYER, seed=0)
    if mla == "m1b":
        rank.load_m1b_inputs(m1b_inputs(cfg, tokens, tp, "cpu", seed=0), inputs["prefix"], inputs["blocks"])
    elif mla == "m1c":
        m1c_in, m1b_in = mla_layer_inputs(cfg, tokens, MLA_CONTEXT, kv, tp, "cpu", seed=0)
        rank.load_m1b_inputs(m1b_in, inputs["prefix"], inputs["blocks"], m1c_in=m1c_in)
    else:
        rank.load_inputs(**inputs)
    return build_launch(mono_kernels._mono_kernel, rank.launch)


def m1c_build(kv_dtype: str, tokens: int, splits: int, context: int, tile: dict | None = None):
    """M1c alone as bench_mla launches it (one request a token; ``tile``: attn_call's, None its
    default): (compiled, grid)."""
    from .bench_mla import attn_call, make_inputs
    from .kernels import mla_attn

    call, _, _ = attn_call(make_inputs(tokens, context, kv_dtype, torch.device("cpu"), seed=0), splits, tile)
    return build_launch(mla_attn._mla_attn_kernel, call)


def m1b_build(tokens: int, splits: int):
    """M1b alone as bench_mla launches it (mla.BACK_TILE; bf16 w_v): (compiled, grid)."""
    from .bench_mla import attn_call, back_call, make_inputs
    from .kernels import mla_back

    inputs = make_inputs(tokens, MLA_CONTEXT, "bf16", torch.device("cpu"), seed=0)
    _, o, lse = attn_call(inputs, splits)
    call, _ = back_call(inputs, o, lse)
    return build_launch(mla_back._mla_back_kernel, call)


def memory_order(compiled, opcodes=("LDG", "LDGSTS", "UBLKPF", "STS", "BAR", "STG")) -> list:
    """The SASS's global loads and stores, L2 prefetches, shared stores and
    barriers in program order, as runs [(opcode, count)]: a load issued after a
    shared store or a barrier waits for whatever that store or barrier waits for."""
    runs = []
    for line in _cuobjdump(compiled, "-sass").splitlines():
        found = _INSTRUCTION.search(line)
        op = found and found.group(2).split(".")[0]
        if op in opcodes:
            if runs and runs[-1][0] == op:
                runs[-1] = (op, runs[-1][1] + 1)
            else:
                runs.append((op, 1))
    return runs


def expert_builds(cfg, tp: int, tokens: int, mma: bool = False, f16: bool = False):
    """(name, compiled, weight values a thread handles per step of the hot loop);
    ``mma``: the tensor-core loops (weights in k3mono.mxfp4.mma_order); ``f16``:
    the FMA loops summing in f16 (weights in k3mono.mxfp4.f16_order)."""
    from .kernels import experts
    from .mxfp4 import f16_order, mma_order
    from .planner import expert_mma_tile, stage_geometry

    geom, shard = stage_geometry(cfg, tp, tokens), empty_shard(cfg, tp)
    K, L, I_R = cfg.num_experts_per_token, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size // tp
    ids = torch.zeros(tokens, K, dtype=torch.int32)
    act = torch.zeros(tokens, K, I_R, dtype=torch.bfloat16)
    z = torch.zeros(tokens, L, dtype=torch.bfloat16)
    route_w, partial = torch.zeros(tokens, K), torch.zeros(tokens, L)
    if mma:
        w1, w3, w2 = (mma_order(t) for t in (shard.w1_packed, shard.w3_packed, shard.w2_packed))
        gate_up, _ = build_launch(experts._expert_gate_up_mma_kernel, lambda: experts.launch_expert_gate_up_mma(
            z, ids, w1, shard.w1_scale, w3, shard.w3_scale, act, tokens, cfg))
        down, _ = build_launch(experts._expert_down_mma_kernel, lambda: experts.launch_expert_down_mma(
            act, ids, route_w, w2, shard.w2_scale, partial, tokens, cfg))
    else:
        w1, w3, w2 = ((f16_order(t) if f16 else t) for t in (shard.w1_packed, shard.w3_packed, shard.w2_packed))
        gate_up, _ = build_launch(experts._expert_gate_up_kernel, lambda: experts.launch_expert_gate_up(
            z, ids, w1, shard.w1_scale, w3, shard.w3_scale, act, geom, cfg))
        down, _ = build_launch(experts._expert_down_kernel, lambda: experts.launch_expert_down(
            act, ids, route_w, w2, shard.w2_scale, partial, geom, cfg))
    gate_up_tile = expert_mma_tile(I_R) if mma else geom.expert_gate_up
    down_tile = expert_mma_tile(L) if mma else geom.expert_down
    per_step = {
        "expert_gate_up": 2 * gate_up_tile.rows * gate_up_tile.block_k // (32 * gate_up_tile.warps),
        "expert_down": down_tile.rows * down_tile.block_k // (32 * down_tile.warps),
    }
    return [("expert_gate_up", gate_up, per_step["expert_gate_up"]), ("expert_down", down, per_step["expert_down"])]
