"""M1c alone at other tiles (positions a step, steps in flight, warps) and split
counts: what the KV stream reaches against the copy bandwidth (issue 7's target:
80 % at 32 K). Each tile's o and lse are checked against the default tile's at
the same splits (the online softmax's other step boundaries round otherwise:
within MAX_REL_DIFF), so a tile that is fast and wrong cannot win; the default
tile's o against the float64 reference (within runner.BUDGET_FACTOR times the
bf16 reference's error), so the tiles are not all wrong alike. Exits non-zero if
either check fails anywhere.

    python benchmarks/m1c_tiles.py [--tokens 1 4 16] [--context 32768] [--kv fp8 bf16]
        [--block-n 32 64] [--stages 2 3 4] [--warps 4 8] [--max-registers 0 168] [--splits 99 132 | --first-splits]
        [--budget-s 240]

Splits: SPLITS_BY_TOKENS (about two and four programs an SM at S = 1, fewer
splits as S grows, as bench_mla.fused_splits does) unless --splits names them;
--first-splits: only the first of them (fused_splits' at 132 SMs, the MLA rows' own).
--max-registers: ptxas's caps a thread to try (0: the compiler's choice); 168
lets 3 programs of 4 warps share a SM (planner.resident_register_cap).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

SPLITS_BY_TOKENS = {1: (264, 528), 4: (66, 132), 16: (16, 33)}
MAX_REL_DIFF = 2e-2
"""Largest |o - o_default| / max |o_default| (and the same for the finite lse)
a tile may show: bf16 operands rounded at other step boundaries move o by
about 1e-3 of its scale."""


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    scale = b[finite].abs().max().clamp_min(1e-30)
    return float((a[finite] - b[finite]).abs().max() / scale)


def _default_tile_verdict(inputs, splits: int, o: torch.Tensor) -> tuple[bool, str]:
    """The default tile's o against the float64 reference: (within the error budget, a line to print)."""
    from k3mono.reference import mla as ref
    from k3mono.runner import error_and_budget

    args = (inputs.q, inputs.kv, inputs.qsl, inputs.seq_lens, inputs.pages, inputs.indptr, inputs.scale, splits)
    exact, _ = ref.mla_attn(*args, kv_scale=inputs.kv_scale, mode="oracle")
    want, _ = ref.mla_attn(*args, kv_scale=inputs.kv_scale, mode="bf16")
    err, budget = error_and_budget(o, want, exact)
    return err <= budget, f"o err {err:.2e} (budget {budget:.2e}) {'ok' if err <= budget else 'FAIL'}"


def main() -> int:
    from k3mono.bench_mla import attn_call, rotation
    from k3mono.mla import attn_tile
    from k3mono.timing import copy_bandwidth, time_graph

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--kv", nargs="+", default=["fp8"], choices=["fp8", "bf16"])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--max-registers", type=int, nargs="+", default=[0])
    parser.add_argument("--splits", type=int, nargs="+", help="split counts for every S (default SPLITS_BY_TOKENS)")
    parser.add_argument("--first-splits", action="store_true", help="only SPLITS_BY_TOKENS' first count a S")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    started, failures = time.time(), 0
    for kv, tokens in itertools.product(args.kv, args.tokens):
        sets = rotation(tokens, args.context, kv, device)
        print(f"{kv}: default tile {attn_tile(sets[0].kv)}", flush=True)
        cache_bytes = sets[0].cache_bytes
        split_counts = args.splits or SPLITS_BY_TOKENS.get(tokens, (16,))
        for splits in split_counts[:1] if args.first_splits else split_counts:
            default_call, o_ref, lse_ref = attn_call(sets[0], splits)
            o_ref.fill_(float("nan"))
            default_call()
            o_ref, lse_ref = o_ref.clone(), lse_ref.clone()
            within, line = _default_tile_verdict(sets[0], splits, o_ref)
            failures += not within
            print(f"{kv} S={tokens:>2} splits {splits:>3} default tile against the reference: {line}", flush=True)
            for block_n, stages, warps, cap in itertools.product(args.block_n, args.stages, args.warps,
                                                                 args.max_registers):
                if time.time() - started > args.budget_s:
                    print("budget spent: stopping", flush=True)
                    return 1 if failures else 0
                tile = dict(block_n=block_n, stages=stages, warps=warps, max_registers=cap or None)
                label = (f"{kv} ctx {args.context} S={tokens:>2} splits {splits:>3} block_n {block_n} stages {stages} "
                         f"warps {warps} regs {cap or 'any'}")
                try:
                    calls = [attn_call(inputs, splits, tile) for inputs in sets]
                    first, o, lse = calls[0]
                    o.fill_(float("nan"))
                    first()
                    diff = max(_rel_diff(o, o_ref), _rel_diff(lse, lse_ref))
                    seconds = time_graph([call for call, _, _ in calls])
                except RuntimeError as error:  # a tile past the SM's shared memory or registers
                    print(f"{label}: FAIL {str(error).splitlines()[0]}", flush=True)
                    continue
                verdict = "ok" if diff <= MAX_REL_DIFF else f"WRONG (diff {diff:.1e})"
                failures += not diff <= MAX_REL_DIFF  # NaN counts
                print(f"{label}: {1e6 * seconds:7.1f} us, {cache_bytes / seconds / bandwidth:4.0%} of copy, "
                      f"diff {diff:.1e} {verdict}", flush=True)
            torch.cuda.empty_cache()
        del sets
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
