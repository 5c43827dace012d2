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

The fused M1b row (``bench_m1b_fold``): rank 0's mono launch of TP8 in
loopback with M1b folded in (MonoOptions.m1b) against the plain launch on
the same weights, at each S: the issue's "folding M1b in adds at most
1.5 us".

The fused MLA rows (``bench_mla_fused``), per (cache dtype, context, S),
rank 0 of TP8 in loopback, M1c at ``fused_splits`` (about two programs a SM):

    separate   M1c, M1b, then the plain mono launch: three launches
    m1b        M1c, then the mono launch with M1b folded in
    m1c        the mono launch with M1c and M1b folded in: one launch
    floor      cache + q + every weight the layer reads, over the copy bandwidth

One weight set (a TP8 rank's layer reads about 105 MB, past the 60 MB L2);
each request's cache is read once a launch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .reference.mla import FP8, LATENT_DIM, ROPE_DIM

PAGE_SIZE = 64
"""Cache rows a page: the page size of the public MLA decode kernels engines use."""
CONTEXTS = (1024, 32768, 131072)
TOKENS = (1, 4, 16)
KV_DTYPES = ("fp8", "bf16")
SPLIT_CHOICES = (16, 64, 132, 264)
"""Splits of each request's context. M1c runs S x splits programs (one head
block at TP8), so S = 1 needs one or two splits a SM (two of its programs fit
one) to stream at full rate,
while every split adds 24 KB a token (12 heads x 512 fp32) that M1b reads
back: the best count depends on S and the context, so it is measured."""
ROTATE_BYTES = 240 * 10**6
"""Caches rotate until they add up to this (4x an H200's 60 MB L2), at most MAX_SETS copies
(a 1 K context of one request is 0.6 MB in fp8: 128 copies are 75 MB, still past the L2)."""
MAX_SETS = 128
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
                page_size: int = PAGE_SIZE, v_head: int = V_HEAD) -> MlaInputs:
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
        w_v=(torch.randn(heads, v_head, LATENT_DIM, generator=g, device=device) / math.sqrt(LATENT_DIM)).to(torch.bfloat16),
        gate=torch.randn(tokens, heads * v_head, generator=g, device=device).to(torch.bfloat16),
    )


def rotation(tokens: int, context: int, kv_dtype: str, device) -> list[MlaInputs]:
    first = make_inputs(tokens, context, kv_dtype, device, seed=0)
    sets = max(1, min(MAX_SETS, -(-ROTATE_BYTES // first.cache_bytes)))
    return [first] + [make_inputs(tokens, context, kv_dtype, device, seed=s) for s in range(1, sets)]


def attn_call(inputs: MlaInputs, splits: int, tile: dict | None = None):
    """M1c into fixed outputs at ``tile`` (mla.attn_tile's keys; its values for the cache unless given):
    (the call, o, lse)."""
    from .kernels.mla_attn import launch_mla_attn
    from .mla import attn_tile, split_outputs

    o, lse = split_outputs(inputs.q, splits, LATENT_DIM)
    tile = {**attn_tile(inputs.kv), **(tile or {})}

    def call():
        launch_mla_attn(inputs.q, inputs.kv, inputs.qsl, inputs.seq_lens, inputs.pages, inputs.indptr, inputs.scale,
                        o, lse, kv_scale=inputs.kv_scale, **tile)

    return call, o, lse


def back_call(inputs: MlaInputs, o, lse, core=None, tile=None):
    """M1b from o and lse into a fixed core (a new one, or ``core``): (the call, core).
    tile: launch_mla_back's tile arguments (default mla.BACK_TILE)."""
    from .kernels.mla_back import launch_mla_back
    from .mla import BACK_TILE, core_like

    core = core_like(inputs.gate) if core is None else core
    tile = BACK_TILE if tile is None else tile

    def call():
        launch_mla_back(o, lse, inputs.w_v, inputs.gate, core, **tile)

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
    started = time.time()
    for splits in SPLIT_CHOICES:
        calls = [attn_call(inputs, splits) for inputs in sets]
        seconds = time_graph([call for call, _, _ in calls])
        row["m1c_us"][splits] = 1e6 * seconds
        print(f"  {kv_dtype} ctx {context} S={tokens} M1c {splits} splits: {1e6 * seconds:.1f} us "
              f"({len(sets)} sets, {time.time() - started:.0f} s in)", flush=True)
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


FOLD_SPLITS = 16
"""M1c splits the folded M1b combines (M1b reads splits x S x heads x DL fp32)."""


def m1b_inputs(cfg, tokens: int, tp: int, device, seed: int) -> dict:
    """One rank's M1b inputs (a dict as MonoRank.load_m1b_inputs takes it)."""
    g = torch.Generator(device=device).manual_seed(seed)
    heads = cfg.num_attention_heads // tp
    o = torch.randn(FOLD_SPLITS, tokens, heads, LATENT_DIM, generator=g, device=device)
    lse = torch.randn(FOLD_SPLITS, tokens, heads, generator=g, device=device)
    w_v = torch.randn(heads, cfg.v_head_dim, LATENT_DIM, generator=g, device=device) / math.sqrt(LATENT_DIM)
    gate = torch.randn(tokens, heads * cfg.v_head_dim, generator=g, device=device)
    return dict(o=o, lse=lse, w_v=w_v.to(torch.bfloat16), w_v_scale=1.0, gate=gate.to(torch.bfloat16))


def fold_shape():
    """The M1b shape of the fold's timings: FOLD_SPLITS splits of the latent."""
    from .planner import M1bShape

    return M1bShape(splits=FOLD_SPLITS, latent=LATENT_DIM)


def m1b_runners(cfg, tp: int, tokens: int, weight_sets: list, layer: int, options=None, **runner_options) -> list:
    """One loopback MonoRunner with M1b folded in per weight set (every rank shares
    rank 0's tensors), its inputs loaded: rank 0's launch is ready to replay.
    options: MonoOptions with m1b set (default: the mono defaults, fold_shape());
    runner_options: MonoRunner's other keywords (trace, prefetch)."""
    import dataclasses

    from .mono import MonoRunner, default_options
    from .synthetic import random_inputs

    options = options or default_options(tokens, m1b=fold_shape())
    runners = []
    for seed, shard in enumerate(weight_sets):
        device = shard.o_proj.device
        runner = MonoRunner(cfg, [dataclasses.replace(shard, rank=r) for r in range(tp)], tokens, layer,
                            options=options, **runner_options)
        inputs = {k: v.to(device) for k, v in random_inputs(cfg, tokens, layer, seed=1000 + seed).items()}
        m1b = m1b_inputs(cfg, tokens, tp, device, seed)
        runner.load_mla_inputs([m1b] * tp, inputs["prefix"], inputs["blocks"])
        runners.append(runner)
    return runners


def time_mono_m1b(cfg, tp: int, tokens: int, weight_sets: list, layer: int, **runner_options) -> float:
    """Seconds per launch of rank 0 with M1b folded in, replays rotated over the
    weight sets as bench.time_mono does for the plain launch (runner_options: m1b_runners')."""
    from .timing import time_graph

    runners = m1b_runners(cfg, tp, tokens, weight_sets, layer, **runner_options)
    seconds = time_graph([lambda runner=runner: runner.launch(0) for runner in runners])
    torch.cuda.synchronize()
    for runner in runners:
        runner.check_health()
    return seconds


def bench_m1b_fold(cfg, weight_sets: list, tokens_list, layer: int) -> list[dict]:
    """Per S: the plain mono launch and the one with M1b folded in (us)."""
    from .bench import time_mono

    rows = []
    for tokens in tokens_list:
        plain = time_mono(cfg, weight_sets[0].tp, tokens, weight_sets)
        fused = time_mono_m1b(cfg, weight_sets[0].tp, tokens, weight_sets, layer)
        rows.append({"tokens": tokens, "mono_us": 1e6 * plain, "mono_m1b_us": 1e6 * fused,
                     "m1b_adds_us": 1e6 * (fused - plain)})
        print(f"S={tokens:>2}: mono {1e6 * plain:8.1f} us, with M1b folded in {1e6 * fused:8.1f} us "
              f"(+{1e6 * (fused - plain):.1f} us)", flush=True)
    return rows


def mla_layer_inputs(cfg, tokens: int, context: int, kv_dtype: str, tp: int, device, seed: int) -> tuple[dict, dict]:
    """One rank's (m1c_in, m1b_in without o / lse) for S one-token requests of ``context``
    positions: the inputs of an MLA layer's launch with M1c folded in."""
    attn = make_inputs(tokens, context, kv_dtype, device, seed, heads=cfg.num_attention_heads // tp,
                       v_head=cfg.v_head_dim)
    m1c_in = dict(q=attn.q, kv=attn.kv, kv_scale=attn.kv_scale, qsl=attn.qsl, seq_lens=attn.seq_lens,
                  pages=attn.pages, indptr=attn.indptr, scale=attn.scale)
    return m1c_in, dict(w_v=attn.w_v, w_v_scale=1.0, gate=attn.gate)


def fused_splits(tokens: int, sms: int) -> int:
    """M1c splits of an MLA layer's rows: two of M1c's programs a SM over the S
    tokens (M1c at 132 splits and S = 1 streams 4x as fast as at 16: PERF.md), at
    least FOLD_SPLITS."""
    return max(FOLD_SPLITS, 2 * sms // tokens)


def mla_fused_calls(cfg, tp: int, tokens: int, context: int, kv_dtype: str, shard, layer: int,
                    splits: int = FOLD_SPLITS, folded_tile: bool = False, trace: bool = False,
                    fields: dict | None = None) -> dict:
    """The three ways to run one MLA layer of rank 0 (loopback), M1c at ``splits``,
    as calls on loaded runners: {"separate", "m1b", "m1c"} -> call. Rank 0's inputs
    are every rank's (the loopback pre-writes come from the same staged chain). The
    separate M1c runs at its own tile (mla.attn_tile), or with ``folded_tile`` at the
    M1C tasks' of the third way (mla.folded_attn_tile), which then gives the first two ways' bits. ``trace``:
    the two folded ways' launches are trace builds (k3mono/trace.py); ``fields``: the
    three launches' options other than each way's defaults (mono.default_options_with:
    the M1c fold's CTAs a SM are its own); the separate M1b runs at the M1b fold's tile
    (mla.folded_back_tile), so the fields reach it too."""
    import dataclasses

    from .mla import attn_tile, folded_attn_tile, folded_back_tile
    from .mono import MonoRunner, default_options_with
    from .planner import M1bShape, M1cShape
    from .synthetic import random_inputs

    def way_options(**shapes):
        return default_options_with(tokens, fields or {}, **shapes)

    device = shard.o_proj.device
    ranks = [dataclasses.replace(shard, rank=r) for r in range(tp)]
    act = {k: v.to(device) for k, v in random_inputs(cfg, tokens, layer, seed=7).items()}
    m1c_in, back_in = mla_layer_inputs(cfg, tokens, context, kv_dtype, tp, device, seed=11)
    m1b = M1bShape(splits=splits, latent=LATENT_DIM)
    m1c = M1cShape(page_size=PAGE_SIZE, requests=tokens, kv_fp8=kv_dtype == "fp8")
    attn = MlaInputs(gate=back_in["gate"], w_v=back_in["w_v"], **m1c_in)
    folded_c = MonoRunner(cfg, ranks, tokens, layer, options=way_options(m1b=m1b, m1c=m1c), trace=trace)
    fold_tile = folded_attn_tile(folded_c.compiled.table.geometry.m1c)
    attend, o, lse = attn_call(attn, splits, fold_tile if folded_tile else attn_tile(attn.kv))
    attend()  # the split outputs the m1b runner's M1b reads
    staged_back, core = back_call(attn, o, lse)
    staged_back()
    plain = MonoRunner(cfg, ranks, tokens, layer, options=way_options())
    plain.load_inputs(core.repeat(1, tp), act["prefix"], act["blocks"])  # every rank's heads see rank 0's inputs
    folded_b = MonoRunner(cfg, ranks, tokens, layer, options=way_options(m1b=m1b), trace=trace)
    back, _ = back_call(attn, o, lse, core=plain.rank_states[0].core,  # M1b writes what o_proj reads
                        tile=folded_back_tile(folded_b.compiled.table.geometry.m1b))
    folded_b.load_mla_inputs([dict(back_in, o=o, lse=lse)] * tp, act["prefix"], act["blocks"])
    folded_c.load_mla_inputs([back_in] * tp, act["prefix"], act["blocks"], m1c_in=[m1c_in] * tp)
    return {
        "separate": lambda: (attend(), back(), plain.launch(0)),
        "m1b": lambda: (attend(), folded_b.launch(0)),
        "m1c": lambda: folded_c.launch(0),
        "runners": (plain, folded_b, folded_c),
        "shapes": (m1b, m1c),
        "split_outputs": (o, lse),  # the separate M1c's, which the first two ways' M1b read
    }


def bench_mla_fused(cfg, shard, bandwidth: float, layer: int, tokens_list=TOKENS, contexts=CONTEXTS,
                    kv_dtypes=KV_DTYPES, fields: dict | None = None) -> list[dict]:
    """Per (cache dtype, context, S): the separate, M1b-folded and M1c-folded launches (us) and the floor,
    M1c at fused_splits; ``fields``: mla_fused_calls'."""
    from .floor import floor_bytes
    from .mono import device_sms
    from .timing import time_graph

    rows = []
    for kv_dtype in kv_dtypes:
        for context in contexts:
            for tokens in tokens_list:
                splits = fused_splits(tokens, device_sms(shard.o_proj.device))
                calls = mla_fused_calls(cfg, shard.tp, tokens, context, kv_dtype, shard, layer, splits,
                                        fields=fields)
                m1b, m1c = calls["shapes"]
                floor = floor_bytes(cfg, shard.tp, tokens, m1b=m1b, m1c=m1c, context=tokens * context,
                                    nblocks=cfg.num_blocks(layer))
                row = {"kv": kv_dtype, "context": context, "tokens": tokens, "splits": splits,
                       "floor_us": 1e6 * floor["total"] / bandwidth}
                for name in ("separate", "m1b", "m1c"):
                    row[f"{name}_us"] = 1e6 * time_graph([calls[name]])
                torch.cuda.synchronize()
                for runner in calls["runners"]:
                    runner.check_health()
                rows.append(row)
                print(f"{kv_dtype:>4} ctx {context:>6} S={tokens:>2} {splits:>3} splits: floor {row['floor_us']:8.1f}  separate "
                      f"{row['separate_us']:8.1f}  M1b folded {row['m1b_us']:8.1f}  M1c+M1b folded {row['m1c_us']:8.1f} us",
                      flush=True)
                del calls
                torch.cuda.empty_cache()
    return rows
