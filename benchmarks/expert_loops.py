"""The expert stages' hot loops in other shapes, staged path, one rank of TP8
(loopback): the pipeline depth (steps in flight through shared memory;
1: loads straight into registers) and the unroll factor of the MXFP4 loops
(kernels/experts.py EXPERT_STAGES, EXPERT_UNROLL), each variant's
expert_gate_up and expert_down timed alone (CUDA-graph replay, weights
rotated) with the bytes they read over the copy bandwidth of the same run.
``--mma`` adds the tensor-core stages (weights in k3mono.mxfp4.mma_order,
activations times 2^63), ``--f16`` the FMA stages summing each group in f16
(weights in k3mono.mxfp4.f16_order), each on every layer's own z and routes,
first checked against the FMA stages' outputs of that run.

    python benchmarks/expert_loops.py [--tokens 1 8] [--loops 3x1 1x1 2x1 4x1 1x2 1x4] [--mma] [--f16]
"""

from __future__ import annotations

import argparse

import torch

from k3mono.bench import WEIGHT_SETS, _loopback_layers, _rank0_stages, _unique_experts
from k3mono.config import preset
from k3mono.floor import weight_bytes
from k3mono.kernels import experts
from k3mono.mxfp4 import f16_order, mma_order
from k3mono.runner import rel_err
from k3mono.synthetic import random_shard
from k3mono.timing import copy_bandwidth, time_graph

STAGE_TENSORS = {
    "expert_gate_up": ("w1_packed", "w1_scale", "w3_packed", "w3_scale"),
    "expert_down": ("w2_packed", "w2_scale"),
}


def expert_bytes(cfg, tp: int, unique_experts: float) -> dict:
    """Packed weights and scales the two stages read (the floor's count: the distinct experts routed to)."""
    read = weight_bytes(cfg, tp, unique_experts)
    return {stage: sum(read[name] for name in names) for stage, names in STAGE_TENSORS.items()}


PRESCALE = 2.0**63  # kernels/mxfp4.py ACT_PRESCALE
# tests/test_kernels_moe.py's bounds: an act may move by 2 bf16 steps (fp32 sums in another order),
# on at most 1 % of the elements, or by any steps below 1e-5 of its row's RMS (a value that cancelled)
ACT_ULPS = 2
ACT_OFF_FRACTION = 0.01
CANCEL_REL = 1e-5
PARTIAL_REL = 1e-3  # of the partial's largest magnitude: the act flips above carry on
F16_REL = 1e-2
"""Relative (norm) difference the f16 sums' act and partial may show against the
fp32 sums' of the same run: their own error is about 1e-3 (tests/test_kernels_moe.py
holds them to the reference's budget); a wrong nibble, scale or pair is off by O(1)."""


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (sign-magnitude bits made monotone)."""
    def key(t):
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits & 0x7FFF)

    return (key(a) - key(b)).abs()


def mma_stages(cfg, layer, shard, tokens: int) -> dict:
    """The tensor-core stages of one staged layer's rank 0, on its z and routes."""
    scratch, z = layer.scratch[0], layer.peer[0]["z"]
    words = {name: mma_order(getattr(shard, f"{name}_packed")) for name in ("w1", "w3", "w2")}
    z_prescaled = (z.float() * PRESCALE).to(torch.bfloat16)
    act = torch.empty_like(scratch["expert_act"])
    partial = torch.empty(tokens, cfg.routed_expert_hidden_size, device=z.device)
    ids, route_w = scratch["route_ids"], scratch["route_w"]
    return {
        "expert_gate_up": lambda: experts.launch_expert_gate_up_mma(
            z_prescaled, ids, words["w1"], shard.w1_scale, words["w3"], shard.w3_scale, act, tokens, cfg),
        "expert_down": lambda: experts.launch_expert_down_mma(
            act, ids, route_w, words["w2"], shard.w2_scale, partial, tokens, cfg),
        "act": act,
        "partial": partial,
    }


def f16_stages(cfg, layer, shard, tokens: int) -> dict:
    """The f16-sum stages of one staged layer's rank 0, on its z and routes."""
    scratch, z = layer.scratch[0], layer.peer[0]["z"]
    ordered = {name: f16_order(getattr(shard, f"{name}_packed")) for name in ("w1", "w3", "w2")}
    act = torch.empty_like(scratch["expert_act"])
    partial = torch.empty(tokens, cfg.routed_expert_hidden_size, device=z.device)
    ids, route_w = scratch["route_ids"], scratch["route_w"]
    return {
        "expert_gate_up": lambda: experts.launch_expert_gate_up(
            z, ids, ordered["w1"], shard.w1_scale, ordered["w3"], shard.w3_scale, act, layer.geom, cfg),
        "expert_down": lambda: experts.launch_expert_down(
            act, ids, route_w, ordered["w2"], shard.w2_scale, partial, layer.geom, cfg),
        "act": act,
        "partial": partial,
    }


def check_f16(layer, stages: dict) -> None:
    """The f16-sum outputs against the FMA stages' of the same layer run."""
    stages["expert_gate_up"]()
    stages["expert_down"]()
    act_err = rel_err(stages["act"], layer.scratch[0]["expert_act"])
    partial_err = rel_err(stages["partial"], layer.peer[0]["ar2"][0])
    if not act_err <= F16_REL or not partial_err <= F16_REL:
        raise SystemExit(f"f16-sum stages disagree with the fp32 sums: act {act_err:.2e}, partial {partial_err:.2e}")
    print(f"  f16-sum stages agree: act {act_err:.1e}, partial {partial_err:.1e} (relative)", flush=True)


def check_mma(layer, stages: dict) -> None:
    """The tensor-core outputs against the FMA stages' of the same layer run."""
    stages["expert_gate_up"]()
    stages["expert_down"]()
    want_act = layer.scratch[0]["expert_act"]
    act = (stages["act"].float() / PRESCALE).to(torch.bfloat16)
    steps = bf16_steps(act, want_act)
    off = int((steps > 0).sum())
    rms = want_act.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    far = (act.float() - want_act.float()).abs() > CANCEL_REL * rms
    worst = int(steps[far].max()) if far.any() else 0
    want_partial = layer.peer[0]["ar2"][0]
    partial_err = float((stages["partial"] - want_partial).abs().max() / want_partial.abs().max())
    if off > ACT_OFF_FRACTION * act.numel() + 1 or worst > ACT_ULPS or partial_err > PARTIAL_REL:
        raise SystemExit(f"tensor-core stages disagree with the FMA stages: act {off} of {act.numel()} elements off, "
                         f"at most {worst} steps; partial {partial_err:.2e} of its largest")
    print(f"  tensor-core stages agree: act {off} of {act.numel()} elements off, at most {worst} steps; "
          f"partial {partial_err:.1e}", flush=True)


ORDERS = {"tensor cores": (mma_stages, check_mma), "f16 sums": (f16_stages, check_f16)}


def time_order(order: str, cfg, layers, sets, tokens: int, read: dict, bandwidth: float) -> str:
    make, check = ORDERS[order]
    by_set = [make(cfg, layer, shard, tokens) for layer, shard in zip(layers, sets)]
    for layer, stages in zip(layers, by_set):
        check(layer, stages)
    cells = []
    for name in STAGE_TENSORS:
        seconds = time_graph([stages[name] for stages in by_set])
        cells.append(f"{name} {seconds * 1e6:6.1f} us ({read[name] / seconds / bandwidth:4.0%} of copy)")
    return ", ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--loops", nargs="+", default=["3x1", "1x1", "2x1", "4x1", "1x2", "1x4"],
                        help="STAGESxUNROLL")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--mma", action="store_true", help="also the tensor-core stages (weights in mma order)")
    parser.add_argument("--f16", action="store_true", help="also the f16-sum stages (weights in f16 order)")
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    sets = [random_shard(cfg, args.tp, seed=s, device="cuda") for s in range(WEIGHT_SETS)]
    bandwidth = copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    for tokens in args.tokens:
        for loop in args.loops:
            stages, unroll = (int(v) for v in loop.split("x"))
            experts.EXPERT_STAGES, experts.EXPERT_UNROLL = stages, unroll
            layers = _loopback_layers(cfg, args.tp, tokens, sets)
            read = expert_bytes(cfg, args.tp, _unique_experts(layers))
            by_name = [dict(_rank0_stages(layer)) for layer in layers]
            cells = []
            for name in STAGE_TENSORS:
                seconds = time_graph([stages_of[name] for stages_of in by_name])
                cells.append(f"{name} {seconds * 1e6:6.1f} us ({read[name] / seconds / bandwidth:4.0%} of copy)")
            print(f"T={args.tp} S={tokens:>2} loops {stages}x{unroll}: " + ", ".join(cells), flush=True)
            for order, asked in (("tensor cores", args.mma), ("f16 sums", args.f16)):
                if asked and loop == args.loops[-1]:
                    print(f"T={args.tp} S={tokens:>2} {order}: "
                          + time_order(order, cfg, layers, sets, tokens, read, bandwidth), flush=True)
            del layers
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
