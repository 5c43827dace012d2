"""GPU correctness at the released dims: the staged path (T = 1, and T = 8 with
all eight ranks' shards on the one GPU) against the float64 oracle, on fresh
random inputs, outputs poisoned before each run, routes compared exactly with
the bf16 reference, every rank's copy compared bit for bit.

    python benchmarks/gpu_check.py [--tp 1 8] [--tokens 1 4 16] [--skip-staged] [--skip-mono]
                                   [--grids 132 100 66 1] [--occupy-sms 66] [--dense-step-kb 8] [--gate-up-rows 32]
                                   [--down-rows 32] [--router-rows 8] [--expert-lookahead 0] [--expert-mma 1]
                                   [--layers-tokens 1]

The mono section runs the mono launch (k3mono.mono.MonoRunner: T = 1, and
T = 8 with every rank in loopback) eagerly, then captures the T launches in
one CUDA graph and replays it 3 times, fresh inputs copied into the same
input buffers before each replay (no other host work: the launch resets its
ticket counter and advances its epoch itself; parities alternate).

The grid section runs one rank of TP8 in loopback at S = 1 with grids of the
given CTA counts (one CTA a SM planned for that many SMs; the grid of 1 walks
the whole table alone), and once with a spinning kernel holding --occupy-sms
SMs on another stream while the launch starts: tickets are taken by resident
CTAs only, so neither may change a bit of the outputs or hang.

The layers section (T = 1, at --layers-tokens) runs LAYER and OTHER_LAYER, other
weights, on one set of buffers (MonoRunner.for_layer), each bound to its own
activation tensors (MonoRank.bind), both launches in one CUDA graph, 3 replays
with fresh inputs, each layer against its own oracle.

Prints one line per case and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
import triton
import triton.language as tl

from k3mono.config import preset
from k3mono.mono import (DEFAULT_CTAS_PER_SM, OPTION_FIELDS, MonoRunner, default_options, default_options_with,
                         device_sms)
from k3mono.planner import MonoOptions, TileChoice
from k3mono.runner import Oracle
from k3mono.staged import StagedLayer
from k3mono.synthetic import random_inputs, random_shard
from k3mono.weights import shard_all

LAYER = 25
OTHER_LAYER = 92  # the last: 8 AttnRes blocks (a candidate pad of 16 against LAYER's 4)
OCCUPY_SPIN_STEPS = 1 << 22  # about a millisecond of dependent FMAs: longer than the launch


@triton.jit
def _occupy_kernel(sink_ptr,  # [programs] fp32: keeps the loop from being folded away
                   STEPS: tl.constexpr):
    acc = tl.program_id(0).to(tl.float32)
    for _ in range(STEPS):
        acc = acc * 0.999 + 1.0
    tl.store(sink_ptr + tl.program_id(0), acc)


def same_on_every_rank(results) -> bool:
    first = results[0]
    return all(
        torch.equal(r.moe_out.view(torch.int16), first.moe_out.view(torch.int16))
        and torch.equal(r.prefix.view(torch.int16), first.prefix.view(torch.int16))
        and torch.equal(r.route_ids, first.route_ids)
        for r in results[1:]
    )


def mono_case(cfg, full, shards, tp: int, tokens: int, device, options: MonoOptions) -> int:
    """Eager + 3 graph replays of the mono launch; returns the number of failures."""
    failures = 0
    started = time.time()
    runner = MonoRunner(cfg, shards, tokens, LAYER, options=options)
    first = {k: v.to(device) for k, v in random_inputs(cfg, tokens, LAYER, seed=77 * tp + tokens).items()}
    # fixed input buffers: the graph reads these addresses
    core, prefix, blocks = first["core"].clone(), first["prefix"].clone(), first["blocks"].clone()

    def judge(label, inputs):
        nonlocal failures
        oracle = Oracle(cfg, full, inputs, LAYER)
        results = runner.rank_results()
        verdicts = [oracle.judge(dict(r.outputs(), router_logits=r.router_logits)) for r in results]
        verdict = verdicts[0]
        # In loopback each rank ran alone against the staged driver's pushes of the
        # others, whose fp32 sums are ordered by other kernels' layouts: each rank
        # is judged on its own; bit-identity across ranks needs ranks run together.
        agree = same_on_every_rank(results) if tp == 1 else all(v.ok for v in verdicts)
        ok = verdict.ok and agree and not any(torch.isnan(r.moe_out.float()).any() for r in results)
        failures += not ok
        print(
            f"mono {label} T={tp} S={tokens:>2} epoch {runner.epoch() - 1}: moe err {verdict.moe_err:.2e} "
            f"(budget {verdict.moe_budget:.2e}) prefix err {verdict.prefix_err:.2e} (budget {verdict.prefix_budget:.2e}) "
            f"routes {verdict.routes_text} ranks {('agree' if tp == 1 else 'each ok') if agree else 'DIFFER'} "
            f"{'ok' if ok else 'FAIL'} ({time.time() - started:.0f} s)",
            flush=True,
        )

    try:
        runner(core, prefix, blocks)
        judge("eager", first)
        graph = torch.cuda.CUDAGraph()
        runner.load_inputs(core, prefix, blocks)  # the buffers the graph will read
        with torch.cuda.graph(graph):
            for rank in runner.ranks:
                runner.launch(rank)
        for replay in range(3):
            fresh = {k: v.to(device) for k, v in random_inputs(cfg, tokens, LAYER, seed=900 + 10 * replay + tokens).items()}
            core.copy_(fresh["core"])
            prefix.copy_(fresh["prefix"])
            blocks.copy_(fresh["blocks"])
            runner.load_inputs(core, prefix, blocks)  # copies into the runner's buffers (+ loopback pre-write)
            runner.poison()
            graph.replay()
            torch.cuda.synchronize()
            runner.check_health()
            judge(f"graph replay {replay}", fresh)
    except RuntimeError as error:  # a timeout names rank, task and flag
        failures += 1
        print(f"mono T={tp} S={tokens:>2}: FAIL {error}", flush=True)
    del runner
    torch.cuda.empty_cache()
    return failures


def route_sources(runner, parity: int) -> dict:
    """Where rank 0's launch leaves its routes, and its logits at ``parity``."""
    scratch = runner.scratch(0)
    return {"route_ids": scratch["route_ids"], "route_weights": scratch["route_w"],
            "router_logits": runner.parity_views(0, parity)["logits"]}


def launch_layers(runners: dict, sources: dict, routes: dict) -> None:
    """Each layer's launch in turn, its routes copied out before the next one's."""
    for layer, runner in runners.items():
        runner.launch(0)
        for name, t in routes[layer].items():
            t.copy_(sources[layer][name])


def layers_case(cfg, weights: dict, tokens: int, device, options: MonoOptions) -> int:
    """Two layers taking turns on one set of buffers (MonoRunner.for_layer), T = 1,
    each bound to its own activation tensors (MonoRank.bind: no copies): both
    launches captured in one CUDA graph and replayed 3 times, fresh inputs copied
    into the bound tensors before each replay, each layer judged against its own
    oracle. Returns the number of failures."""
    failures = 0
    started = time.time()
    (first_layer, first_w), (second_layer, second_w) = weights.items()
    first = MonoRunner(cfg, [first_w], tokens, first_layer, options=options)
    runners = {first_layer: first, second_layer: first.for_layer(second_layer, [second_w])}
    bound = {layer: {k: v.to(device) for k, v in random_inputs(cfg, tokens, layer, seed=layer).items()}
             for layer in runners}
    try:
        for layer, runner in runners.items():
            bound[layer]["out"] = torch.empty((tokens, cfg.hidden_size), dtype=torch.bfloat16, device=device)
            runner.rank_states[0].bind(**bound[layer])
        # A launch's routes and logits live in the buffers the next layer's launch
        # rewrites: the graph copies them out after each launch. Each replay runs
        # two launches, so a layer always meets the same epoch parity.
        sources = {layer: route_sources(runner, (first.epoch() + i) & 1)
                   for i, (layer, runner) in enumerate(runners.items())}
        routes = {layer: {name: t.clone() for name, t in named.items()} for layer, named in sources.items()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch_layers(runners, sources, routes)
        for replay in range(3):
            inputs = {}
            for layer, runner in runners.items():
                inputs[layer] = {k: v.to(device) for k, v in
                                 random_inputs(cfg, tokens, layer, seed=700 + 10 * replay + layer).items()}
                for name, t in inputs[layer].items():
                    bound[layer][name].copy_(t)
                runner.poison()
            graph.replay()
            torch.cuda.synchronize()
            for layer, runner in runners.items():
                runner.check_health()
                outputs = dict(routes[layer], moe_out=bound[layer]["out"], prefix=bound[layer]["prefix"])
                outputs["route_ids"] = outputs["route_ids"].to(torch.int64)
                verdict = Oracle(cfg, weights[layer], inputs[layer], layer).judge(outputs)
                failures += not verdict.ok
                print(f"mono layers {first_layer} and {second_layer} on one set of buffers, bound tensors, graph "
                      f"replay {replay}: layer {layer} S={tokens:>2}: moe err {verdict.moe_err:.2e} (budget "
                      f"{verdict.moe_budget:.2e}) prefix err {verdict.prefix_err:.2e} (budget "
                      f"{verdict.prefix_budget:.2e}) routes {verdict.routes_text} {'ok' if verdict.ok else 'FAIL'} "
                      f"({time.time() - started:.0f} s)", flush=True)
    except RuntimeError as error:
        failures += 1
        print(f"mono layers S={tokens:>2}: FAIL {error}", flush=True)
    del runners, first
    torch.cuda.empty_cache()
    return failures


def default_grid_run(cfg, shards, device) -> tuple[dict, object]:
    """(inputs, outputs) of one rank of TP8 in loopback at S = 1 on the default grid:
    what every grid case must reproduce bit for bit."""
    inputs = {k: v.to(device) for k, v in random_inputs(cfg, 1, LAYER, seed=4242).items()}
    reference = MonoRunner(cfg, shards, 1, LAYER)
    return inputs, reference.layer_post(inputs["core"], inputs["prefix"], inputs["blocks"])


def grid_case(cfg, shards, ctas: int, occupy_sms: int, device, inputs: dict, expected) -> int:
    """The default_grid_run on a grid of ``ctas`` CTAs, optionally while a spinning
    kernel holds ``occupy_sms`` SMs; judged against ``expected`` bit for bit.
    Returns the number of failures."""
    started = time.time()
    runner = MonoRunner(cfg, shards, 1, LAYER, sms=ctas, options=default_options(1, ctas_per_sm=1))
    label = f"grid {runner.compiled.grid:>3} CTAs" + (f" beside a kernel on {occupy_sms} SMs" if occupy_sms else "")
    try:
        if occupy_sms:
            side = torch.cuda.Stream(device)
            sink = torch.empty(occupy_sms, device=device)
            with torch.cuda.stream(side):
                _occupy_kernel[(occupy_sms,)](sink, STEPS=OCCUPY_SPIN_STEPS)
        got = runner.layer_post(inputs["core"], inputs["prefix"], inputs["blocks"])
        torch.cuda.synchronize()
        same = same_on_every_rank([expected, got])
        verdict = "same bits as the default grid ok" if same else "DIFFERS from the default grid FAIL"
    except RuntimeError as error:
        same, verdict = False, f"FAIL {error}"
    print(f"mono T={runner.tp} S= 1 {label}: {verdict} ({time.time() - started:.0f} s)", flush=True)
    del runner
    return 0 if same else 1


GIVEN_FIELDS = (*(f.name for f in dataclasses.fields(TileChoice)), *OPTION_FIELDS)
"""The TileChoice and MonoOptions fields the command line may set (mono.default_options_with)."""


def chosen_options(args, tokens: int):
    """default_options for S = ``tokens`` with the fields the arguments give."""
    return default_options_with(tokens, {name: getattr(args, name) for name in GIVEN_FIELDS
                                         if getattr(args, name) is not None})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--skip-staged", action="store_true")
    parser.add_argument("--skip-mono", action="store_true")
    for name in (f.name for f in dataclasses.fields(TileChoice)):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"TileChoice.{name} (default: mono.default_tiles(S)'s; 0 / 1 for a bool)")
    option_defaults = {f.name: f.default for f in dataclasses.fields(MonoOptions)}
    for name in OPTION_FIELDS:
        boolean = isinstance(option_defaults[name], bool)
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, choices=[0, 1] if boolean else None,
                            help=f"MonoOptions.{name} (default: mono.default_options(S)'s)")
    parser.add_argument("--grids", type=int, nargs="*", default=[132, 100, 66, 1])
    parser.add_argument("--occupy-sms", type=int, default=66, help="0: no co-occupying kernel case")
    parser.add_argument("--layers-tokens", type=int, nargs="*", default=[1],
                        help="T = 1: layers LAYER and OTHER_LAYER on one set of buffers at these S")
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    device = torch.device("cuda")
    full = random_shard(cfg, 1, seed=7, device=device)
    failures = 0
    for tp in args.tp:
        shards = shard_all(full, cfg, tp) if tp > 1 else [full]
        for tokens in args.tokens if not args.skip_staged else ():
            started = time.time()
            # the staged path's own tiles, but for the parts of K the command may give (its router and latent down)
            staged = StagedLayer(cfg, shards, tokens, LAYER,
                                 tiles=TileChoice(x_k_parts=args.x_k_parts) if args.x_k_parts else TileChoice())
            inputs = {k: v.to(device) for k, v in random_inputs(cfg, tokens, LAYER, seed=31 * tp + tokens).items()}
            oracle = Oracle(cfg, full, inputs, LAYER)
            result = staged(**inputs)
            verdict = oracle.judge(dict(result.outputs(), router_logits=result.router_logits))
            agree = same_on_every_rank(staged.rank_results())
            ok = verdict.ok and agree and not torch.isnan(result.moe_out.float()).any()
            failures += not ok
            print(
                f"staged T={tp} S={tokens:>2}: moe err {verdict.moe_err:.2e} (budget {verdict.moe_budget:.2e}) "
                f"prefix err {verdict.prefix_err:.2e} (budget {verdict.prefix_budget:.2e}) "
                f"routes {verdict.routes_text} ranks {'agree' if agree else 'DIFFER'} "
                f"{'ok' if ok else 'FAIL'} ({time.time() - started:.0f} s)",
                flush=True,
            )
            del staged
        if not args.skip_mono:
            for tokens in args.tokens:
                options = chosen_options(args, tokens)
                failures += mono_case(cfg, full, shards, tp, tokens, device, options)
            for tokens in args.layers_tokens if tp == 1 else ():
                options = chosen_options(args, tokens)
                other = random_shard(cfg, 1, seed=8, device=device)
                failures += layers_case(cfg, {LAYER: full, OTHER_LAYER: other}, tokens, device, options)
                del other
        if tp == 8:
            inputs, expected = default_grid_run(cfg, shards, device)
            for ctas in args.grids:
                failures += grid_case(cfg, shards, ctas, 0, device, inputs, expected)
            if args.occupy_sms:
                failures += grid_case(cfg, shards, device_sms(device) * DEFAULT_CTAS_PER_SM, args.occupy_sms, device,
                                      inputs, expected)
        del shards
        torch.cuda.empty_cache()
    print("gpu_check: all ok" if not failures else f"gpu_check: {failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
