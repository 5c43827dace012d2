"""Ranks as spawned processes with a gloo group: the TP reference with real
exchanges matches the single-process form bit for bit, on every rank."""

import os
import re

import pytest
import torch

from k3mono.checkpoint import load_layer
from k3mono.ranks import RANK_ENV, distributed_layer_post_tp, spawn_ranks
from k3mono.reference import layer_post_tp
from k3mono.synthetic import make_checkpoint, random_inputs
from k3mono.weights import shard, shard_all

LAYER = 13


def rank_worker(rank, tp, ckpt, inputs):
    assert all(os.environ[k] == v for k, v in RANK_ENV.items())
    cfg, full = load_layer(ckpt, LAYER)
    result = distributed_layer_post_tp(**inputs, layer=LAYER, shard=shard(full, cfg, tp, rank), cfg=cfg)
    return result.outputs()


@pytest.mark.parametrize("tp", [2, 4])
def test_gloo_ranks_match_the_single_process_tp_reference(tmp_path, tp):
    cfg = make_checkpoint(tmp_path / "ckpt", "tiny", (LAYER,), seed=4)
    inputs = random_inputs(cfg, 3, LAYER, seed=5)
    per_rank = spawn_ranks(tp, rank_worker, (str(tmp_path / "ckpt"), inputs))
    _, full = load_layer(tmp_path / "ckpt", LAYER)
    want = layer_post_tp(**inputs, layer=LAYER, shards=shard_all(full, cfg, tp), cfg=cfg).outputs()
    for rank, got in enumerate(per_rank):
        for name, tensor in want.items():
            assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), (rank, name)


def absent_rank_worker(rank, tp):
    if rank == 1:
        raise SystemExit(3)  # this rank never reaches the exchange
    import torch.distributed as dist

    dist.all_gather([torch.empty(1) for _ in range(tp)], torch.ones(1))


def test_a_rank_that_never_arrives_ends_the_others_with_an_error():
    from datetime import timedelta

    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    with pytest.raises((ProcessExitedException, ProcessRaisedException)) as err:
        spawn_ranks(2, absent_rank_worker, timeout=timedelta(seconds=20))
    # whichever of the two ends first is named; what matters is that nothing hangs
    assert re.search(r"[Pp]rocess [01] terminated", str(err.value))
