"""The ``ranks`` command: T ranks of the mono launch exchanging for real.

Two ways to hold the ranks:

* ``procs``: T spawned processes, one MonoRank each, joined in a gloo group
  (NCCL with ``unfused``, which also times the unfused path's collectives).
  Peer buffers: symmetric memory on the GPU (one GPU a rank when there are T,
  else all on one GPU with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, where
  the processes time-slice the GPU: correct but not concurrent), CPU shared
  memory under the interpreter.
* ``green`` (GPU): one process, T ranks on T green contexts of disjoint SMs,
  peers as ordinary tensors: the real protocol under real concurrency.
* ``streams`` (GPU): the same on T plain streams, each grid planned for
  SMs / T. The ranks' CTAs fit on the GPU together, but nothing makes the
  hardware start them together: a rank may wait out its bound (a clear
  error, never a hang). For where green contexts are not available.

Each rank runs ``input_sets`` fresh inputs eagerly (every output and peer
region poisoned before, a barrier so nobody pushes into a buffer still being
poisoned), then on the GPU captures its launch in a CUDA graph and replays
it ``replays`` times, cycling the input sets, each replay's outputs compared
bit for bit with the eager run of the same inputs. The parent judges rank
0's eager outputs against the float64 oracle (runner.Oracle) and every
rank's against rank 0's bit for bit: every rank reduces the same pushed
partials in the same order. ``absent`` names a rank that never launches (the
fault test): the others must stop with an error naming the exchange and the
absent rank, and nothing may hang.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from .config import K3Config, preset
from .errors import K3InputError
from .runner import Oracle
from .synthetic import random_inputs, random_shard
from .weights import LayerWeights, shard

MODES = ("procs", "green", "streams")
CPU_SPIN = 1 << 20
"""Polls a wait may take in an interpreter rank: a poll is tens of microseconds
of Python, so about a minute: the peers run the same table at the same pace."""
FAULT_SPIN = 1 << 10
"""The bound of an interpreter rank in a fault run: the absent rank's pushes never
come, so a short bound only shortens the test. A GPU fault run keeps mono's
DEFAULT_SPIN (about a second): processes sharing one GPU are time-sliced, so a
present rank's kernel may not run at all while another spins out a short bound
(seen on the H200: ranks named present ranks as missing)."""
SHARED_OUTPUTS = ("moe_out", "prefix", "route_ids", "route_weights")


@dataclass(frozen=True)
class RanksJob:
    """What every rank of a run does (picklable: it travels to spawned processes)."""

    tp: int
    tokens: int = 1
    layer: int = 13
    replays: int = 0
    input_sets: int = 2
    seed: int = 0
    preset: str = "tiny"
    checkpoint: str | None = None  # None: seeded random weights of ``preset``
    device: str = "cpu"
    mode: str = "procs"
    absent: int | None = None
    unfused: bool = False  # also time the unfused path with collective exchanges (procs, one GPU a rank)
    other_layers: tuple = ()  # procs: more layers on the same buffers (MonoRank.for_layer), input sets in turn

    def __post_init__(self):
        if self.mode not in MODES:
            raise K3InputError(f"mode: expected one of {list(MODES)}, got {self.mode!r}")
        if self.absent is not None and not 0 <= self.absent < self.tp:
            raise K3InputError(f"absent: expected a rank in 0..{self.tp - 1}, got {self.absent}")
        if self.device == "cpu" and (self.mode != "procs" or self.replays):
            raise K3InputError("ranks: green contexts, streams and CUDA-graph replays need --device cuda")
        if self.input_sets < 1:
            raise K3InputError(f"input_sets: expected at least 1, got {self.input_sets}")
        if self.unfused and (self.device == "cpu" or self.mode != "procs"):
            raise K3InputError("ranks --unfused: the NCCL baseline runs in procs mode on GPUs (one a rank)")
        if self.other_layers and self.mode != "procs":
            raise K3InputError("ranks --other-layers: runs in procs mode (one MonoRank a process)")
        if len(self.layers) > self.input_sets:
            raise K3InputError(f"input_sets: expected at least one a layer ({len(self.layers)}), got {self.input_sets}")

    @property
    def layers(self) -> tuple:
        """Every layer of the run; input set i runs layer_of(i)."""
        return (self.layer, *self.other_layers)

    def layer_of(self, index: int) -> int:
        return self.layers[index % len(self.layers)]

    @property
    def spin_limit(self) -> int:
        from .mono import DEFAULT_SPIN

        if self.device != "cpu":
            return DEFAULT_SPIN
        return FAULT_SPIN if self.absent is not None else CPU_SPIN

    def config(self) -> K3Config:
        """The run's config (the checkpoint's, or the preset), its layers validated."""
        if self.checkpoint is not None:
            from .checkpoint import check_layer

            configs = [check_layer(self.checkpoint, layer)[0] for layer in self.layers]
            return configs[0]
        cfg = preset(self.preset)
        for layer in self.layers:
            cfg.validate_layer(layer)
        return cfg

    def weights(self, device, layer: int | None = None) -> tuple[K3Config, LayerWeights]:
        """The whole of ``layer`` (default: the first) on ``device``: the checkpoint's,
        or seeded random ones (another seed a layer)."""
        layer = self.layer if layer is None else layer
        if self.checkpoint is not None:
            from .checkpoint import load_layer

            cfg, full = load_layer(self.checkpoint, layer)
            return cfg, full.to(device)
        cfg = self.config()
        return cfg, random_shard(cfg, 1, self.seed + self.layers.index(layer), device)

    def inputs(self, cfg: K3Config, index: int, device) -> dict:
        """Input set ``index`` (the same on every rank), for layer_of(index)."""
        made = random_inputs(cfg, self.tokens, self.layer_of(index), seed=1000 * (self.seed + 1) + index)
        return {name: t.to(device) for name, t in made.items()}


@dataclass
class RankReport:
    rank: int
    eager: list = field(default_factory=list)  # per input set: outputs (CPU), router_logits included
    error: str | None = None
    replay_mismatches: int = 0
    replays: int = 0
    launch_us: list = field(default_factory=list)
    unfused_us: float | None = None  # the unfused path with collective exchanges (CollectiveUnfusedRank)

    @property
    def median_us(self) -> float | None:
        return statistics.median(self.launch_us) if self.launch_us else None


def _outputs(result) -> dict:
    return {name: t.cpu() for name, t in dict(result.outputs(), router_logits=result.router_logits).items()}


def _same_bits(a: dict, b: dict, names=SHARED_OUTPUTS) -> bool:
    def raw(t):
        return t.view(torch.uint8) if t.is_floating_point() else t

    return all(torch.equal(raw(a[n].contiguous()), raw(b[n].contiguous())) for n in names)


# -- ranks as processes -------------------------------------------------------------------------


def _rank_device(job: RanksJob, rank: int) -> torch.device:
    if job.device == "cpu":
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _rank_shard(job: RanksJob, rank: int, device, layer: int) -> tuple[K3Config, LayerWeights]:
    """This rank's shard of ``layer``; the ranks make their whole layers one after another,
    so only one whole layer is in memory at a time (T of them on one GPU would not fit)."""
    import torch.distributed as dist

    mine = None
    for turn in range(job.tp):
        if turn == rank:
            cfg, full = job.weights(device, layer)
            mine = shard(full, cfg, job.tp, rank)
            del full
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
    return cfg, mine


def mono_rank_worker(rank: int, tp: int, job: RanksJob, host_buffers) -> RankReport:
    """One process's rank (ranks.spawn_ranks calls it in the job's process group)."""
    import torch.distributed as dist

    from .mono import MonoRank, RankBuffers, build, device_sms, distributed_mono_rank, mono_key

    device = _rank_device(job, rank)
    cfg, my_shard = _rank_shard(job, rank, device, job.layer)
    if device.type == "cuda":
        state = distributed_mono_rank(cfg, my_shard, job.tokens, job.layer, device=device, spin_limit=job.spin_limit)
    else:
        key = mono_key(cfg, job.tokens, tp, job.layer, loopback=False, sms=device_sms(device))
        buffers = RankBuffers.allocate(build(key), host_buffers[rank], host_buffers)
        state = MonoRank(key, my_shard, rank, buffers, layer=job.layer, spin_limit=job.spin_limit)
    states = {job.layer: state}
    for layer in job.other_layers:  # the same buffers: one set a rank, whatever the layer
        states[layer] = state.for_layer(layer, _rank_shard(job, rank, device, layer)[1])
    report = RankReport(rank)
    try:
        _eager_runs(job, cfg, states, report, device)
        if job.replays and report.error is None:
            _graph_replays(job, cfg, states, report, device)
        if job.unfused and report.error is None:
            report.unfused_us = _time_unfused(job, cfg, my_shard, rank, device)
    finally:
        dist.barrier()  # no rank's buffer goes away while another may still read it
    return report


def _eager_runs(job, cfg, states, report, device) -> None:
    """Input set i on layer_of(i)'s rank state."""
    import torch.distributed as dist

    from .mono import MonoTimeout

    for index in range(job.input_sets):
        state = states[job.layer_of(index)]
        inputs = job.inputs(cfg, index, device)
        state.load_inputs(**inputs)
        state.poison(peer_regions=True)
        _sync(device)
        dist.barrier()
        if state.rank == job.absent:
            report.error = "absent (never launched)"
            return
        state.launch()
        _sync(device)
        try:
            state.check_health()
        except MonoTimeout as timeout:
            report.error = str(timeout)
            return
        report.eager.append(_outputs(state.result()))


def _graph_replays(job, cfg, states, report, device) -> None:
    """Capture each layer's launch once; replay them with fresh inputs copied into
    the same buffers, input set i on layer_of(i)'s graph, no barrier between
    replays (the parities keep epochs apart)."""
    from .mono import MonoTimeout

    sets = [job.inputs(cfg, index, device) for index in range(job.input_sets)]
    graphs, static_blocks = {}, {}
    for index, layer in enumerate(job.layers):  # input set i < len(layers) is layer i's first
        static_blocks[layer] = sets[index]["blocks"].clone()
        states[layer].load_inputs(sets[index]["core"], sets[index]["prefix"], static_blocks[layer])
        graphs[layer] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[layer]):
            states[layer].launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for replay in range(job.replays):
        index = replay % job.input_sets
        layer = job.layer_of(index)
        state, inputs = states[layer], sets[index]
        static_blocks[layer].copy_(inputs["blocks"])
        state.load_inputs(inputs["core"], inputs["prefix"], static_blocks[layer])
        state.poison(peer_regions=False)
        start.record()
        graphs[layer].replay()
        end.record()
        torch.cuda.synchronize(device)
        try:
            state.check_health()
        except MonoTimeout as timeout:
            report.error = f"replay {replay}: {timeout}"
            return
        report.launch_us.append(1000 * start.elapsed_time(end))
        report.replays += 1
        report.replay_mismatches += not _same_bits(_outputs(state.result()), report.eager[index])


def _time_unfused(job, cfg, my_shard, rank: int, device) -> float:
    """Median us of this rank's unfused layer_post with NCCL exchanges, CUDA-graph
    replays (every rank replays the same count, so the collectives pair up)."""
    from .timing import time_graph
    from .unfused import CollectiveUnfusedRank

    unfused = CollectiveUnfusedRank(cfg, my_shard, job.tokens, job.layer)
    inputs = job.inputs(cfg, 0, device)
    core_r = inputs["core"].chunk(job.tp, dim=1)[rank].contiguous()
    return 1e6 * time_graph([lambda: unfused(core_r, inputs["prefix"], inputs["blocks"])])


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_procs(job: RanksJob) -> list[RankReport]:
    """T spawned processes, one rank each."""
    import os

    from .mono import buffer_bytes, build, device_sms, mono_key
    from .peers import host_shared_buffers
    from .ranks import spawn_ranks

    host_buffers = None
    if job.device == "cpu":
        key = mono_key(job.config(), job.tokens, job.tp, job.layer, loopback=False, sms=device_sms("cpu"))
        host_buffers = host_shared_buffers(job.tp, buffer_bytes(build(key).peer))
    elif torch.cuda.device_count() < job.tp:
        if job.unfused:
            raise K3InputError(f"ranks --unfused: NCCL needs one GPU a rank ({job.tp}), this machine has "
                               f"{torch.cuda.device_count()}")
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    backend = "nccl" if job.unfused else "gloo"
    return spawn_ranks(job.tp, mono_rank_worker, (job, host_buffers), backend=backend)


# -- ranks in one process, launched at once --------------------------------------------------


def _rank_streams(job: RanksJob, device) -> tuple[list, int]:
    """One stream a rank and the SMs each rank's grid is planned for."""
    from .peers import green_streams

    if job.mode == "green":
        return green_streams(job.tp, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count // job.tp
    return [torch.cuda.Stream(device) for _ in range(job.tp)], sms


def run_concurrent(job: RanksJob) -> list[RankReport]:
    """T ranks in this process on one GPU, launched at once on T streams."""
    from .mono import MonoRunner, MonoTimeout
    from .weights import shard_all

    device = torch.device("cuda", torch.cuda.current_device())
    cfg, full = job.weights(device)
    streams, sms = _rank_streams(job, device)
    runner = MonoRunner(cfg, shard_all(full, cfg, job.tp), job.tokens, job.layer, loopback=False, sms=sms,
                        spin_limit=job.spin_limit)
    reports = [RankReport(rank) for rank in runner.ranks]
    present = [r for r in runner.ranks if r != job.absent]
    try:
        for index in range(job.input_sets):
            runner.load_inputs(**job.inputs(cfg, index, device))
            runner.poison()
            _launch_present(runner, streams, present)
            torch.cuda.synchronize(device)
            runner.check_health()
            for report, result in zip(reports, runner.rank_results()):
                report.eager.append(_outputs(result))
        if job.replays:
            _concurrent_replays(job, cfg, runner, streams, reports, device)
    except MonoTimeout:
        for report, rank in zip(reports, runner.rank_states):
            report.error = "absent (never launched)" if rank.rank == job.absent else _health_text(rank)
    return reports


def _launch_present(runner, streams, present) -> None:
    from .mono import launch_concurrently

    launch_concurrently([runner.rank_states[r] for r in present], [streams[r] for r in present])


def _health_text(rank) -> str | None:
    from .mono import MonoTimeout

    try:
        rank.check_health()
    except MonoTimeout as timeout:
        return str(timeout)
    return None


def _concurrent_replays(job, cfg, runner, streams, reports, device) -> None:
    """One CUDA graph a rank, captured on and replayed into the rank's own stream,
    the T replays issued together, each timed with events on the rank's stream.
    (One graph holding all T launches, forked onto green-context streams, timed
    out at its first replay on the H200, 2026-12-03, cause not established; these
    per-rank graphs passed 100 replays at T = 8.)"""
    sets = [job.inputs(cfg, index, device) for index in range(job.input_sets)]
    static = {name: t.clone() for name, t in sets[0].items()}
    runner.load_inputs(**static)
    events = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)) for _ in runner.ranks]
    graphs = []
    for rank, stream in zip(runner.rank_states, streams):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            rank.launch()
        graphs.append(graph)
    for replay in range(job.replays):
        for name, t in sets[replay % job.input_sets].items():
            static[name].copy_(t)
        runner.load_inputs(**static)
        for rank in runner.rank_states:
            rank.poison(peer_regions=False)
        _replay_concurrently(graphs, streams, events)
        torch.cuda.synchronize(device)
        runner.check_health()
        for report, result, (start, end) in zip(reports, runner.rank_results(), events):
            report.launch_us.append(1000 * start.elapsed_time(end))
            report.replays += 1
            report.replay_mismatches += not _same_bits(_outputs(result), report.eager[replay % job.input_sets])


def _replay_concurrently(graphs, streams, events) -> None:
    """Each rank's graph into its stream after the current stream's work (the
    inputs copied in), timed by its (start, end) events."""
    current = torch.cuda.current_stream()
    for stream in streams:
        stream.wait_stream(current)
    for graph, stream, (start, end) in zip(graphs, streams, events):
        with torch.cuda.stream(stream):
            start.record(stream)
            graph.replay()
            end.record(stream)
    for stream in streams:
        current.wait_stream(stream)


# -- judging ----------------------------------------------------------------------------------


@dataclass
class RanksVerdict:
    lines: list
    ok: bool


def judge(job: RanksJob, reports: list[RankReport]) -> RanksVerdict:
    """Rank 0's eager outputs against the oracle, every rank's against rank 0's bit
    for bit, replays against their eager runs; with ``absent``: every other rank
    stopped naming the absent rank."""
    if job.absent is not None:
        return _judge_fault(job, reports)
    lines, ok = [], True
    errors = [r for r in reports if r.error]
    for r in errors:
        lines.append(f"rank {r.rank}: FAIL {r.error}")
    if errors:
        return RanksVerdict(lines, False)
    device = torch.device(job.device if job.device == "cpu" else "cuda")
    verdicts = []
    for layer in job.layers:
        cfg, full = job.weights(device, layer)
        for index in range(job.input_sets):
            if job.layer_of(index) == layer:
                oracle = Oracle(cfg, full, job.inputs(cfg, index, device), layer)
                verdicts.append(oracle.judge(reports[0].eager[index]))
        del full
    for report in reports:
        shared = all(_same_bits(report.eager[i], reports[0].eager[i]) for i in range(job.input_sets))
        rank_ok = shared and all(v.ok for v in verdicts) and report.replay_mismatches == 0
        ok &= rank_ok
        median = f"{report.median_us:8.1f}" if report.median_us is not None else "       -"
        unfused = f"{report.unfused_us:8.1f}" if report.unfused_us is not None else "       -"
        worst = max(verdicts, key=lambda v: v.moe_err / v.moe_budget)
        lines.append(
            f"{report.rank:>4} {'identical' if shared else 'DIFFER':>10} {worst.moe_err:>9.2e} {worst.moe_budget:>9.2e} "
            f"{worst.routes_text:>10} {report.replays:>7} {report.replay_mismatches:>10} {median} {unfused}  "
            f"{'ok' if rank_ok else 'FAIL'}"
        )
    return RanksVerdict(lines, ok)


RANKS_HEADER = f"{'rank':>4} {'vs rank 0':>10} {'moe err':>9} {'budget':>9} {'routes':>10} {'replays':>7} {'mismatches':>10} {'med us':>8} {'unfused':>8}  ok"


def _judge_fault(job: RanksJob, reports: list[RankReport]) -> RanksVerdict:
    lines, ok = [], True
    for report in reports:
        if report.rank == job.absent:
            lines.append(f"rank {report.rank}: {report.error}")
            continue
        named = bool(report.error) and f"nothing arrived from rank(s) [{job.absent}]" in report.error
        ok &= named
        lines.append(f"rank {report.rank}: {'stopped' if named else 'FAIL'}: {report.error}")
    return RanksVerdict(lines, ok)


def write_json(job: RanksJob, reports: list[RankReport], verdict: RanksVerdict, seconds: float, out_dir) -> str:
    """The run's per-rank results under ``out_dir``; returns the path."""
    import dataclasses
    import json
    from pathlib import Path

    from .bench import run_metadata

    meta = run_metadata()
    record = {
        **meta, "job": dataclasses.asdict(job), "ok": verdict.ok, "seconds": seconds, "lines": verdict.lines,
        "ranks": [
            {"rank": r.rank, "error": r.error, "replays": r.replays, "replay_mismatches": r.replay_mismatches,
             "median_us": r.median_us, "launch_us": r.launch_us, "unfused_us": r.unfused_us}
            for r in reports
        ],
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fault = f"-absent{job.absent}" if job.absent is not None else ""
    layers = "-layers-" + "-".join(map(str, job.layers)) if job.other_layers else ""
    path = out_dir / f"ranks-{meta['date']}-{meta['commit']}-{job.mode}-T{job.tp}-S{job.tokens}{layers}{fault}.json"
    path.write_text(json.dumps(record, indent=1))
    return str(path)


def run_ranks(job: RanksJob) -> tuple[list[RankReport], RanksVerdict, float]:
    """Run the job; returns the reports, the verdict and the wall time in seconds."""
    started = time.time()
    reports = run_procs(job) if job.mode == "procs" else run_concurrent(job)
    return reports, judge(job, reports), time.time() - started
