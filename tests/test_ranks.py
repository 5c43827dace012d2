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


# -- the mono launch with real peers: one process a rank, CPU shared memory -----------------------


def test_mono_ranks_in_processes_meet_the_oracle_and_agree_bit_for_bit(capsys):
    from k3mono.cli import main

    assert main(["ranks", "--tp", "2", "--tokens", "3", "--device", "cpu"]) == 0
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"]
    assert all(row[1] == "identical" and row[-1] == "ok" for row in rows), table
    assert "ranks: all ok" in table


def test_four_mono_ranks_in_processes():
    from k3mono.rankjob import RanksJob, run_ranks

    reports, verdict, _ = run_ranks(RanksJob(tp=4, tokens=2, input_sets=1, device="cpu"))
    assert verdict.ok, verdict.lines
    assert [r.rank for r in reports] == [0, 1, 2, 3] and all(len(r.eager) == 1 for r in reports)


def test_mono_ranks_in_processes_take_layers_in_turn_on_one_set_of_buffers(capsys):
    """An engine's ranks run every layer on one set of buffers (MonoRank.for_layer,
    peers from one collective set-up): input sets alternate between two layers of
    other weights, each judged against its own layer's oracle."""
    from k3mono.cli import main

    assert main(["ranks", "--tp", "2", "--device", "cpu", "--other-layers", "92", "--input-sets", "3"]) == 0
    table = capsys.readouterr().out
    assert "layers 13 92 " in table
    rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"]
    assert all(row[1] == "identical" and row[-1] == "ok" for row in rows), table


def test_other_layers_are_checked_before_anything_spawns(capsys):
    from k3mono.cli import main
    from k3mono.errors import K3InputError
    from k3mono.rankjob import RanksJob

    with pytest.raises(K3InputError, match="procs mode"):
        RanksJob(tp=2, mode="green", device="cuda", other_layers=(92,))
    with pytest.raises(K3InputError, match=r"input_sets: expected at least one a layer \(3\), got 2"):
        RanksJob(tp=2, other_layers=(25, 92))
    assert main(["ranks", "--tp", "2", "--device", "cpu", "--other-layers", "0"]) == 2
    assert "layer: expected an MoE layer" in capsys.readouterr().err


def test_a_mono_rank_that_never_launches_stops_the_others_naming_it(capsys):
    """Rank 2 never launches: ranks 0, 1, 3 time out on their first exchange and say
    that nothing arrived from rank 2; every process exits."""
    import time

    from k3mono.cli import main

    started = time.time()
    assert main(["ranks", "--tp", "4", "--device", "cpu", "--absent", "2"]) == 0
    out = capsys.readouterr().out
    for rank in (0, 1, 3):
        assert re.search(rf"rank {rank}: stopped: mono launch: rank {rank} layer 13 epoch 1: .*timed out waiting for "
                         rf"flag AR1\[\d+\].*exchange ar1: nothing arrived from rank\(s\) \[2\]", out), out
    assert "rank 2: absent (never launched)" in out
    assert time.time() - started < 120


def test_ranks_asks_for_a_gpu_where_it_needs_one(capsys):
    from k3mono.cli import main
    from k3mono.errors import K3InputError
    from k3mono.rankjob import RanksJob

    with pytest.raises(K3InputError, match="need --device cuda"):
        RanksJob(tp=2, mode="green", device="cpu")
    assert main(["ranks", "--tp", "2", "--device", "cpu", "--mode", "green"]) == 2
    assert main(["ranks", "--tp", "3", "--device", "cpu"]) == 2
    assert main(["ranks", "--tp", "2", "--device", "cpu", "--absent", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("k3mono: error: ") == 3 and "absent: expected a rank in 0..1, got 5" in err


def test_green_partitions_are_whole_sm_groups():
    from k3mono.errors import K3InputError
    from k3mono.peers import GREEN_SM_GRANULE, green_partition_sms

    assert [green_partition_sms(t, 132) for t in (1, 2, 4, 8, 16)] == [128, 64, 32, 16, 8]
    assert all(green_partition_sms(t, 132) % GREEN_SM_GRANULE == 0 for t in (1, 2, 4, 8, 16))
    with pytest.raises(K3InputError, match="do not fit in 132 SMs"):
        green_partition_sms(32, 132)


def test_host_shared_peer_buffers_are_zeroed_and_shared():
    from k3mono.peers import host_shared_buffers

    buffers = host_shared_buffers(3, 4096)
    assert len(buffers) == 3 and all(b.is_shared() and b.numel() == 4096 and not b.any() for b in buffers)


def test_ranks_checks_the_checkpoint_before_it_spawns(tmp_path, capsys):
    from k3mono.cli import main

    make_checkpoint(tmp_path / "ckpt", "tiny", (LAYER,), seed=4)
    assert main(["ranks", "--tp", "2", "--device", "cpu", "--checkpoint", str(tmp_path / "ckpt"), "--layer", "12"]) == 2
    assert "layers.12.self_attn.o_proj.weight is missing" in capsys.readouterr().err


def unfused_worker(rank, tp, ckpt, inputs):
    from k3mono.unfused import CollectiveUnfusedRank

    cfg, full = load_layer(ckpt, LAYER)
    core_r = inputs["core"].chunk(tp, dim=1)[rank]
    prefix = inputs["prefix"].clone()
    out = CollectiveUnfusedRank(cfg, shard(full, cfg, tp, rank), tokens=3, layer=LAYER)(core_r, prefix, inputs["blocks"])
    return {"moe_out": out, "prefix": prefix}


def test_the_unfused_baseline_with_collectives_meets_the_oracle_on_every_rank(tmp_path):
    """The engines' unfused path (torch ops, exchanges as all-reduce / all-gather):
    what the several-GPU comparison runs over NCCL, here over gloo."""
    from k3mono.runner import Oracle

    cfg = make_checkpoint(tmp_path / "ckpt", "tiny", (LAYER,), seed=4)
    inputs = random_inputs(cfg, 3, LAYER, seed=6)
    per_rank = spawn_ranks(2, unfused_worker, (str(tmp_path / "ckpt"), inputs))
    _, full = load_layer(tmp_path / "ckpt", LAYER)
    oracle = Oracle(cfg, full, inputs, LAYER)
    for got in per_rank:
        verdict = oracle.judge(dict(got, route_ids=oracle.reference.route_ids))
        assert verdict.moe_err <= verdict.moe_budget and verdict.prefix_err <= verdict.prefix_budget, verdict
        assert torch.equal(got["moe_out"].view(torch.int16), per_rank[0]["moe_out"].view(torch.int16))
