"""MLA decode rows of the benchmark (GPU): M1c over the paged latent cache and
M1b, at one rank's TP8 shapes, against the floor.

Shapes: S requests of one query token each (decode), every request with the
same context length, heads = 96 / T = 12, DQK = 576, DL = 512, DV = 128; the
cache in fp8 e4m3 (with kv_scale) or bf16, pages of PAGE_SIZE rows in
shuffled order. Caches rotate over enough copies that the L2 cannot serve a
replay what the one before it read.

Rows per (cache dtype, context, S), medians of CUDA-graph replays
(timing.time_graph), in microseconds:

    floor      cache bytes + w_v + q + gate read, over the copy bandwidth
    m1c        M1c alone, at each split count of SPLIT_CHOICES; ``kv_share`` is
               its cache bytes a second over the copy bandwidth (the issue's
               >= 80 % at 32 K context)
    m1b        M1b alone, after the best M1c
    staged     M1c then M1b, two launches

The fused rows (M1b, then M1b + M1c, inside the mono launch) join these
once the mono launch runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .reference.mla import FP8, LATENT_DIM, ROPE_DIM

PAGE_SIZE = 64
"""Cache rows a page: the page size of the public MLA decode kernels engines use."""
CONTEXTS = (1024, 32768, 131072)
TOKENS = (1, 4, 16)
KV_DTYPES = ("fp8", "bf16")
SPLIT_CHOICES = (16, 64, 132)
"""Splits of each request's context. M1c runs S x splits programs (one head
block at TP8), so S = 1 needs about one split a SM to stream at full rate,
while every split adds 24 KB a token (12 heads x 512 fp32) that M1b reads
back: the best count depends on S and the context, so it is measured."""
ROTATE_BYTES = 240 * 10**6
"""Caches rotate until they add up to this (4x an H200's 60 MB L2), at most MAX_SETS copies
(a 1 K context of one request is 0.6 MB in fp8)."""
MAX_SETS = 512
HEADS_TP8 = 12
V_HEAD = 128
KV_SCALE = 0.05
"""fp8 cache values are stored divided by this (e4m3 holds |x| <= 448)."""


@dataclass
class MlaInputs:
    """One rotation set: M1c and M1b inputs of S one-token requests."""

    q: torch.Tensor  # [S, heads, DQK] bf16
    kv: torch.Tensor  # [pages, PAGE_SIZE, DQK] bf16 or fp8
    kv_scale: float
    qsl: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    pages: torch.Tensor  # [S * pages a request] int32, shuffled
    indptr: torch.Tensor  # [S + 1] int32
    scale: float
    w_v: torch.Tensor  # [heads, DV, DL] bf16
    gate: torch.Tensor  # [S, heads * DV] bf16

    @property
    def cache_bytes(self) -> int:
        """Bytes of cache rows M1c must read: S contexts x DQK x itemsize."""
        return int(self.seq_lens.sum()) * self.kv.shape[-1] * self.kv.element_size()

    @property
    def floor_bytes(self) -> int:
        small = (self.q, self.w_v, self.gate)
        return self.cache_bytes + sum(t.numel() * t.element_size() for t in small)


def make_inputs(tokens: int, context: int, kv_dtype: str, device, seed: int, heads: int = HEADS_TP8,
                page_size: int = PAGE_SIZE) -> MlaInputs:
    """S = ``tokens`` requests, each one query token over ``context`` positions."""
    g = torch.Generator(device=device).manual_seed(seed)
    dqk = LATENT_DIM + ROPE_DIM
    per_request = -(-context // page_size)
    total = tokens * per_request
    values = torch.randn(total, page_size, dqk, generator=g, device=device)
    kv, kv_scale = (values / KV_SCALE).to(FP8), KV_SCALE
    if kv_dtype == "bf16":
        kv, kv_scale = values.to(torch.bfloat16), 1.0
    elif kv_dtype != "fp8":
        raise ValueError(f"kv_dtype: expected fp8 or bf16, got {kv_dtype!r}")
    int32 = dict(dtype=torch.int32, device=device)
    return MlaInputs(
        q=torch.randn(tokens, heads, dqk, generator=g, device=device).to(torch.bfloat16),
        kv=kv,
        kv_scale=kv_scale,
        qsl=torch.arange(tokens + 1, **int32),
        seq_lens=torch.full((tokens,), context, **int32),
        pages=torch.randperm(total, generator=g, device=device).to(torch.int32),
        indptr=torch.arange(tokens + 1, **int32) * per_request,
        scale=1.0 / math.sqrt(dqk),
        w_v=(torch.randn(heads, V_HEAD, LATENT_DIM, generator=g, device=device) / math.sqrt(LATENT_DIM)).to(torch.bfloat16),
        gate=torch.randn(tokens, heads * V_HEAD, generator=g, device=device).to(torch.bfloat16),
    )


def rotation(tokens: int, context: int, kv_dtype: str, device) -> list[MlaInputs]:
    first = make_inputs(tokens, context, kv_dtype, device, seed=0)
    sets = max(1, min(MAX_SETS, -(-ROTATE_BYTES // first.cache_bytes)))
    return [first] + [make_inputs(tokens, context, kv_dtype, device, seed=s) for s in range(1, sets)]


def attn_call(inputs: MlaInputs, splits: int):
    """M1c into fixed outputs: (the call, o, lse)."""
    from .kernels.mla_attn import launch_mla_attn
    from .mla import ATTN_BLOCK_H, ATTN_BLOCK_N, split_outputs

    o, lse = split_outputs(inputs.q, splits, LATENT_DIM)

    def call():
        launch_mla_attn(inputs.q, inputs.kv, inputs.qsl, inputs.seq_lens, inputs.pages, inputs.indptr, inputs.scale,
                        o, lse, kv_scale=inputs.kv_scale, block_h=ATTN_BLOCK_H, block_n=ATTN_BLOCK_N)

    return call, o, lse


def back_call(inputs: MlaInputs, o, lse):
    """M1b from o and lse into a fixed core: (the call, core)."""
    from .kernels.mla_back import launch_mla_back
    from .mla import BACK_BLOCK_DV, BACK_BLOCK_K, core_like

    core = core_like(inputs.gate)

    def call():
        launch_mla_back(o, lse, inputs.w_v, inputs.gate, core, block_k=BACK_BLOCK_K, block_dv=BACK_BLOCK_DV)

    return call, core


def bench_case(tokens: int, context: int, kv_dtype: str, bandwidth: float, device) -> dict:
    """One row: every path's median seconds (as us) for one (S, context, cache dtype)."""
    from .timing import time_graph

    sets = rotation(tokens, context, kv_dtype, device)
    first = sets[0]
    row = {
        "tokens": tokens, "context": context, "kv": kv_dtype, "sets": len(sets),
        "floor_us": 1e6 * first.floor_bytes / bandwidth, "m1c_us": {},
    }
    best = None
    for splits in SPLIT_CHOICES:
        calls = [attn_call(inputs, splits) for inputs in sets]
        seconds = time_graph([call for call, _, _ in calls])
        row["m1c_us"][splits] = 1e6 * seconds
        if best is None or seconds < best[0]:
            best = (seconds, splits, calls)
    seconds, splits, calls = best
    backs = [back_call(inputs, o, lse)[0] for inputs, (_, o, lse) in zip(sets, calls)]
    row["splits"] = splits
    row["kv_share"] = first.cache_bytes / seconds / bandwidth
    row["m1b_us"] = 1e6 * time_graph(backs)
    row["staged_us"] = 1e6 * time_graph([lambda a=a[0], b=b: (a(), b()) for a, b in zip(calls, backs)])
    del sets, calls, backs
    torch.cuda.empty_cache()
    return row


def row_text(row: dict) -> str:
    m1c = " ".join(f"{s}:{t:.1f}" for s, t in row["m1c_us"].items())
    return (
        f"{row['kv']:>4} ctx {row['context']:>6} S={row['tokens']:>2}: floor {row['floor_us']:8.1f}  "
        f"m1c [{m1c}] best {row['splits']} at {row['kv_share']:.0%} of copy  m1b {row['m1b_us']:6.1f}  "
        f"staged {row['staged_us']:8.1f} us"
    )


def bench_mla(bandwidth: float, device, tokens_list=TOKENS, contexts=CONTEXTS, kv_dtypes=KV_DTYPES) -> list[dict]:
    rows = []
    for kv_dtype in kv_dtypes:
        for context in contexts:
            for tokens in tokens_list:
                rows.append(bench_case(tokens, context, kv_dtype, bandwidth, device))
                print(row_text(rows[-1]), flush=True)
    return rows
