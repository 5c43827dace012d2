"""What the mono kernel costs an SM, read from its sm_90 build without a GPU.

Triton compiles for a target it is told (here Hopper, sm_90a) on any machine;
ptxas reports the registers, spills and shared memory of the cubin, and from
them follows how many CTAs an SM can hold at once. The mono launch's grid is
planned for ``ctas_per_sm`` CTAs a SM: if the build cannot hold that many,
the extra CTAs wait for a whole earlier CTA to end (correct: every wait names
a lower ticket; but a CTA that spins holds its SM).

    python benchmarks/resource_check.py [--tokens 1 8] [--tp 8] [--loopback]

The kernel's launch arguments come from the real host path (mono.MonoRank /
k2_launch) on CPU tensors; the launch itself is intercepted and compiled
instead. Prints one line per build.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # a real build, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from k3mono.config import preset  # noqa: E402
from k3mono.kernels import mono as mono_kernels  # noqa: E402
from k3mono.mono import DEFAULT_CTAS_PER_SM, MonoRank, buffer_bytes, build, mono_key  # noqa: E402
from k3mono.synthetic import random_inputs  # noqa: E402
from k3mono.weights import LayerWeights, shard_shapes  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
SM_MAX_THREADS = 2048
H200_SMS = 132
LAYER = 13


def empty_shard(cfg, tp: int) -> LayerWeights:
    """A rank's shard of the right shapes and dtypes (the build reads no values)."""
    return LayerWeights(tp=tp, rank=0, **{name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in shard_shapes(cfg, tp).items()})


def launch_arguments(cfg, tp: int, tokens: int, loopback: bool) -> tuple[tuple, dict]:
    """The positional and keyword arguments k2_launch passes to the kernel."""
    key = mono_key(cfg, tokens, tp, LAYER, loopback=loopback, sms=H200_SMS)
    nbytes = buffer_bytes(build(key).peer)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(1 if loopback else tp)]
    rank = MonoRank(key, empty_shard(cfg, tp), 0, buffers[0], buffers, layer=LAYER, spin_limit=1, device="cpu")
    rank.load_inputs(**random_inputs(cfg, tokens, LAYER, seed=0))
    captured = {}

    def intercept(*args, grid, warmup, **kwargs):
        captured.update(args=args, kwargs=kwargs, grid=grid)

    kernel = mono_kernels._mono_kernel
    kernel.run, saved = intercept, kernel.run
    try:
        rank.launch()
    finally:
        kernel.run = saved
    return captured["args"], captured["kwargs"], captured["grid"]


def compile_for_hopper(args, kwargs):
    kernel = mono_kernels._mono_kernel
    backend = make_backend(HOPPER)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False, instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER, options=options.__dict__)


def resource_usage(compiled) -> dict:
    """ptxas's count for the cubin: registers, stack (spills land there), shared bytes."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        text = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", text))
    return {"registers": int(found["REG"]), "stack": int(found["STACK"]), "static_shared": int(found["SHARED"])}


def ctas_per_sm(usage: dict, shared: int, num_warps: int) -> int:
    threads = 32 * num_warps
    by_registers = SM_REGISTERS // (usage["registers"] * threads)
    by_shared = SM_SHARED_BYTES // max(shared, 1)
    return min(by_registers, by_shared, SM_MAX_THREADS // threads)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--loopback", action="store_true", help="the benchmarks' loopback build (NP = 1)")
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    print(f"mono kernel, sm_90a, preset kimi-k3, T={args.tp}, {'loopback' if args.loopback else 'full'} peers, "
          f"planned {DEFAULT_CTAS_PER_SM} CTAs a SM on {H200_SMS} SMs")
    for tokens in args.tokens:
        started = time.time()
        launch_args, launch_kwargs, grid = launch_arguments(cfg, args.tp, tokens, args.loopback)
        compiled = compile_for_hopper(launch_args, launch_kwargs)
        usage = resource_usage(compiled)
        shared = compiled.metadata.shared
        fits = ctas_per_sm(usage, shared, compiled.metadata.num_warps)
        print(
            f"S={tokens:>2}: grid {grid[0]} CTAs, {compiled.metadata.num_warps} warps, {usage['registers']} registers, "
            f"stack {usage['stack']} B, shared {shared} B -> {fits} CTAs fit a SM "
            f"({'enough' if fits >= DEFAULT_CTAS_PER_SM else 'FEWER than planned'}); "
            f"PTX {len(compiled.asm['ptx'].splitlines())} lines ({time.time() - started:.0f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
