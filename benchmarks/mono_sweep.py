"""The mono launch's knobs at one rank of TP8 (loopback): CTAs per SM (with a
register cap where the build would not fit that many), the prefetch mode, the
dense GEMV step (KB of weight a task loads a step), the rows of an expert
task and of a router task (FMA path, S <= 4), beside the staged path at the same
tiles in the same run (its stages too: whether smaller tasks help where the
grid, not a register budget, sets how many warps an SM holds).

    python benchmarks/mono_sweep.py [--tokens 1 8] [--ctas 1 2 3:168 4:128] [--prefetch 0 1]
                                    [--dense-step-kb 8 16 32] [--shared-step-kb 8 16 32]
                                    [--gate-up-rows 32 16 8] [--down-rows 32 16 8]
                                    [--router-rows 8 4 2 1] [--latent-rows 8 4 2] [--shared-rows 8 4 2]
                                    [--poll-sleep-ns 0 200] [--expert-lookahead 0 1] [--prefetch-final 0 1]
                                    [--route-early 0 1] [--shared-late 0 1] [--expert-evict-first 0 1]
                                    [--oproj-rows 8 16 32 64] [--final-rows 8 16 32 64] [--expert-mma 0 1]
                                    [--skip-staged | --skip-mono]

``--ctas C`` plans C CTAs a SM, the build capped at the registers that keep them
resident (planner.resident_register_cap: 3 CTAs 168, 4 CTAs 128; uncapped the build
takes up to 255 and only 2 fit a SM, benchmarks/resource_check.py); ``--ctas C:R``
caps it at R registers a thread (maxnreg) instead.
``--poll-sleep-ns`` the pause of a waiting CTA between polls (MonoOptions.poll_sleep_ns);
``--expert-lookahead`` whether the expert loops load a step ahead (TileChoice.expert_lookahead);
``--prefetch-final`` whether PREFETCH_FINAL tasks pull FINAL's weights into L2 (MonoOptions.prefetch_final);
``--route-early`` whether the route's tasks come before SHARED_GU in the table (MonoOptions.route_early);
``--shared-late`` whether SHARED_GU comes after EXPERT_GU in the table (MonoOptions.shared_late);
``--expert-evict-first`` whether the expert tasks' weight loads are evict_first in L2 (MonoOptions.expert_evict_first);
``--oproj-rows`` / ``--final-rows`` the rows of an o_proj / FINAL task (TileChoice.oproj_rows, final_rows);
``--shared-step-kb`` the KB a shared gate/up task loads a step (TileChoice.shared_step_kb);
``--expert-mma`` the expert tasks on tensor cores (TileChoice.expert_mma: weights in mma order, each
distinct tensor once a runner, k3mono.mxfp4.ExpertOrderCache; the gate/up and down rows and the
lookahead then do not apply); ``--expert-f16`` the expert loops summing each group in f16
(TileChoice.expert_f16: weights in f16 order, converted the same way).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from k3mono.bench import WEIGHT_SETS, _loopback_layers, _time_staged, time_mono
from k3mono.config import preset
from k3mono.planner import (DENSE_STEP_KB, EXPERT_LOOKAHEAD, EXPERT_ROWS, HIDDEN_ROWS, LATENT_ROWS, ROUTER_ROWS,
                            SHARED_ROWS,
                            MonoOptions, TileChoice)
from k3mono.synthetic import random_shard


STAGES_SHOWN = ("attnres", "route", "latent_norm", "router", "expert_gate_up", "expert_down")
"""The staged stages a sweep line prints: the latency chain's and those the tiles size."""


def _staged_text(cfg, tp: int, tokens: int, sets: list, tiles: TileChoice) -> str:
    """The staged path at ``tiles``: the whole and STAGES_SHOWN (us)."""
    layers = _loopback_layers(cfg, tp, tokens, sets, tiles=tiles)
    whole, stages = _time_staged(layers)
    del layers
    shown = ", ".join(f"{k} {stages[k] * 1e6:.1f}" for k in STAGES_SHOWN)
    return f"{_tiles_text(tiles)}: {whole * 1e6:8.1f} us ({shown} us)"


def _tiles_text(tiles: TileChoice) -> str:
    return (f"dense step {tiles.dense_step_kb} KB gate/up rows {tiles.gate_up_rows} down rows {tiles.down_rows} "
            f"router rows {tiles.router_rows} latent rows {tiles.latent_rows} shared rows {tiles.shared_rows} lookahead {int(tiles.expert_lookahead)} "
            f"o_proj rows {tiles.oproj_rows} final rows {tiles.final_rows} shared step {tiles.shared_step_kb} KB "
            f"expert mma {int(tiles.expert_mma)} expert f16 {int(tiles.expert_f16)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ctas", nargs="+", default=["1", "2", "3", "4"], help="CTAs a SM[:register cap]")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--dense-step-kb", type=int, nargs="+", default=[DENSE_STEP_KB])
    parser.add_argument("--shared-step-kb", type=int, nargs="+", default=[DENSE_STEP_KB],
                        help="TileChoice.shared_step_kb")
    parser.add_argument("--gate-up-rows", type=int, nargs="+", default=[EXPERT_ROWS], help="TileChoice.gate_up_rows")
    parser.add_argument("--down-rows", type=int, nargs="+", default=[EXPERT_ROWS], help="TileChoice.down_rows")
    parser.add_argument("--router-rows", type=int, nargs="+", default=[ROUTER_ROWS])
    parser.add_argument("--latent-rows", type=int, nargs="+", default=[LATENT_ROWS], help="TileChoice.latent_rows")
    parser.add_argument("--shared-rows", type=int, nargs="+", default=[SHARED_ROWS], help="TileChoice.shared_rows")
    parser.add_argument("--poll-sleep-ns", type=int, nargs="+", default=[0], help="MonoOptions.poll_sleep_ns")
    parser.add_argument("--expert-lookahead", type=int, nargs="+", default=[int(EXPERT_LOOKAHEAD)],
                        help="TileChoice.expert_lookahead (0 / 1)")
    parser.add_argument("--prefetch-final", type=int, nargs="+", default=[0], help="MonoOptions.prefetch_final (0 / 1)")
    parser.add_argument("--route-early", type=int, nargs="+", default=[0], help="MonoOptions.route_early (0 / 1)")
    parser.add_argument("--shared-late", type=int, nargs="+", default=[0], help="MonoOptions.shared_late (0 / 1)")
    parser.add_argument("--expert-evict-first", type=int, nargs="+", default=[0],
                        help="MonoOptions.expert_evict_first (0 / 1)")
    parser.add_argument("--oproj-rows", type=int, nargs="+", default=[HIDDEN_ROWS], help="TileChoice.oproj_rows")
    parser.add_argument("--final-rows", type=int, nargs="+", default=[HIDDEN_ROWS], help="TileChoice.final_rows")
    parser.add_argument("--expert-mma", type=int, nargs="+", default=[0], help="TileChoice.expert_mma (0 / 1)")
    parser.add_argument("--expert-f16", type=int, nargs="+", default=[0], help="TileChoice.expert_f16 (0 / 1)")
    parser.add_argument("--skip-staged", action="store_true", help="time the mono launch only")
    parser.add_argument("--skip-mono", action="store_true", help="time the staged path only")
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    cfg = preset("kimi-k3")
    sets = [random_shard(cfg, args.tp, seed=s, device="cuda") for s in range(WEIGHT_SETS)]
    for tokens in args.tokens:
        choices = [TileChoice(dense_step_kb=k, gate_up_rows=g, down_rows=d, router_rows=r, latent_rows=lr,
                              shared_rows=sh, expert_lookahead=bool(la), oproj_rows=o, final_rows=f,
                              shared_step_kb=sk, expert_mma=bool(mma), expert_f16=bool(f16))
                   for k, g, d, r, lr, sh, la, o, f, sk, mma, f16 in itertools.product(
                       args.dense_step_kb, args.gate_up_rows, args.down_rows, args.router_rows, args.latent_rows,
                       args.shared_rows, args.expert_lookahead, args.oproj_rows, args.final_rows,
                       args.shared_step_kb, args.expert_mma, args.expert_f16)
                   if not (mma and f16)]
        for tiles in [] if args.skip_staged else choices:
            print(f"T={args.tp} S={tokens:>2} staged {_staged_text(cfg, args.tp, tokens, sets, tiles)}", flush=True)
        knobs = itertools.product(args.prefetch, args.prefetch_final, args.route_early, args.shared_late,
                                  args.expert_evict_first, args.poll_sleep_ns, args.ctas,
                                  [] if args.skip_mono else choices)
        for prefetch, prefetch_final, route_early, shared_late, evict_first, sleep_ns, config, tiles in knobs:
            ctas, _, cap = config.partition(":")
            label = (f"T={args.tp} S={tokens:>2} mono prefetch {prefetch} final {prefetch_final} route early "
                     f"{route_early} shared late {shared_late} evict first {evict_first} sleep {sleep_ns} ns "
                     f"ctas/SM {config} {_tiles_text(tiles)}")
            try:
                options = MonoOptions(ctas_per_sm=int(ctas), tiles=tiles, poll_sleep_ns=sleep_ns,
                                      prefetch_final=bool(prefetch_final), route_early=bool(route_early),
                                      shared_late=bool(shared_late), expert_evict_first=bool(evict_first))
                mono = time_mono(cfg, args.tp, tokens, sets, options=options, prefetch=prefetch,
                                 max_registers=int(cap) if cap else None)
                print(f"{label}: {mono * 1e6:8.1f} us", flush=True)
            except RuntimeError as error:
                print(f"{label}: FAIL {error}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
