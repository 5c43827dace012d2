"""``python -m k3mono bench``: the staged path, each of its stages, the mono
launch (``time_mono``: ``mono_us``), the unfused PyTorch path and the memory
floor, per token count, on the GPU.

Two tables: one rank at TP8 (the headline: the per-rank shapes an 8-GPU
server runs, every weight sharded) and the whole layer at T = 1. One rank's
launches run alone with loopback peers: the other ranks' slots of its peer
buffer were filled by one full run beforehand (every rank reusing rank 0's
shard tensors, so only one rank's weights take memory). Each path is a CUDA
graph replaying one call per weight set, ``WEIGHT_SETS`` sets in rotation, so
the L2 cannot serve a repeat; times are medians of device-event timings.

The floor is the bytes the launch must read (k3mono.floor, with the number of
distinct experts the run actually routed to) over the copy bandwidth measured
in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from .config import preset
from .floor import floor_bytes
from .planner import TileChoice
from .synthetic import random_inputs, random_shard
from .timing import copy_bandwidth, time_graph

WEIGHT_SETS = 4
"""Rotated weight sets: 4 x (about 105 MB per rank at TP8) is far past the 60 MB L2."""
BENCH_LAYER = 25
"""An MoE layer with 3 AttnRes blocks: a mid-network seam."""
TOKEN_COUNTS = (1, 2, 4, 8, 16)
TABLES = ((8, "one rank of TP8"), (1, "whole layer, T = 1"))
STAGE_WEIGHTS = {
    "oproj": ("o_proj",),
    "router": ("router",),
    "latent_down": ("latent_down",),
    "shared_gate_up": ("shared_gate", "shared_up"),
    "expert_gate_up": ("w1_packed", "w1_scale", "w3_packed", "w3_scale"),
    "expert_down": ("w2_packed", "w2_scale"),
    "final_partial": ("latent_up", "shared_down"),
}
"""The weights each streaming stage reads (the experts' for the distinct experts routed to)."""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True).stdout.strip()


def _git_commit(repo: Path = Path(__file__).resolve().parent.parent) -> str:
    """HEAD's short hash of ``repo``, "-dirty" after it when tracked files differ
    from HEAD (a result of code no commit holds, or a tree copied beside a stale
    .git, as on the device machine); K3MONO_COMMIT where the caller knows better."""
    if os.environ.get("K3MONO_COMMIT"):
        return os.environ["K3MONO_COMMIT"]
    try:
        head = _git(repo, "rev-parse", "--short", "HEAD")
        changed = _git(repo, "status", "--porcelain", "--untracked-files=no")
    except OSError:
        return "unknown"
    return f"{head}-dirty" if head and changed else (head or "unknown")


def run_metadata() -> dict:
    """Where and on what a result was measured."""
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": _git_commit(),
        "date": time.strftime("%Y-%m-%d"),
    }


def _loopback_layers(cfg, tp: int, tokens: int, weight_sets: list, tiles: TileChoice = TileChoice()):
    """One StagedLayer per weight set at ``tiles``; every rank shares rank 0's tensors;
    one full run fills the peers."""
    from .staged import StagedLayer

    layers = []
    for seed, shard in enumerate(weight_sets):
        ranks = [dataclasses.replace(shard, rank=r) for r in range(tp)]
        layer = StagedLayer(cfg, ranks, tokens, BENCH_LAYER, tiles=tiles)
        inputs = random_inputs(cfg, tokens, BENCH_LAYER, seed=1000 + seed)
        layer.load_inputs(**{k: v.to(shard.o_proj.device) for k, v in inputs.items()})
        layer.run()
        layers.append(layer)
    torch.cuda.synchronize()
    return layers


def _rank0_stages(layer) -> list:
    return [(name[: -len("[0]")], fn) for name, fn in layer.stages() if name.endswith("[0]")]


def _unique_experts(layers) -> float:
    return statistics.mean(torch.unique(layer.scratch[0]["route_ids"]).numel() for layer in layers)


def _time_staged(layers) -> tuple[float, dict]:
    stage_lists = [_rank0_stages(layer) for layer in layers]
    whole = time_graph([lambda stages=stages: [fn() for _, fn in stages] for stages in stage_lists])
    per_stage = {}
    for index, (name, _) in enumerate(stage_lists[0]):
        per_stage[name] = time_graph([stages[index][1] for stages in stage_lists])
    return whole, per_stage


def _time_unfused(cfg, weight_sets, tokens: int) -> float | None:
    """None where the bf16-dequantised experts do not fit in what the GPU has free."""
    from .unfused import UnfusedRank

    shard = weight_sets[0]
    bf16_experts = 2 * 2 * sum(shard.tensors()[n].numel() for n in ("w1_packed", "w3_packed", "w2_packed"))
    free, _ = torch.cuda.mem_get_info()
    sets = weight_sets[: int(0.8 * free // bf16_experts)]
    if not sets:
        return None
    calls = []
    for seed, shard in enumerate(sets):
        rank = UnfusedRank(cfg, shard, tokens, BENCH_LAYER)
        inputs = {k: v.to(shard.o_proj.device) for k, v in random_inputs(cfg, tokens, BENCH_LAYER, 2000 + seed).items()}
        core_r = inputs["core"][:, : cfg.core_width // shard.tp].contiguous()
        calls.append(lambda rank=rank, i=inputs, c=core_r: rank(c, i["prefix"], i["blocks"]))
    seconds = time_graph(calls)
    del calls
    torch.cuda.empty_cache()
    return seconds


def mono_runners(cfg, tp: int, tokens: int, weight_sets: list, **runner_options) -> list:
    """One MonoRunner per weight set, rank 0's launch in loopback (T > 1: every
    rank shares rank 0's tensors; the other ranks' pushes are pre-written by one
    staged run, into both parities, so every replay finds them)."""
    from .mono import MonoRunner

    runners = []
    for seed, shard in enumerate(weight_sets):
        ranks = [dataclasses.replace(shard, rank=r) for r in range(tp)]
        runner = MonoRunner(cfg, ranks, tokens, BENCH_LAYER, **runner_options)
        inputs = random_inputs(cfg, tokens, BENCH_LAYER, seed=1000 + seed)
        runner.load_inputs(**{k: v.to(shard.o_proj.device) for k, v in inputs.items()})
        runner._staged = None  # the pre-write's StagedLayer is not needed any more
        runners.append(runner)
    torch.cuda.synchronize()
    return runners


def time_mono(cfg, tp: int, tokens: int, weight_sets: list, **runner_options) -> float:
    """Seconds per mono launch of rank 0 (TP8: loopback; T = 1: the whole layer),
    CUDA-graph replays over the rotated weight sets (the launch needs no host
    work between replays: its last CTA resets the ticket counter and advances
    the epoch). The health buffers are checked after the timing."""
    runners = mono_runners(cfg, tp, tokens, weight_sets, **runner_options)
    seconds = time_graph([lambda runner=runner: runner.launch(0) for runner in runners])
    torch.cuda.synchronize()
    for runner in runners:
        runner.check_health()
    del runners
    torch.cuda.empty_cache()
    return seconds


def bench_table(cfg, tp: int, tokens_list, bandwidth: float, device) -> list[dict]:
    weight_sets = [random_shard(cfg, tp, seed=s, device=device) for s in range(WEIGHT_SETS)]
    rows = []
    for tokens in tokens_list:
        layers = _loopback_layers(cfg, tp, tokens, weight_sets)
        staged, per_stage = _time_staged(layers)
        unique = _unique_experts(layers)
        del layers
        torch.cuda.empty_cache()
        floor = floor_bytes(cfg, tp, tokens, round(unique), nblocks=cfg.num_blocks(BENCH_LAYER))
        unfused = _time_unfused(cfg, weight_sets, tokens)
        mono = time_mono(cfg, tp, tokens, weight_sets)
        rows.append(
            {
                "tp": tp,
                "tokens": tokens,
                "unique_experts": unique,
                "floor_bytes": floor["total"],
                "floor_us": floor["total"] / bandwidth * 1e6,
                "staged_us": staged * 1e6,
                "unfused_us": None if unfused is None else unfused * 1e6,
                "mono_us": mono * 1e6,
                "stages_us": {k: v * 1e6 for k, v in per_stage.items()},
                "stage_weight_bytes": floor["weights"],
            }
        )
        print(_row_text(rows[-1]), flush=True)
    return rows


def _row_text(row) -> str:
    unfused = "n/a" if row["unfused_us"] is None else f"{row['unfused_us']:9.1f}"
    speedup = "n/a" if row["unfused_us"] is None else f"{row['unfused_us'] / row['staged_us']:5.2f}x"
    mono = "n/a" if row.get("mono_us") is None else f"{row['mono_us']:8.1f} us ({row['mono_us'] / row['floor_us']:4.2f}x floor)"
    return (
        f"T={row['tp']} S={row['tokens']:>2}  floor {row['floor_us']:7.1f} us  staged {row['staged_us']:8.1f} us "
        f"({row['staged_us'] / row['floor_us']:4.2f}x floor)  mono {mono} unfused {unfused} us  staged speedup {speedup}"
    )


def stage_bandwidth(row, bandwidth: float) -> dict:
    """Streaming stage -> fraction of the copy bandwidth its weight bytes achieved."""
    return {
        name: sum(row["stage_weight_bytes"][w] for w in weights) / (row["stages_us"][name] * 1e-6) / bandwidth
        for name, weights in STAGE_WEIGHTS.items()
    }


def _stage_table(rows, bandwidth: float) -> str:
    names = list(rows[0]["stages_us"])
    lines = ["stage us (% copy bw)" + "".join(f"  S={r['tokens']:<11}" for r in rows)]
    for name in names:
        cells = []
        for r in rows:
            share = stage_bandwidth(r, bandwidth).get(name)
            cells.append(f"{r['stages_us'][name]:7.1f}" + (f" ({share:4.0%})" if share is not None else "       "))
        lines.append(f"{name:<20}" + "".join(f"  {c:<13}" for c in cells))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["tables"]), figsize=(6 * len(results["tables"]), 4), squeeze=False)
    for ax, (title, rows) in zip(axes[0], results["tables"].items()):
        tokens = [r["tokens"] for r in rows]
        for key, label in (("staged_us", "staged"), ("mono_us", "mono"), ("unfused_us", "unfused PyTorch")):
            points = [(t, r[key]) for t, r in zip(tokens, rows) if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.plot(tokens, [r["floor_us"] for r in rows], "k--", label="floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens S")
        ax.set_ylabel("us per layer_post")
        ax.set_title(f"{title} ({results['gpu']})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_bench(out_dir: Path, tokens_list=TOKEN_COUNTS, tables=TABLES, mla: bool = False, contexts=None,
              kv_dtypes=None) -> dict:
    """The tables of ``tables`` (none: the MLA rows alone) and, with ``mla``, the
    MLA rows at ``contexts`` and cache dtypes ``kv_dtypes`` (bench_mla.CONTEXTS and
    KV_DTYPES by default)."""
    if not torch.cuda.is_available():
        from .errors import K3InputError

        raise K3InputError("bench: needs a GPU (torch sees none)")
    device = torch.device("cuda")
    cfg = preset("kimi-k3")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    results = {
        **run_metadata(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "weight_sets": WEIGHT_SETS,
        "layer": BENCH_LAYER,
        "tables": {},
    }
    for tp, title in tables:
        print(f"-- {title}", flush=True)
        rows = bench_table(cfg, tp, tokens_list, bandwidth, device)
        results["tables"][title] = rows
        for row in rows:
            row["stage_bandwidth_share"] = stage_bandwidth(row, bandwidth)
        print(_stage_table(rows, bandwidth), flush=True)
        torch.cuda.empty_cache()
    if mla:
        from .bench_mla import CONTEXTS, KV_DTYPES, bench_m1b_fold, bench_mla, bench_mla_fused

        contexts, kv_dtypes = tuple(contexts or CONTEXTS), tuple(kv_dtypes or KV_DTYPES)
        print("-- MLA decode: M1c and M1b, one rank of TP8", flush=True)
        results["mla"] = bench_mla(bandwidth, device, tokens_list, contexts, kv_dtypes)
        print("-- M1b folded into the mono launch, one rank of TP8", flush=True)
        weight_sets = [random_shard(cfg, 8, seed=s, device=device) for s in range(WEIGHT_SETS)]
        results["m1b_fold"] = bench_m1b_fold(cfg, weight_sets, tokens_list, BENCH_LAYER)
        print("-- MLA layers: separate launches, M1b folded in, M1c and M1b folded in", flush=True)
        results["mla_fused"] = bench_mla_fused(cfg, weight_sets[0], bandwidth, BENCH_LAYER, tokens_list, contexts,
                                               kv_dtypes)
        del weight_sets
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{results['date']}-{results['commit']}"
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1))
    if results["tables"]:
        plot(results, out_dir / f"{stem}.png")
    print(f"wrote {out_dir / stem}.json" + (" and .png" if results["tables"] else ""))
    for title, rows in results["tables"].items():
        print(f"== {title} ({results['gpu']}, {bandwidth / 1e12:.2f} TB/s copy)")
        for row in rows:
            print(_row_text(row))
    return results
