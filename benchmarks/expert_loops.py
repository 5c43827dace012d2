"""The expert stages' hot loops in other shapes, staged path, one rank of TP8
(loopback): the pipeline depth (steps in flight through shared memory;
1: loads straight into registers) and the unroll factor of the MXFP4 loops
(kernels/experts.py EXPERT_STAGES, EXPERT_UNROLL), each variant's
expert_gate_up and expert_down timed alone (CUDA-graph replay, weights
rotated) with the bytes they read over the copy bandwidth of the same run.

    python benchmarks/expert_loops.py [--tokens 1 8] [--loops 3x1 1x1 2x1 4x1 1x2 1x4]
"""

from __future__ import annotations

import argparse

import torch

from k3mono.bench import WEIGHT_SETS, _loopback_layers, _rank0_stages, _unique_experts
from k3mono.config import preset
from k3mono.floor import weight_bytes
from k3mono.kernels import experts
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--loops", nargs="+", default=["3x1", "1x1", "2x1", "4x1", "1x2", "1x4"],
                        help="STAGESxUNROLL")
    parser.add_argument("--tp", type=int, default=8)
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
            del layers
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
