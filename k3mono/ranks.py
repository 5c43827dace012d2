"""Ranks as processes: spawning T of them, their torch.distributed group, and
the tensor-parallel reference with its exchanges over that group.

Every process that may touch NVLink starts with multicast off
(``RANK_ENV``): a program that uses multicast can put a shared host's GPUs out
of service, and nothing here needs it.

The distributed reference runs ``reference.tp.rank_program`` (the same
per-rank code the single-process TP reference runs) and combines each
exchange with an all-gather followed by a sum in rank order, so its results
are bit-identical to the single-process form and on every rank.
"""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .reference import stages as st
from .reference.tp import combine, rank_program

RANK_ENV = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}
RENDEZVOUS_TIMEOUT = timedelta(seconds=120)
"""Bound on every collective: a rank that never arrives is an error, not a hang."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, tp: int, port: int, backend: str, timeout: timedelta, worker, args, out_dir: str) -> None:
    os.environ.update(RANK_ENV)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp, timeout=timeout)
    try:
        result = worker(rank, tp, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_ranks(tp: int, worker, args=(), backend: str = "gloo", timeout: timedelta = RENDEZVOUS_TIMEOUT) -> list:
    """Run ``worker(rank, tp, *args)`` in T spawned processes joined in one
    process group; returns each rank's return value (saved with torch.save).
    A rank that fails ends the others (torch.multiprocessing terminates them)
    and raises here, naming it; a rank that never arrives ends every
    collective after ``timeout``."""
    os.environ.update(RANK_ENV)
    with tempfile.TemporaryDirectory(prefix="k3mono-ranks-") as out_dir:
        mp.start_processes(
            _entry,
            args=(tp, free_port(), backend, timeout, worker, args, out_dir),
            nprocs=tp,
            join=True,
            start_method="spawn",
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(tp)]


def all_gather_combine(kind: str, part: torch.Tensor, group=None) -> torch.Tensor:
    """The exchange over the process group: every rank's part, combined in rank order."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, part.contiguous(), group=group)
    return combine(kind, parts)


def distributed_layer_post_tp(core, prefix, blocks, layer, shard, cfg, *, mode="bf16", group=None):
    """This process's rank of the TP reference, exchanging through ``group``."""
    program = rank_program(core, prefix, blocks, layer, shard, cfg, st.MODES[mode], None, {})
    message = next(program)
    while True:
        try:
            message = program.send(all_gather_combine(message.kind, message.part, group))
        except StopIteration as done:
            return done.value
