"""GPU timing the way the benchmarks need it: CUDA-graph replays timed with
device events, medians, weights rotated so the L2 cannot serve repeats, and
the copy bandwidth measured in the same run as the floor's denominator."""

from __future__ import annotations

import statistics

import torch

COPY_BYTES = 1 << 30
"""Bytes per copy when measuring bandwidth: far past the L2 (50-60 MB), long
enough (~0.5 ms) that launch overhead vanishes."""

WARMUP_REPLAYS = 3
TIMED_REPLAYS = 20
TRIALS = 5
"""Replays per trial and trials per measurement: the median of TRIALS means
of TIMED_REPLAYS replays."""


def copy_bandwidth(device) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy."""
    src = torch.randn(COPY_BYTES // 4, dtype=torch.float32, device=device)  # 16-byte vector copies
    dst = torch.empty_like(src)
    seconds = time_graph([lambda: dst.copy_(src)])
    return 2 * COPY_BYTES / seconds


def time_graph(calls: list, replays: int = TIMED_REPLAYS, trials: int = TRIALS) -> float:
    """Median seconds per call: ``calls`` (one per rotated weight set) are run
    once eagerly to compile and warm, captured in order into one CUDA graph,
    and the graph is replayed ``replays`` times per trial."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(WARMUP_REPLAYS):
        graph.replay()
    samples = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / (replays * len(calls)))
    return statistics.median(samples)
