"""MLA correctness at the released dims (one TP8 rank: 12 heads, DQK 576, DL 512,
DV 128), bf16 and fp8 caches, contexts of 1 K, 32 K and 128 K positions:

* staged M1c then M1b (k3mono.mla.mla_decode) against the float64 reference
  chain, within BUDGET_FACTOR times the bf16 reference's own error; then the
  two launches captured in a CUDA graph and replayed 3 times: the same bits;
* an MLA layer three ways (bench_mla.mla_fused_calls: M1c, M1b and the launch
  separately; M1b folded in; M1c and M1b folded in; rank 0 of TP8 in
  loopback; the separate M1c at the folded M1C tasks' tile, mla.folded_attn_tile),
  outputs poisoned first: the same bits, no NaN, no timeout; with ``--rounds``
  the three ways loaded and run again, each round the first round's bits.

    python benchmarks/gpu_check_mla.py [--tokens 1 4] [--contexts 1024 32768 131072] [--splits 0 16] [--rounds 3]
        [--set ctas_per_sm=2 ...] [--device cuda]

``--device cpu`` runs the same under the Triton interpreter (small contexts
only). ``--set``: fields of the three ways' mono defaults (mono.default_options_with).
Prints one line per case and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def staged_case(tokens: int, context: int, kv_dtype: str, device) -> bool:
    from k3mono import mla
    from k3mono.bench_mla import FOLD_SPLITS, make_inputs
    from k3mono.reference import mla as ref
    from k3mono.runner import error_and_budget

    x = make_inputs(tokens, context, kv_dtype, device, seed=context + tokens)
    args = (x.q, x.kv, x.qsl, x.seq_lens, x.pages, x.indptr, x.scale, x.w_v, x.gate)
    core = mla.mla_decode(*args, kv_scale=x.kv_scale, splits=FOLD_SPLITS)
    want = ref.mla_decode(*args, FOLD_SPLITS, kv_scale=x.kv_scale, mode="bf16")
    exact = ref.mla_decode(*args, FOLD_SPLITS, kv_scale=x.kv_scale, mode="oracle")
    err, budget = error_and_budget(core, want, exact)
    replays_same = True
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = mla.mla_decode(*args, kv_scale=x.kv_scale, splits=FOLD_SPLITS)
        for _ in range(3):
            replayed.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            replays_same &= torch.equal(replayed.view(torch.int16), core.view(torch.int16))
    ok = err <= budget and replays_same and bool(torch.isfinite(core.float()).all())
    print(f"staged M1c+M1b {kv_dtype:>4} ctx {context:>6} S={tokens:>2}: core err {err:.2e} (budget {budget:.2e}) "
          f"replays {'same' if replays_same else 'DIFFER'} {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def fused_case(cfg, shard, tokens: int, context: int, kv_dtype: str, splits: int | None, rounds: int = 1,
               fields: dict | None = None) -> bool:
    from k3mono.bench_mla import fused_splits, mla_fused_calls
    from k3mono.mono import device_sms

    splits = splits or fused_splits(tokens, device_sms(shard.o_proj.device))
    names = ("separate", "m1b", "m1c")
    runs, problem = {name: [] for name in names}, None
    for _ in range(rounds):
        # loaded afresh each round: a launch updates its copy of prefix in place (AttnRes), so a second
        # launch on the same loads is another computation
        calls = mla_fused_calls(cfg, shard.tp, tokens, context, kv_dtype, shard, layer=13, splits=splits,
                                folded_tile=True, fields=fields)
        for name, runner in zip(names, calls["runners"]):
            runner.poison()
            calls[name]()
            try:
                if shard.o_proj.device.type == "cuda":
                    torch.cuda.synchronize()
                runner.check_health()
            except RuntimeError as error:
                problem = problem or f"{name}: {error}"
            runs[name].append(runner.result(0).moe_out.clone())
    bits = {name: [o.view(torch.int16) for o in outs] for name, outs in runs.items()}
    outs = [runs[name][0] for name in names]
    same = all(torch.equal(bits[name][0], bits["separate"][0]) for name in names[1:])
    repeats = {name: all(torch.equal(b, bits[name][0]) for b in bits[name][1:]) for name in names}
    ok = problem is None and same and all(repeats.values()) and bool(torch.isfinite(outs[0].float()).all())
    scale = outs[0].float().abs().max().clamp_min(1e-30)
    apart = "" if same else " ".join(f"{name} {float((o.float() - outs[0].float()).abs().max() / scale):.1e}"
                                     for name, o in zip(names[1:], outs[1:]))
    repeat_note = "" if rounds == 1 else " rounds: " + ", ".join(
        f"{name} {'same' if repeats[name] else 'DIFFER'}" for name in names)
    print(f"MLA layer three ways {kv_dtype:>4} ctx {context:>6} S={tokens:>2} {splits:>3} splits: "
          f"{'same bits' if same else 'DIFFER (max |way - separate| / max |separate|: ' + apart + ')'}"
          f"{repeat_note} {problem or ''} {'ok' if ok else 'FAIL'}", flush=True)
    if not same:
        print("  where the last round's ways part: " + where_apart(calls), flush=True)
    return ok


def where_apart(calls) -> str:
    """The separate M1c's split outputs against the folded M1C tasks', then each way's core against the
    separate M1b's: the first stage whose bits differ is where the ways part."""
    from k3mono.mono import split_outputs

    plain, folded_b, folded_c = calls["runners"]
    folded_splits = split_outputs(folded_c.key, folded_c.rank_states[0].buffers.scratch)
    pairs = {"o": (calls["split_outputs"][0], folded_splits[0]), "lse": (calls["split_outputs"][1], folded_splits[1]),
             "core m1b": (plain.rank_states[0].core, folded_b.rank_states[0].core),
             "core m1c": (plain.rank_states[0].core, folded_c.rank_states[0].core)}
    return "; ".join(f"{name} {differing(a, b)}" for name, (a, b) in pairs.items())


def differing(want: torch.Tensor, got: torch.Tensor) -> str:
    """How many elements of got differ from want in bits, and the largest difference over want's largest."""
    shape = want.shape
    want, got = want.reshape(-1), got.reshape(-1).to(want.device)
    apart = want.view(torch.uint8).view(-1, want.element_size()).ne(
        got.view(torch.uint8).view(-1, got.element_size())).any(1)
    if not bool(apart.any()):
        return "same bits"
    gap = (want[apart].double() - got[apart].double()).abs().max()
    largest = want.double().abs().nan_to_num(posinf=0.0).max().clamp_min(1e-300)
    first = tuple(int(i) for i in torch.unravel_index(apart.nonzero()[0, 0], shape))
    return (f"{int(apart.sum())} of {want.numel()} differ (max gap / max |want| "
            f"{float(gap / largest):.1e}, first at {first})")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768, 131072])
    parser.add_argument("--kv", nargs="+", default=["fp8", "bf16"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--preset", default="kimi-k3")
    parser.add_argument("--splits", type=int, nargs="+", default=[0],
                        help="the three ways' M1c splits (0: bench_mla.fused_splits'; at most "
                             "planner.BACK_SHORT_SPLITS take M1b's short combine)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="each way's runs: every round the same bits as the first, too")
    parser.add_argument("--set", nargs="*", default=[], help="NAME=VALUE: fields of the three ways' mono defaults")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from k3mono.config import preset
    from k3mono.mono import parse_option_fields
    from k3mono.synthetic import random_shard

    device = torch.device(args.device)
    cfg = preset(args.preset)
    shard = random_shard(cfg, 8 if cfg.num_attention_heads % 8 == 0 else 2, seed=5, device=device)
    failures, started = 0, time.time()
    # context-major, the cache dtypes side by side: a bounded run covers both at the first contexts
    for context in args.contexts:
        for tokens in args.tokens:
            for kv_dtype in args.kv:
                failures += not staged_case(tokens, context, kv_dtype, device)
                for splits in args.splits:
                    failures += not fused_case(cfg, shard, tokens, context, kv_dtype, splits or None, args.rounds,
                                               parse_option_fields(args.set))
                print(f"  ({time.time() - started:.0f} s in)", flush=True)
    print(f"gpu_check_mla: {'all ok' if not failures else f'{failures} FAILED'} ({time.time() - started:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
