"""``python -m k3mono``: make-checkpoint, run, check, bench, plan, ranks.

Bad input (a K3InputError) prints one line, ``k3mono: error: ...``, and exits 2,
with no output file written.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from .config import PRESETS
from .errors import K3InputError
from .validate import check_tokens

CHECK_PRESET = "tiny"
CHECK_LAYERS = (1, 13)
"""Layer 1 sees one AttnRes block, layer 13 two: both sides of a block boundary."""
CHECK_TOKENS = (1, 3)
"""One token (decode) and an odd count (masking). S = 16, the most a launch takes, is in
the kernel tests; here it would triple the interpreter's time on a CPU-only machine."""
CHECK_TPS = (1, 4)
"""One rank, and four in loopback (three ranks' pushes pre-written, one MXFP4 group a
rank in the tiny preset); T = 2 runs in the staged, mono and ranks tests."""

PLAN_TILE_KNOBS = {
    "dense_step_kb": "KB of weight a dense GEMV task loads a step",
    "gate_up_rows": "output rows of an MXFP4 gate/up task",
    "down_rows": "output rows of an MXFP4 down task",
    "router_rows": "rows of a router task on the FMA path (S <= 4, or --x-token-groups)",
    "latent_rows": "rows of a latent down-projection task on the FMA path (S <= 4, or --x-token-groups)",
    "shared_rows": "rows of a shared-expert gate/up task on the FMA path, S <= 4",
    "oproj_rows": "rows of an o_proj task",
    "final_rows": "rows of a FINAL task",
    "x_group_tokens": "tokens a router / latent down group takes with --x-token-groups: 4 or 8",
    "x_k_parts": "S > 4 (tl.dot): parts of K a router / latent down row tile is cut into (1, 2, 4, 7 or 14)",
}
"""TileChoice fields ``plan`` takes as flags; each left out is the mono launch's
measured default for the S asked (mono.default_options), as are --ctas-per-sm and
--prefetch-final, so the table printed is the one ``run --impl mono`` launches."""

PLAN_OPTION_SWITCHES = {
    "final_split": "FINAL's shared down-projection before its own wait for the latent",
    "prefetch_shared": "L2-prefetch the shared gate/up weights right after the latent down tasks",
    "prefetch_final_early": "L2-prefetch FINAL's weights right after the latent down tasks, not after the experts",
    "x_token_groups": "S > 4: the router and latent down tasks on the FMA path by token groups (a TileChoice field)",
}
"""MonoOptions (and TileChoice) switches ``plan`` takes as --NAME / --no-NAME (left out:
the default, as above)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3mono", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the released layout")
    make.add_argument("dir", type=Path)
    make.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    make.add_argument("--layers", type=int, nargs="+", default=list(CHECK_LAYERS))
    make.add_argument("--seed", type=int, default=0)

    run = sub.add_parser("run", help="run layer_post of one layer on an inputs file")
    run.add_argument("--checkpoint", type=Path, required=True)
    run.add_argument("--layer", type=int, required=True)
    run.add_argument("--inputs", type=Path, required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--tp", type=int, default=1)
    run.add_argument("--impl", default="reference", help="reference, staged or mono")
    run.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")

    check = sub.add_parser("check", help="every available impl against the float64 oracle on a built-in default")
    check.add_argument("--device", default=None, choices=["cpu", "cuda"])
    check.add_argument("--keep", type=Path, default=None, help="write the checkpoint and inputs here, not in a temp dir")

    bench = sub.add_parser("bench", help="GPU: staged, each stage, unfused PyTorch and the floor, per S")
    bench.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    bench.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    bench.add_argument("--tp", type=int, nargs="*", default=[8, 1],
                       help="tables: 8 = one rank of TP8, 1 = whole layer; none (a bare --tp): only the MLA rows")
    bench.add_argument("--mla", action="store_true",
                       help="also the MLA rows (M1c, M1b; separate against folded in) per --tokens and --contexts")
    bench.add_argument("--kv", nargs="+", default=None, choices=["fp8", "bf16"],
                       help="MLA rows' cache dtypes (default both)")
    bench.add_argument("--contexts", type=int, nargs="+", default=None,
                       help="MLA rows' context lengths (default 1024 32768 131072)")

    plan = sub.add_parser("plan", help="print the mono launch's task table for one rank")
    plan.add_argument("--tokens", type=int, required=True, help="S, tokens of the launch")
    plan.add_argument("--tp", type=int, required=True, help="T, tensor-parallel ranks")
    plan.add_argument("--sms", type=int, required=True, help="SMs (CUs) of the device: 132 on an H200, 256 on an MI355X")
    plan.add_argument("--preset", default="kimi-k3", choices=sorted(PRESETS))
    plan.add_argument("--nblocks", type=int, default=None, help="AttnRes blocks for the floor (default: the deepest layer's)")
    plan.add_argument("--prefetch-final", action=argparse.BooleanOptionalAction, default=None,
                      help="L2-prefetch FINAL's weights after the experts")
    plan.add_argument("--ctas-per-sm", type=int, default=None, help="resident CTAs an SM is given")
    for name, what in PLAN_OPTION_SWITCHES.items():
        plan.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=None, help=what)
    for name, what in PLAN_TILE_KNOBS.items():
        plan.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=what)
    plan.add_argument("--m1b-splits", type=int, default=None,
                      help="an MLA layer's table: M1b (combining this many M1c splits) runs first in the launch")
    ranks = sub.add_parser("ranks", help="T ranks of the mono launch exchanging for real, checked and timed")
    ranks.add_argument("--tp", type=int, required=True, help="T, ranks (processes, or green contexts)")
    ranks.add_argument("--tokens", type=int, default=1, help="S, tokens of the launch")
    ranks.add_argument("--replays", type=int, default=None, help="CUDA-graph replays (GPU; default 100 there, 0 on the CPU)")
    ranks.add_argument("--input-sets", type=int, default=2, help="fresh inputs run eagerly, cycled over the replays")
    ranks.add_argument("--checkpoint", type=Path, default=None, help="default: seeded random weights of --preset")
    ranks.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default: kimi-k3 on a GPU, tiny on the CPU")
    ranks.add_argument("--layer", type=int, default=13)
    ranks.add_argument("--other-layers", type=int, nargs="*", default=[],
                       help="procs: these layers too, on the same buffers, the input sets in turn over the layers")
    ranks.add_argument("--mode", default="procs", choices=["procs", "green", "streams"],
                       help="procs: a process a rank (symmetric memory); green: green contexts of one GPU; "
                       "streams: plain streams of one GPU")
    ranks.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")
    ranks.add_argument("--absent", type=int, default=None, help="fault test: this rank never launches")
    ranks.add_argument("--out", type=Path, default=None, help="write the per-rank results as JSON in this folder")
    ranks.add_argument("--unfused", action="store_true",
                       help="also time the unfused path with NCCL all-reduces (procs mode, one GPU a rank)")
    return parser


def cmd_ranks(args) -> int:
    from .rankjob import RANKS_HEADER, RanksJob, run_ranks, write_json
    from .runner import default_device, prepare_device

    device = prepare_device(args.device or default_device()).type
    check_tokens(args.tokens)
    job = RanksJob(
        tp=args.tp, tokens=args.tokens, layer=args.layer, input_sets=args.input_sets,
        replays=args.replays if args.replays is not None else (100 if device == "cuda" else 0),
        preset=args.preset or ("kimi-k3" if device == "cuda" else "tiny"),
        checkpoint=str(args.checkpoint) if args.checkpoint else None, device=device, mode=args.mode,
        absent=args.absent, unfused=args.unfused, other_layers=tuple(args.other_layers),
    )
    job.config().validate_tp(job.tp)
    print(
        f"ranks: T={job.tp} S={job.tokens} layer{'s' if job.other_layers else ''} "
        f"{' '.join(map(str, job.layers))} mode {job.mode} device {device} "
        f"weights {job.checkpoint or 'random ' + job.preset} input sets {job.input_sets} replays {job.replays}"
        + (f" absent rank {job.absent}" if job.absent is not None else ""),
        flush=True,
    )
    reports, verdict, seconds = run_ranks(job)
    if job.absent is None:
        print(RANKS_HEADER)
    print("\n".join(verdict.lines))
    if job.absent is None:
        print(f"ranks: {'all ok' if verdict.ok else 'FAILED'} ({seconds:.0f} s)")
    else:
        print(f"ranks: {'every other rank stopped naming' if verdict.ok else 'FAILED to name'} the absent rank ({seconds:.0f} s)")
    if args.out is not None:
        print(f"wrote {write_json(job, reports, verdict, seconds, args.out)}")
    return 0 if verdict.ok else 1


def cmd_make_checkpoint(args) -> int:
    from .synthetic import make_checkpoint

    cfg = make_checkpoint(args.dir, args.preset, tuple(args.layers), args.seed)
    print(f"wrote {args.dir}: preset {args.preset}, layers {args.layers}, H={cfg.hidden_size}, E={cfg.num_experts}")
    return 0


def cmd_run(args) -> int:
    from .checkpoint import load_layer
    from .iofiles import read_inputs, write_outputs
    from .runner import IMPLS, default_device, prepare_device, run_layer

    if args.impl not in IMPLS:
        raise K3InputError(f"impl: expected one of {list(IMPLS)}, got {args.impl!r}")
    device = prepare_device(args.device or default_device())
    cfg, weights = load_layer(args.checkpoint, args.layer)
    cfg.validate_tp(args.tp)
    inputs = read_inputs(args.inputs, cfg, args.layer)
    outputs = run_layer(args.impl, cfg, weights, inputs, args.layer, args.tp, device)
    write_outputs(args.out, **outputs)
    print(f"wrote {args.out}: impl {args.impl}, T={args.tp}, S={inputs['core'].shape[0]}, layer {args.layer}")
    return 0


def cmd_check(args) -> int:
    from .runner import default_device, prepare_device

    device = prepare_device(args.device or default_device())
    if args.keep is not None:
        return _check_in(args.keep, device)
    with tempfile.TemporaryDirectory(prefix="k3mono-check-") as folder:
        return _check_in(Path(folder), device)


def _check_in(folder: Path, device) -> int:
    from .checkpoint import load_layer
    from .iofiles import read_inputs, write_inputs, write_outputs
    from .runner import Oracle, available_impls, run_layer
    from .synthetic import make_checkpoint, random_inputs
    from safetensors.torch import load_file

    folder.mkdir(parents=True, exist_ok=True)
    ckpt = folder / "checkpoint"
    cfg = make_checkpoint(ckpt, CHECK_PRESET, CHECK_LAYERS, seed=0)
    impls = available_impls()
    print(f"check: preset {CHECK_PRESET} in {folder}, device {device}, impls {', '.join(impls)}")
    header = f"{'impl':<10} {'T':>2} {'S':>3} {'layer':>5} {'moe err':>9} {'budget':>9} {'prefix err':>10} {'budget':>9}  routes     ok"
    print(header)
    failures = 0
    for layer in CHECK_LAYERS:
        cfg, weights = load_layer(ckpt, layer)
        for tokens in CHECK_TOKENS:
            inputs_path = folder / f"inputs-L{layer}-S{tokens}.safetensors"
            write_inputs(inputs_path, random_inputs(cfg, tokens, layer, seed=100 * layer + tokens))
            inputs = read_inputs(inputs_path, cfg, layer)
            oracle = Oracle(cfg, weights, inputs, layer)
            for impl in impls:
                for tp in CHECK_TPS:
                    out_path = folder / f"out-{impl}-T{tp}-L{layer}-S{tokens}.safetensors"
                    write_outputs(out_path, **run_layer(impl, cfg, weights, inputs, layer, tp, device))
                    verdict = oracle.judge(load_file(str(out_path)))
                    failures += not verdict.ok
                    print(
                        f"{impl:<10} {tp:>2} {tokens:>3} {layer:>5} {verdict.moe_err:>9.2e} {verdict.moe_budget:>9.2e} "
                        f"{verdict.prefix_err:>10.2e} {verdict.prefix_budget:>9.2e}  "
                        f"{verdict.routes_text:<9}  {'ok' if verdict.ok else 'FAIL'}"
                    )
    print("check: all within budget" if not failures else f"check: {failures} over budget or with different routes")
    return 1 if failures else 0


MB = 1e6


def cmd_bench(args) -> int:
    from .bench import TABLES, run_bench

    for tokens in args.tokens:
        check_tokens(tokens)
    titles = dict(TABLES)
    for tp in args.tp:
        if tp not in titles:
            raise K3InputError(f"bench --tp: expected one of {sorted(titles)}, got {tp}")
    if not args.tp and not args.mla:
        raise K3InputError("bench: nothing to run (no --tp table and no --mla)")
    for option, value in (("--contexts", args.contexts), ("--kv", args.kv)):
        if value is not None and not args.mla:
            raise K3InputError(f"bench {option}: only the MLA rows (--mla) take it")
    run_bench(args.out, tuple(args.tokens), tuple((tp, titles[tp]) for tp in args.tp), mla=args.mla,
              contexts=args.contexts, kv_dtypes=args.kv)
    return 0


def cmd_plan(args) -> int:
    from .config import preset
    from .floor import floor_bytes
    from .mono import default_options_with
    from .planner import M1bShape, plan
    from .reference.mla import LATENT_DIM

    cfg = preset(args.preset)
    m1b = M1bShape(splits=args.m1b_splits, latent=LATENT_DIM) if args.m1b_splits is not None else None
    names = (*PLAN_TILE_KNOBS, *PLAN_OPTION_SWITCHES, "prefetch_final", "ctas_per_sm")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    options = dataclasses.replace(default_options_with(args.tokens, given), m1b=m1b)
    table = plan(cfg, args.tp, args.tokens, args.sms, options)
    floor = floor_bytes(cfg, args.tp, args.tokens, args.tokens * cfg.num_experts_per_token, nblocks=args.nblocks,
                        m1b=m1b)
    print(
        f"plan: preset {args.preset}, T={args.tp}, S={args.tokens}, {args.sms} SMs, "
        f"options {table.options} (bits {table.options.bits():#x}); one rank's table, the same on every rank"
    )
    print(f"{'tickets':<13} {'kind':<14} {'tasks':>6}  {'indices':<36} {'MB':>8}  {'waits a task':<44} raises")
    for group in table.groups():
        for part in _by_signature(group):
            print(_plan_group_line(part))
    summary = table.summary()
    print(
        f"summary: {summary.tasks} tasks, {summary.ctas} CTAs, {summary.weight_bytes / MB:.3f} MB weights streamed, "
        f"{summary.waits} waits, {table.num_flag_words} flag words"
    )
    print(
        f"floor:   {floor['weight_bytes'] / MB:.3f} MB weights (S*K = {args.tokens * cfg.num_experts_per_token} experts) "
        f"+ {floor['activation_bytes'] / MB:.3f} MB activations = {floor['total'] / MB:.3f} MB"
    )
    return 0


def _span_text(values, name: str) -> str:
    lo, hi = min(values), max(values)
    return f"{name} {lo}" if lo == hi else f"{name} {lo}..{hi}"


def _by_signature(group) -> list:
    """The group's tasks split by which flags they wait for and raise (a split
    router tile's last part waits and raises other flags than its earlier
    parts), each kept in ticket order: a line each."""
    from .planner import TaskGroup

    runs: dict = {}
    for task in group.tasks:
        signature = (tuple((w.flag, w.before_loads, w.in_task) for w in task.waits), tuple(r.flag for r in task.raises))
        runs.setdefault(signature, []).append(task)
    return [TaskGroup(group.kind, tuple(tasks)) for tasks in runs.values()]


def _plan_group_line(group) -> str:
    tasks = group.tasks
    indices = []
    if tasks[0].token >= 0:
        indices.append(_span_text([t.token for t in tasks], "tok"))
    if tasks[0].slot >= 0:
        indices.append(_span_text([t.slot for t in tasks], "slot"))
    if tasks[0].tile >= 0:
        indices.append(f"[{min(t.span[0] for t in tasks)}:{max(t.span[1] for t in tasks)}) by {tasks[0].span[1] - tasks[0].span[0]}")
    waits = ", ".join(
        f"{w.flag.name}[{_span_text([t.waits[i].index for t in tasks], '').strip()}]"
        f">={_span_text([t.waits[i].count for t in tasks], '').strip()}"
        + ("(addr)" if w.before_loads else "") + ("(in task)" if w.in_task else "")
        for i, w in enumerate(tasks[0].waits)
    )
    raises = ", ".join(
        f"{r.flag.name}[{_span_text([t.raises[i].index for t in tasks], '').strip()}]" + (" every rank" if r.every_rank else "")
        for i, r in enumerate(tasks[0].raises)
    )
    tickets = f"{tasks[0].ticket}-{tasks[-1].ticket}"
    mb = sum(t.weight_bytes for t in tasks) / MB
    return (
        f"{tickets:<13} {group.kind.name:<14} {len(tasks):>6}  {' '.join(indices):<36} {mb:>8.3f}  "
        f"{waits or '-':<44} {raises or '-'}"
    )


COMMANDS = {
    "bench": cmd_bench, "make-checkpoint": cmd_make_checkpoint, "run": cmd_run, "check": cmd_check, "plan": cmd_plan,
    "ranks": cmd_ranks,
}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except K3InputError as err:
        print(f"k3mono: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
