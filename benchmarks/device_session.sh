#!/usr/bin/env bash
# Everything the H200 has to check and time, in one call and in order of need,
# each step bounded so a slow one cannot starve the rest. Writes logs and JSON
# under $OUT (results/ holds the JSON for benchmarks/results/).
#
#   K3MONO_COMMIT=<hash> bash benchmarks/device_session.sh [steps...]
#
# Steps (default: all one-GPU steps, in this order): check ranks mla_check bench variants mla sweep
# (ranks ends with faults, the fault tests alone; ranks_t8 its first case, briefly); m1b: M1b alone and folded, briefly
# (the sweep is where a new knob is decided: put it first when one is pending); profile:
# Nsight Compute's counters of the staged stages and the mono launch (S = 1, 8); stalls: all
# counters of the expert stages and the mono launch (S = 1); tiles: the gate/up and down task rows (mono);
# trace: where the mono launch's time goes, per task kind, from a trace build (S = 1, 8); trace_double: the
# same at S = 1 with the route and latent norm run twice in a row;
# defaults: the mono defaults against their alternatives; sleep: the trace at three pauses between polls;
# loops: the expert stages' loops at other pipeline depths and unroll factors (staged);
# check_staged: the staged path's check alone; check_lookahead: the mono check with expert loops loading a
# step ahead; lookahead: those loops timed (mono at 2 and 3 CTAs a SM, staged); final: router rows and the
# FINAL prefetch (S = 1), the prefetch (S = 8); trace_m1b: the S = 1 trace with M1b folded in (prefetch 0 and 1)
# beside the plain one; rows: the o_proj and FINAL task rows (mono, S = 1 and 8); rows64: 32 and 64 of them (mono)
# and the staged path's; m1b_double: the M1b-folded launch with its M1B and OPROJ tasks run twice; m1b_rows: that
# launch's trace at 16, 32 and 64 value rows an M1B task; m1c_tiles: M1c alone at other tiles and splits (32 K);
# m1c_halves: M1c's latent halves at several tiles, fp8 and bf16; mla_bench_fp8: the MLA layer rows, fp8 at
# 32 K; m1c_profile: M1c's counters (S = 4); bulk: the bulk L2 prefetch modes (mono); ctas3: S = 1 at 3 CTAs a SM;
# shared: the shared gate/up task rows; route: the route's tasks before the shared ones;
# final_bulk: PREFETCH_FINAL tasks with the bulk prefetch; shared_late: SHARED_GU after EXPERT_GU;
# tiles_check: down rows 32 / 16 at S = 1, 2; mla_check_one: one MLA case; expert_f16: the expert loops summing
# in f16 timed (staged stages, mono off / on) and checked; ctas_f16: 3 and 4 CTAs a SM with f16 sums (mono);
# lookahead_many: the expert lookahead at 3 CTAs a SM (S = 16); trace16: the S = 16 trace beside the staged stages;
# x_groups: the router and latent down by groups of tokens, timed and checked; final_split: FINAL's shared part
# before its wait for the latent and the shared weights prefetched early, timed (final_split_check: checked, and
# the S = 1 trace); options_ab / options_check: the timing / checking halves of x_groups and final_split,
# one call each; parts_check: the two-step latent norm at S = 16 and grid 1; rows_s1: the router and latent rows
# at S = 1; x_groups8: the router and latent down by groups of 8 tokens checked and timed; latent_parts: the two-step latent norm checked, FINAL's prefetch early and 3 CTAs a SM at
# S = 1 timed, the traces; expert_mma: the expert
# stages on tensor cores checked and timed (staged), the mono launch with them checked; expert_mma_sweep: it timed;
# norm_scale: the latent norm's scale in FINAL checked, timed against the tree in $K3MONO_BASE, traced; router_rms:
# the S = 1 router forming x from h, the same; x_parts: the router and latent down by parts of K timed, traced, checked;
# x_parts_default: with parts the default, the route early and 2 parts timed, the traces, the check;
# expert_prefetch: the expert tasks' rows asked for at once, timed, the S = 8 trace; down_step: 16 KB down steps timed;
# wide_check: the wide down tasks checked and traced at their defaults; m1b_prefetch: o_proj's rows asked for
# before M1b's core, traced and timed against the plain launch; oproj_step: o_proj's K step timed (with M1b
# folded in and not) and traced; l2_reads: the dense tile from L2 against HBM, o_proj's step at S = 2, 4, the S = 1
# checks; oproj_check: the o_proj step's defaults checked at S = 4, 8, and the MLA layer at S = 1; prefetch_mask: the
# always-prefetched kinds' mask checked with all three on; m1b_tasks: M1b checked, timed against $K3MONO_BASES' trees and
# traced; m1b_short_tiles: M1b alone at other short-combine tiles; m1c_convert: M1c's trimmed step checked and timed
# against $K3MONO_BASE's tree; m1c_tile64: M1c's fp8 tile of 64 positions at 2 stages checked, tiles, the MLA rows
# against $K3MONO_BASE's tree; mla_layers: the MLA layer three ways here and in $K3MONO_BASE's tree; mla_fold_tile:
# the fold at its own tile checked and the layer three ways timed; m1c_deep: M1c alone at 5 and 7 pipeline stages;
# m1c_stages: M1c with page ids a step ahead at 2 to 4 stages against $K3MONO_BASE's tree, then checked;
# m1c_fold_apart: where the fp8 MLA layer's folded way parts from the separate launches;
# m1c_fold_bisect: the same at 4096 positions in each tree of $K3MONO_TREES (cf75fd7 against cf9e37c);
# m1b_sleep: the M1b fold with pausing pollers; m1c_fold_ctas: the M1c fold at 2 CTAs a SM against 3 (S = 16);
# m1c_fold_stages: the M1c fold at 3 stages checked and timed; route_scores: the route parts' scores beside
# their keys, checked, timed against $K3MONO_BASE's tree, the S = 1 trace;
# on a machine of several GPUs also: gpus (ranks across them, against the NCCL unfused path).
# K3MONO_BUDGET_S (default 560) bounds the whole session below the device's 600 s a call,
# so the logs are always packed into $OUT/session.tar.gz (the device returns 8 files at most).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/k3mono-out}"
RESULTS="$OUT/results"
mkdir -p "$RESULTS"
STEPS="${*:-check ranks mla_check bench variants mla sweep}"
BUDGET_S="${K3MONO_BUDGET_S:-560}"
# The MLA steps' cases (a call rarely has time for all): contexts, cache dtypes, bench tokens.
MLA_CONTEXTS="${MLA_CONTEXTS:-32768 1024 131072}" MLA_KV="${MLA_KV:-fp8 bf16}" MLA_TOKENS="${MLA_TOKENS:-1 4 16}"
# The mono check's token counts (issue 4 asks for these; each adds 15 to 30 s).
CHECK_TOKENS="${CHECK_TOKENS:-1 2 4 8 16}"
BENCH_TOKENS="${BENCH_TOKENS:-1 8 16}"  # the bench table's token counts (each about 25 s)
VARIANT_TOKENS="${VARIANT_TOKENS:-1 8}"  # the variants table's token counts (each about 100 s)
# The mono sweeps' common part (mono launch only, o_proj and FINAL tasks of 32 rows).
MONO_SWEEP="python3 benchmarks/mono_sweep.py --skip-staged --oproj-rows 32 --final-rows 32"
NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"

step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.txt, print its tail
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS left=$((BUDGET_S - SECONDS))
    if ((left < 20)); then
        echo "== $name: skipped, session budget spent"
        return
    fi
    ((limit > left)) && limit=$left
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "== $name: rc $rc, $((SECONDS - started)) s" | tee -a "$OUT/$name.txt"
    tail -n 12 "$OUT/$name.txt"
}

against_base() {  # against_base NAME TOKENS...: the mono defaults here and in $K3MONO_BASE's tree, alternating, twice
    local name=$1 base=${K3MONO_BASE:?the tree to time against}
    shift
    for round in 1 2; do
        step "${name}_base_$round" 110 bash -c "cd '$base' && PYTHONPATH=\$PWD python3 benchmarks/defaults_ab.py \
            --field poll_sleep_ns --values 0 --tokens $* --rounds 1"
        step "${name}_new_$round" 110 python3 benchmarks/defaults_ab.py --field poll_sleep_ns --values 0 --tokens "$@" \
            --rounds 1
    done
}

faults() {  # one rank never launches: every other one must stop naming it
    step ranks_fault 60 python3 -m k3mono ranks --tp 8 --tokens 1 --mode green --input-sets 1 --absent 3 --out "$RESULTS"
    step ranks_procs_fault 90 python3 -m k3mono ranks --tp 4 --tokens 1 --mode procs --preset small --input-sets 1 --absent 2 --out "$RESULTS"
}

nvidia-smi -L
for s in $STEPS; do
    case $s in
    check)  # T = 1, then loopback T = 8, each with its own limit (together they passed 300 s at five S)
        step gpu_check_t1 240 python3 benchmarks/gpu_check.py --skip-staged --tp 1 --tokens $CHECK_TOKENS
        step gpu_check_t8 300 python3 benchmarks/gpu_check.py --skip-staged --tp 8 --tokens $CHECK_TOKENS ;;
    check_staged)  # the staged path alone (no grids, no co-occupying kernel)
        step gpu_check_staged 200 python3 benchmarks/gpu_check.py --skip-mono --tokens $CHECK_TOKENS --grids --occupy-sms 0 ;;
    check_lookahead)  # the mono launch with expert loops that load a step ahead
        step gpu_check_lookahead 200 python3 benchmarks/gpu_check.py --skip-staged --tokens $CHECK_TOKENS \
            --expert-lookahead 1 --grids 132 1 --occupy-sms 0 ;;
    final)  # S = 1: router rows 8 / 2 x FINAL's weights prefetched or not; S = 8: the prefetch (lookahead on)
        step mono_final_s1 200 python3 benchmarks/mono_sweep.py --tokens 1 --ctas 2 --prefetch 0 --expert-lookahead 1 \
            --router-rows 8 2 --prefetch-final 0 1
        step mono_final_s8 120 python3 benchmarks/mono_sweep.py --tokens 8 --ctas 2 --prefetch 0 --expert-lookahead 1 \
            --prefetch-final 0 1 ;;
    lookahead)  # expert loops loading a step ahead, at 2 and 3 CTAs a SM (mono) and staged
        step mono_lookahead 300 python3 benchmarks/mono_sweep.py --tokens 1 8 --ctas 2 3:168 --prefetch 0 \
            --expert-lookahead 0 1 ;;
    mla_check)
        step gpu_check_mla 300 python3 benchmarks/gpu_check_mla.py --tokens 1 4 --contexts $MLA_CONTEXTS --kv $MLA_KV ;;
    ranks)
        step ranks_green_t8 150 python3 -m k3mono ranks --tp 8 --tokens 1 --mode green --replays 100 --out "$RESULTS"
        step ranks_green_t8_s16 120 python3 -m k3mono ranks --tp 8 --tokens 16 --mode green --replays 100 --out "$RESULTS"
        for T in 2 4; do
            step "ranks_green_t$T" 90 python3 -m k3mono ranks --tp "$T" --tokens 1 --mode green --replays 100 --out "$RESULTS"
        done
        step ranks_streams_t8 90 python3 -m k3mono ranks --tp 8 --tokens 1 --mode streams --replays 100 --out "$RESULTS"
        for T in 2 4 8; do  # the small preset: tiny's 4 heads do not split 8 ways
            step "ranks_procs_t$T" 120 python3 -m k3mono ranks --tp "$T" --tokens 3 --mode procs --preset small --replays 100 --out "$RESULTS"
        done
        step ranks_procs_layers 120 python3 -m k3mono ranks --tp 2 --tokens 3 --mode procs --preset small --replays 20 \
            --other-layers 92 --out "$RESULTS"
        faults ;;
    faults)
        faults ;;
    ranks_t8)  # the full-peer path alone, briefly: T = 8 ranks at once on green contexts, S = 1
        step ranks_green_t8 150 python3 -m k3mono ranks --tp 8 --tokens 1 --mode green --replays 20 --out "$RESULTS" ;;
    bench)
        step bench 420 python3 -m k3mono bench --tp 8 --tokens $BENCH_TOKENS --out "$RESULTS" ;;
    variants)
        step mono_variants 420 python3 benchmarks/mono_variants.py --tokens $VARIANT_TOKENS ;;
    mla)
        step bench_mla 500 python3 -m k3mono bench --tp --tokens $MLA_TOKENS --mla --contexts $MLA_CONTEXTS --kv $MLA_KV \
            --out "$RESULTS" ;;
    sweep)
        step mono_sweep 240 python3 benchmarks/mono_sweep.py --ctas 2 3:168 --prefetch 0 --gate-up-rows 32 16 --down-rows 32 16 8
        step mono_sweep_router 120 python3 benchmarks/mono_sweep.py --tokens 1 --ctas 2 --prefetch 0 --router-rows 8 4 2 ;;
    trace)  # every ticket's SM and times, per task kind (a trace build), S = 1 and 8
        step mono_trace 200 python3 benchmarks/mono_trace.py --tokens 1 8 --out "$RESULTS" ;;
    trace16)  # S = 16, where the staged path beats the mono launch: the trace, and the staged stages beside it
        step mono_trace_s16 150 python3 benchmarks/mono_trace.py --tokens 16 --out "$RESULTS"
        step bench_s16 150 python3 -m k3mono bench --tp 8 --tokens 16 --out "$RESULTS" ;;
    trace_m1b)  # S = 1: the launch with M1b folded in (prefetch 0 and 1) beside the plain launch's trace
        step mono_trace_plain 100 python3 benchmarks/mono_trace.py --tokens 1 --out "$RESULTS"
        step mono_trace_m1b 150 python3 benchmarks/mono_trace.py --tokens 1 --m1b --prefetch 0 1 --out "$RESULTS" ;;
    rows)  # o_proj and FINAL task rows (TileChoice.oproj_rows, final_rows), mono only, S = 1 and 8
        step mono_rows_s1 200 python3 benchmarks/mono_sweep.py --tokens 1 --ctas 2 --prefetch 0 --expert-lookahead 1 \
            --oproj-rows 8 16 32 --final-rows 8 16 32 --skip-staged
        step mono_rows_s8 120 python3 benchmarks/mono_sweep.py --tokens 8 --ctas 2 --prefetch 0 --expert-lookahead 1 \
            --oproj-rows 16 32 --final-rows 16 32 --skip-staged ;;
    rows64)  # o_proj and FINAL task rows 32 and 64 (mono), the staged path at 8 and 32, S = 1 and 8
        step mono_rows64 200 python3 benchmarks/mono_sweep.py --tokens 1 8 --ctas 2 --prefetch 0 --expert-lookahead 1 \
            --oproj-rows 32 64 --final-rows 32 64 --skip-staged
        step staged_rows 120 python3 benchmarks/mono_sweep.py --tokens 1 8 --oproj-rows 8 32 --final-rows 8 32 \
            --skip-mono ;;
    m1b_prefetch)  # M1b folded in: OPROJ asking for its w_o rows before its wait for the core (prefetch_oproj),
        # the S = 1 traces off / on, then the fold against the plain launch at S = 1 and 16, off / on
        step trace_m1b_po0 120 python3 benchmarks/mono_trace.py --tokens 1 --m1b --out "$RESULTS"
        step trace_m1b_po1 120 python3 benchmarks/mono_trace.py --tokens 1 --m1b --set prefetch_oproj=1 --out "$RESULTS"
        step m1b_prefetch_ab 280 python3 benchmarks/defaults_ab.py --m1b --field prefetch_oproj --values 0 1 \
            --tokens 1 16 --rounds 2 ;;
    oproj_step)  # o_proj tasks' K step (TileChoice.oproj_step_kb): the M1b fold with and without prefetch_oproj (S = 1),
        # the plain launch (S = 1, 8, 16), then the S = 1 fold's trace at 32 KB with prefetch_oproj
        step oproj_step_m1b_po1 120 python3 benchmarks/defaults_ab.py --m1b --field oproj_step_kb --values 8 16 32 \
            --tokens 1 --also prefetch_oproj=1
        step oproj_step_m1b_po0 100 python3 benchmarks/defaults_ab.py --m1b --field oproj_step_kb --values 16 32 \
            --tokens 1
        step oproj_step_plain 200 python3 benchmarks/defaults_ab.py --field oproj_step_kb --values 8 16 32 \
            --tokens 1 8 16
        step trace_m1b_step32 100 python3 benchmarks/mono_trace.py --tokens 1 --m1b \
            --set prefetch_oproj=1 oproj_step_kb=32 --out "$RESULTS" ;;
    l2_reads)  # the staged o_proj tile reading w_o from L2 against HBM; o_proj's 16 KB step at S = 2 and 4; the S = 1
        # defaults checked (T = 8 loopback and T = 1; grids of 132 and 1 CTAs, beside a kernel on 66 SMs), and the fold
        step l2_reads 60 python3 benchmarks/l2_reads.py
        step oproj_step_s24 120 python3 benchmarks/defaults_ab.py --field oproj_step_kb --values 8 16 --tokens 2 4
        step check_s1 150 python3 benchmarks/gpu_check.py --skip-staged --tp 8 1 --tokens 1 --grids 132 1 --occupy-sms 66
        step mla_check_s1 150 python3 benchmarks/gpu_check_mla.py --tokens 1 --contexts 32768 --kv fp8 ;;
    oproj_check)  # the 16 KB o_proj step's defaults (S <= 8) checked at S = 4 and 8 (T = 8 loopback and T = 1, grids of 132
        # and 1 CTAs, beside a kernel on 66 SMs), then the MLA layer at S = 1 (fp8, 32 K: staged and both folds)
        step check_s48 210 python3 benchmarks/gpu_check.py --skip-staged --tp 8 1 --tokens 4 8 --grids 132 1 --occupy-sms 66
        step mla_check_s1 240 python3 benchmarks/gpu_check_mla.py --tokens 1 --contexts 32768 --kv fp8 ;;
    m1b_tasks)  # M1b checked (staged; the three ways at 264 and 16 splits; S = 1 and 16), then alone and folded
        # against the plain launch here and in each of $K3MONO_BASES' trees, and the S = 1 fold traced
        step m1b_check 240 python3 benchmarks/gpu_check_mla.py --tokens 1 16 --contexts 4096 --kv fp8 --splits 0 16
        step m1b_timing_new 100 python3 benchmarks/m1b_timing.py --tokens 1 16 --splits 16 264 --fold-tokens 1 16
        n=0
        for tree in ${K3MONO_BASES:?the trees to time against}; do
            n=$((n + 1))
            step "m1b_timing_base$n" 150 bash -c "cd '$tree' && PYTHONPATH=\$PWD python3 benchmarks/m1b_timing.py \
                --tokens 1 16 --splits 16 264 --fold-tokens 1 16"
        done
        step m1b_trace 60 python3 benchmarks/mono_trace.py --tokens 1 --m1b --out "$RESULTS" ;;
    m1b_short_tiles)  # M1b alone at other short-combine tiles (latent columns a step x steps in flight; 128x5 and
        # 256x3 put every step in flight before the lse wait, offline), S = 1 and 16, 16 splits
        step m1b_short_tiles 150 python3 benchmarks/m1b_timing.py --tokens 1 16 --splits 16 --fold-tokens \
            --short-tiles 128x4 128x5 256x2 256x3 64x5 ;;
    m1c_convert)  # M1c's e4m3 pairs converted two at a time (one PRMT for four values), a step's two page ids
        # loaded as scalars, the rope columns in halves: checked (fp8, S = 1 and 4), timed at the default tile here
        # and in $K3MONO_BASE's tree, then 64 positions a step at 2 stages and a 168-register cap here
        step m1c_convert_check 200 python3 benchmarks/gpu_check_mla.py --tokens 1 4 --contexts 4096 --kv fp8
        for round in 1 2; do
            step "m1c_convert_base_$round" 90 bash -c "cd '${K3MONO_BASE:?the tree to time against}' && \
                PYTHONPATH=\$PWD python3 benchmarks/m1c_tiles.py --tokens 1 4 16 --kv fp8 bf16 --block-n 32 --stages 3 \
                --warps 4"
            step "m1c_convert_new_$round" 90 python3 benchmarks/m1c_tiles.py --tokens 1 4 16 --kv fp8 bf16 --block-n 32 \
                --stages 3 --warps 4
        done
        step m1c_convert_tiles 90 python3 benchmarks/m1c_tiles.py --tokens 4 16 --block-n 64 32 --stages 2 --warps 4 \
            --max-registers 0 168 ;;
    m1c_tile64)  # M1c over an fp8 cache 64 positions a step at 2 stages (planner.attn_steps): checked (fp8 S = 16,
        # bf16 S = 1; staged, and the three ways the same bits), the tiles at S = 1, 4 and 16 (8 warps at 128
        # registers: 2 programs a SM, 16 warps), then the MLA layer's rows (fp8, 32 K) here and in $K3MONO_BASE's tree
        step m1c_tile64_check_fp8 150 python3 benchmarks/gpu_check_mla.py --tokens 16 --contexts 4096 --kv fp8
        step m1c_tile64_check_bf16 100 python3 benchmarks/gpu_check_mla.py --tokens 1 --contexts 4096 --kv bf16
        step m1c_tile64_tiles 90 python3 benchmarks/m1c_tiles.py --tokens 1 4 16 --block-n 64 32 --stages 2 3 --warps 4
        step m1c_tile64_warps8 60 python3 benchmarks/m1c_tiles.py --tokens 1 4 16 --block-n 64 --stages 2 --warps 8 \
            --max-registers 128 0
        step m1c_tile64_bench_new 120 python3 -m k3mono bench --tp --tokens 1 4 16 --mla --contexts 32768 --kv fp8 \
            --out "$RESULTS"
        step m1c_tile64_bench_base 120 bash -c "cd '${K3MONO_BASE:?the tree to time against}' && \
            PYTHONPATH=\$PWD python3 -m k3mono bench --tp --tokens 1 4 16 --mla --contexts 32768 --kv fp8" ;;
    m1c_deep)  # M1c alone at 32 K at the first pipeline depths that keep copies in flight while a step computes
        # (planner.ATTN_STAGES: 5 stages one step, 7 at 32 positions two) against the defaults
        step m1c_deep_fp8 100 python3 benchmarks/m1c_tiles.py --kv fp8 --block-n 64 32 --stages 2 5 7 --warps 4 \
            --budget-s 90
        step m1c_deep_bf16 60 python3 benchmarks/m1c_tiles.py --kv bf16 --block-n 32 --stages 3 5 7 --warps 4 \
            --budget-s 50 ;;
    m1c_stages)  # M1c with each step's page ids loaded a step ahead (3 stages: one step in flight): alone at
        # 32 K, fp8 at 2 to 4 stages here and at 2 and 5 (one step in flight there) in $K3MONO_BASE's tree (this
        # tree's script), bf16 the same way; then checked (fp8 pages straddled at S = 4, bf16 at S = 1; the three
        # ways the same bits)
        tiles="python3 $PWD/benchmarks/m1c_tiles.py --first-splits --warps 4"
        step m1c_stages_fp8_new 120 $tiles --kv fp8 --block-n 64 32 --stages 2 3 4 --budget-s 110
        step m1c_stages_fp8_base 60 bash -c "cd '${K3MONO_BASE:?the tree to time against}' && PYTHONPATH=\$PWD \
            $tiles --kv fp8 --block-n 64 --stages 2 5 --budget-s 50"
        step m1c_stages_bf16_new 50 $tiles --kv bf16 --block-n 32 --stages 3 4 --budget-s 45
        step m1c_stages_bf16_base 50 bash -c "cd '$K3MONO_BASE' && PYTHONPATH=\$PWD $tiles --kv bf16 --block-n 32 \
            --stages 3 5 --budget-s 45"
        step m1c_stages_check_fp8 120 python3 benchmarks/gpu_check_mla.py --tokens 4 --contexts 5000 --kv fp8
        step m1c_stages_check_bf16 90 python3 benchmarks/gpu_check_mla.py --tokens 1 --contexts 4096 --kv bf16 ;;
    m1c_fold_apart)  # the fp8 MLA layer three ways at S = 4, 8 and 2 (4096 positions): where the folded way
        # parts from the separate launches (the split outputs, then the core; gpu_check_mla.where_apart)
        step m1c_fold_apart 220 python3 benchmarks/gpu_check_mla.py --tokens 4 8 2 --contexts 4096 --kv fp8 ;;
    m1c_fold_bisect)  # the fp8 MLA layer three ways at 4096 positions, S = 4, in each tree of $K3MONO_TREES with
        # its own script (git archive <commit> k3mono benchmarks into a carried folder): cf75fd7 gave the same bits,
        # main after cf9e37c does not (docs/PERF.md, thirty-first session)
        for tree in ${K3MONO_TREES:?the trees to check}; do
            step "m1c_fold_bisect_$(basename "$tree")" 100 bash -c "cd '$tree' && PYTHONPATH=\$PWD python3 \
                benchmarks/gpu_check_mla.py --tokens 4 --contexts 4096 --kv fp8"
        done ;;
    m1b_combine)  # the M1B_COMBINE tasks of 0a3d9d1 (M1b past 16 splits; not faster, removed: docs/PERF.md,
        # thirty-second session): the MLA layer three ways checked at 4096 positions (fp8 S = 1 and 4: 264 and 66
        # splits; bf16 S = 1), traced and timed at 32 K (fp8, S = 1 and 4), then in $K3MONO_BASE's tree at those S
        step m1b_combine_check_fp8 150 python3 benchmarks/gpu_check_mla.py --tokens 1 4 --contexts 4096 --kv fp8
        step m1b_combine_check_bf16 80 python3 benchmarks/gpu_check_mla.py --tokens 1 --contexts 4096 --kv bf16
        step m1b_combine_trace 170 python3 benchmarks/mla_trace.py --tokens 1 4 --out "$OUT/results"
        step m1b_combine_base 130 bash -c "cd '${K3MONO_BASE:?the tree to time against}' && \
            PYTHONPATH=\$PWD python3 '$PWD/benchmarks/mla_layers.py' --tokens 1 4" ;;
    m1b_combine_pairs)  # 986be51's M1B_COMBINE at 8 KB steps (slower, removed): the fp8 layer three ways checked
        # at 4096 positions (S = 1, 264 splits), traced and timed at 32 K (S = 1 and 4)
        step m1b_combine_pairs_check 90 python3 benchmarks/gpu_check_mla.py --tokens 1 --contexts 4096 --kv fp8
        step m1b_combine_pairs_trace 140 python3 benchmarks/mla_trace.py --tokens 1 4 --out "$OUT/results" ;;
    m1c_fold_ctas)  # the MLA layer with M1c folded in at S = 16 on 2 CTAs a SM (255 registers) instead of the
        # default 3 (168): at 3 the folded M1C step loop spills, none at 2 (offline sm_90a: 25 LDL and 6 STL a step,
        # 810 instructions against 757; docs/PERF.md, thirty-second session). Checked at 2, then timed at 3 and 2
        step m1c_fold_ctas_check 100 python3 benchmarks/gpu_check_mla.py --tokens 16 --contexts 4096 --kv fp8 \
            --set ctas_per_sm=2
        step m1c_fold_ctas_3 140 python3 benchmarks/mla_layers.py --tokens 16
        step m1c_fold_ctas_2 140 python3 benchmarks/mla_layers.py --tokens 16 --set ctas_per_sm=2 ;;
    m1c_fold_stages)  # the M1c fold's context loop at 3 stages (TileChoice.m1c_stages) now that it plans 2 CTAs a SM
        # (255 registers, no step-loop spill offline): checked, then the MLA layer three ways at S = 16, 8 (fp8, 32 K)
        # at 2 and 3
        step m1c_stages_check 200 python3 benchmarks/gpu_check_mla.py --tokens 16 8 --contexts 4096 --kv fp8 \
            --set m1c_stages=3
        step m1c_stages_2 130 python3 benchmarks/mla_layers.py --tokens 16 8 --set m1c_stages=2
        step m1c_stages_3 130 python3 benchmarks/mla_layers.py --tokens 16 8 --set m1c_stages=3 ;;
    mla_layers)  # the MLA layer three ways (fp8, 32 K; S = 1, 4, 16) here and in $K3MONO_BASE's tree, after a check
        # whose splits straddle cache pages (5000 positions, S = 4: 76 a split)
        step mla_layers_check 120 python3 benchmarks/gpu_check_mla.py --tokens 4 --contexts 5000 --kv fp8
        step mla_layers_new 170 python3 benchmarks/mla_layers.py
        step mla_layers_base 170 bash -c "cd '${K3MONO_BASE:?the tree to time against}' && \
            PYTHONPATH=\$PWD python3 '$PWD/benchmarks/mla_layers.py'" ;;
    mla_fold_tile)  # M1c folded in at 32 positions and 3 stages over an fp8 cache too (planner.attn_steps, folded):
        # checked (the three ways at that tile the same bits; 5000 positions at S = 4, 4096 at S = 16), then the MLA
        # layer three ways (fp8, 32 K; S = 1, 4, 16)
        step mla_fold_check_s4 100 python3 benchmarks/gpu_check_mla.py --tokens 4 --contexts 5000 --kv fp8
        step mla_fold_check_s16 120 python3 benchmarks/gpu_check_mla.py --tokens 16 --contexts 4096 --kv fp8
        step mla_fold_layers 170 python3 benchmarks/mla_layers.py ;;
    m1b_sleep)  # S = 1, M1b folded in: waiting CTAs pausing between polls (do 216 spinning o_proj CTAs slow M1B's
        # tasks?), traced and timed
        step m1b_sleep_trace 120 python3 benchmarks/mono_trace.py --tokens 1 --m1b --poll-sleep-ns 0 1000 \
            --out "$RESULTS"
        step m1b_sleep_ab 120 python3 benchmarks/defaults_ab.py --m1b --field poll_sleep_ns --values 0 1000 \
            --tokens 1 --rounds 2 ;;
    prefetch_mask)  # the always-prefetched kinds' mask (MonoOptions.always_prefetched) with all three kinds on, T = 1, S = 1
        step prefetch_mask_check 90 python3 benchmarks/gpu_check.py --skip-staged --tp 1 --tokens 1 --prefetch-gate-up 1 \
            --prefetch-down 1 --prefetch-oproj 1 --grids --occupy-sms 0 ;;
    m1b_rows)  # S = 1, M1b folded in: 16, 32 and 64 value rows an M1B task (TileChoice.m1b_rows)
        step mono_trace_m1b_rows 200 python3 benchmarks/mono_trace.py --tokens 1 --m1b --m1b-rows 16 32 64 \
            --out "$RESULTS" ;;
    m1b_double)  # S = 1, M1b folded in: its M1B and OPROJ tasks run twice in a row (first-of-kind costs)
        step mono_trace_m1b_double 150 python3 benchmarks/mono_trace.py --tokens 1 --m1b --double M1B OPROJ ;;
    trace_double)  # S = 1: the route and the latent norm's parts run twice in a row (first-of-kind costs)
        step mono_trace_double 200 python3 benchmarks/mono_trace.py --tokens 1 --double ROUTE LATENT_PART ;;
    defaults)  # the mono defaults against their alternatives (expert rows, pause between polls), S = 1 and 8
        step mono_defaults 200 python3 benchmarks/mono_sweep.py --tokens 1 8 --ctas 2 --prefetch 0 --down-rows 32 16 \
            --poll-sleep-ns 0 250
        step mono_router_rows 120 python3 benchmarks/mono_sweep.py --tokens 1 --ctas 2 --prefetch 0 --down-rows 16 \
            --poll-sleep-ns 250 --router-rows 8 4 2 ;;
    sleep)  # the trace with waiting CTAs pausing 0, 250 and 1000 ns between polls, S = 1 and 8
        step mono_trace_sleep 300 python3 benchmarks/mono_trace.py --tokens 1 8 --poll-sleep-ns 0 250 1000 \
            --out "$RESULTS" ;;
    loops)  # the expert stages' hot loops: pipeline depth and unroll factor (staged)
        step expert_loops 200 python3 benchmarks/expert_loops.py --tokens 1 8 ;;
    expert_mma)  # the expert tasks on tensor cores (TileChoice.expert_mma): the staged stages beside the FMA loops
        # (checked against them first), then the mono launch checked (T = 1, loopback T = 8)
        step expert_mma_stages 240 python3 benchmarks/expert_loops.py --tokens 1 8 16 --loops 1x1 --mma
        step expert_mma_check 300 python3 benchmarks/gpu_check.py --skip-staged --tokens 1 8 16 --expert-mma 1 \
            --grids --occupy-sms 0 ;;
    expert_mma_sweep)  # the mono launch with the expert tasks on FMA / tensor cores, at the defaults otherwise
        step expert_mma_s1 200 $MONO_SWEEP --tokens 1 --ctas 2 --prefetch 0 --prefetch-final 1 --expert-lookahead 1 \
            --down-rows 16 --shared-late 1 --expert-evict-first 1 --shared-step-kb 16 --expert-mma 0 1
        step expert_mma_s2816 340 $MONO_SWEEP --tokens 2 8 16 --ctas 2 --prefetch 0 --prefetch-final 1 \
            --expert-lookahead 1 --expert-mma 0 1 ;;
    expert_f16)  # the expert loops summing in f16 (TileChoice.expert_f16): the staged stages beside the fp32 sums
        # (checked against them first), the mono launch off / on, then checked (T = 1, loopback T = 8)
        step expert_f16_stages 150 python3 benchmarks/expert_loops.py --tokens 1 8 16 --loops 1x1 --f16
        step expert_f16_s1 150 $MONO_SWEEP --tokens 1 --ctas 2 --prefetch 0 --prefetch-final 1 --expert-lookahead 1 \
            --down-rows 16 --shared-late 1 --expert-evict-first 1 --shared-step-kb 16 --expert-f16 0 1
        step expert_f16_s816 200 $MONO_SWEEP --tokens 8 16 --ctas 2 --prefetch 0 --prefetch-final 1 \
            --expert-lookahead 1 --expert-f16 0 1
        step expert_f16_check 200 python3 benchmarks/gpu_check.py --skip-staged --tokens 1 8 16 --expert-f16 1 \
            --grids --occupy-sms 0 --layers-tokens ;;
    ctas_f16)  # 3 and 4 CTAs a SM (planner.resident_register_cap: 168, 128 registers) with f16 sums, beside the
        # defaults (2 CTAs; fp32 sums below S = 8); at S = 1 also smaller gate/up and down tasks for the larger grid
        step ctas_f16_s1_base 80 $MONO_SWEEP --tokens 1 --ctas 2 --prefetch 0 --prefetch-final 1 --expert-lookahead 1 \
            --down-rows 16 --shared-late 1 --expert-evict-first 1 --shared-step-kb 16 --expert-f16 0 1
        step ctas_f16_s1 200 $MONO_SWEEP --tokens 1 --ctas 3 4 --prefetch 0 --prefetch-final 1 --expert-lookahead 1 \
            --shared-late 1 --expert-evict-first 1 --shared-step-kb 16 --expert-f16 1 --gate-up-rows 32 16 --down-rows 16 8
        step ctas_f16_s2 100 $MONO_SWEEP --tokens 2 --ctas 2 4 --prefetch 0 --prefetch-final 1 --expert-lookahead 1 \
            --expert-evict-first 1 --expert-f16 0 1
        step ctas_f16_s816 160 $MONO_SWEEP --tokens 8 16 --ctas 2 3 4 --prefetch 0 --prefetch-final 1 \
            --expert-lookahead 1 --expert-f16 1 ;;
    lookahead_many)  # at 3 CTAs a SM (S >= 12) the expert loops with and without the activations a step ahead
        step lookahead_s16 120 $MONO_SWEEP --tokens 16 --ctas 3 --prefetch 0 --prefetch-final 1 --expert-f16 1 \
            --expert-lookahead 1 0 ;;
    x_groups)  # the router and latent down by groups of 4 tokens (TileChoice.x_token_groups): timed against the
        # defaults at S = 16 and 8 (and latent rows 8 / 4 with them), then checked (loopback T = 8, S = 16 and 6:
        # the last group shifted back)
        step x_groups_ab 280 python3 benchmarks/defaults_ab.py --field x_token_groups --values 0 1 --tokens 16 8
        step x_groups_latent_rows 120 python3 benchmarks/defaults_ab.py --field latent_rows --values 8 4 --tokens 16 \
            --also x_token_groups=1
        step x_groups_check 160 python3 benchmarks/gpu_check.py --skip-staged --tp 8 --tokens 16 6 \
            --x-token-groups 1 --grids --occupy-sms 0 --layers-tokens ;;
    parts_check)  # the two-step latent norm where latent_parts left it unchecked: S = 16 and S = 1 at grids of 132 and
        # 1 CTAs, T = 8 (loopback) and 1 (mono only)
        step parts_check 200 python3 benchmarks/gpu_check.py --skip-staged --tp 8 1 --tokens 16 1 --grids 132 1 \
            --occupy-sms 0 ;;
    rows_s1)  # S = 1: router rows 2 / 1, then latent rows 8 / 4 with 1 router row (the mono defaults otherwise)
        step router_rows_s1 110 python3 benchmarks/defaults_ab.py --field router_rows --values 2 1 --tokens 1
        step latent_rows_s1 110 python3 benchmarks/defaults_ab.py --field latent_rows --values 8 4 --tokens 1 \
            --also router_rows=1 ;;
    norm_scale)  # the latent norm's scale in FINAL (no LATENT_NORM task): checked, mono and staged (T = 1 and
        # loopback T = 8, S = 1, 8 and 16, grids of 132 and 1 CTAs); timed against the tree unpacked in
        # $K3MONO_BASE (the commit before), alternating, twice; the S = 1 and 8 traces
        step norm_scale_check 200 python3 benchmarks/gpu_check.py --tp 8 1 --tokens 1 8 16 --grids 132 1 --occupy-sms 0
        against_base norm_scale 1 8
        step norm_scale_trace 90 python3 benchmarks/mono_trace.py --tokens 1 8 --out "$RESULTS" ;;
    router_rms)  # S = 1: the router tasks forming x from the seam's h (planner.ROUTER_RMS_MAX_TOKENS): checked (T = 1
        # and loopback T = 8, grids of 132 and 1 CTAs, beside a kernel on 66 SMs), timed against the tree in
        # $K3MONO_BASE (the commit before), alternating, twice; the S = 1 trace
        step router_rms_check 150 python3 benchmarks/gpu_check.py --tp 8 1 --tokens 1 --grids 132 1 --occupy-sms 66
        against_base router_rms 1
        step router_rms_trace 60 python3 benchmarks/mono_trace.py --tokens 1 --out "$RESULTS" ;;
    route_scores)  # the route parts' scores beside their keys (ROUTE reads no logits after its sort): checked (staged
        # and mono, T = 1 and loopback T = 8, S = 1 and 8), timed against the tree in $K3MONO_BASE (the commit
        # before), alternating, twice; the S = 1 trace
        step route_scores_check 170 python3 benchmarks/gpu_check.py --tp 8 1 --tokens 1 8 --grids 132 --occupy-sms 0
        against_base route_scores 1 8
        step route_scores_trace 60 python3 benchmarks/mono_trace.py --tokens 1 --out "$RESULTS" ;;
    x_groups8)  # the router and latent down on the FMA path by groups of 8 tokens (TileChoice.x_group_tokens):
        # checked (loopback T = 8, S = 8: one group, 13: the last shifted back), timed against the defaults at S = 8
        # and 16 and at other router / latent rows, and the S = 8 trace
        step x8_check 150 python3 benchmarks/gpu_check.py --skip-staged --tp 8 --tokens 8 13 --x-token-groups 1 \
            --x-group-tokens 8 --grids 132 --occupy-sms 0
        step x8_ab 200 python3 benchmarks/defaults_ab.py --field x_token_groups --values 0 1 --tokens 8 16 \
            --also x_group_tokens=8
        step x8_rows 150 python3 benchmarks/defaults_ab.py --field latent_rows --values 8 2 --tokens 8 \
            --also x_token_groups=1 x_group_tokens=8 router_rows=1
        step x8_trace 80 python3 benchmarks/mono_trace.py --tokens 8 --set x_token_groups=1 x_group_tokens=8 \
            --out "$RESULTS" ;;
    x_parts)  # the router and latent down tiles by parts of K (TileChoice.x_k_parts): timed against the defaults
        # at S = 8 and 16 (7 and 4 parts), the S = 8 trace at 7, then checked (mono and staged, T = 1 and
        # loopback T = 8, S = 8 and 16)
        step x_parts_ab 270 python3 benchmarks/defaults_ab.py --field x_k_parts --values 1 7 4 --tokens 8 16
        step x_parts_trace 70 python3 benchmarks/mono_trace.py --tokens 8 --set x_k_parts=7 --out "$RESULTS"
        step x_parts_check 200 python3 benchmarks/gpu_check.py --tp 8 1 --tokens 8 16 --x-k-parts 7 --grids 132 \
            --occupy-sms 0 ;;
    x_parts_default)  # with MONO_X_K_PARTS the default: the route's tasks before SHARED_GU or after, 4 parts against
        # 2, both timed at S = 8 and 16; the S = 8 and 16 traces; the mono check (loopback T = 8, S = 8 and 16)
        step route_early_ab 170 python3 benchmarks/defaults_ab.py --field route_early --values 0 1 --tokens 8 16
        step x_parts_2_ab 150 python3 benchmarks/defaults_ab.py --field x_k_parts --values 4 2 --tokens 8 16
        step x_parts_traces 80 python3 benchmarks/mono_trace.py --tokens 8 16 --out "$RESULTS"
        step x_parts_default_check 90 python3 benchmarks/gpu_check.py --skip-staged --tp 8 --tokens 8 16 --grids 132 \
            --occupy-sms 0 --layers-tokens ;;
    expert_prefetch)  # the expert tasks asking for all their rows at once (MonoOptions.prefetch_down,
        # prefetch_gate_up): timed against the defaults (down at S = 1, 8 and 16, gate/up at S = 1 and 8), the S = 8
        # trace with the down tasks' prefetch
        step prefetch_down_ab 220 python3 benchmarks/defaults_ab.py --field prefetch_down --values 0 1 --tokens 1 8 16
        step prefetch_gate_up_ab 130 python3 benchmarks/defaults_ab.py --field prefetch_gate_up --values 0 1 \
            --tokens 1 8
        step prefetch_down_trace 60 python3 benchmarks/mono_trace.py --tokens 8 --set prefetch_down=1 \
            --out "$RESULTS" ;;
    down_step)  # expert down steps of 16 KB (TileChoice.down_step_kb) at the default rows (16 at S = 1, else 32),
        # then 64 rows against 32 at 16 KB, timed against the defaults
        step down_step_ab 200 python3 benchmarks/defaults_ab.py --field down_step_kb --values 8 16 --tokens 1 8 16
        step down_rows_ab 130 python3 benchmarks/defaults_ab.py --field down_rows --values 32 64 --tokens 8 16 \
            --also down_step_kb=16 ;;
    wide_check)  # the wide down tasks at their defaults (S = 8 and 16): checked (mono, loopback T = 8, and T = 1
        # at S = 16), then the S = 8 and 16 traces
        step wide_check_t8 100 python3 benchmarks/gpu_check.py --skip-staged --tp 8 --tokens 8 16 --grids 132 \
            --occupy-sms 0 --layers-tokens
        step wide_check_t1 80 python3 benchmarks/gpu_check.py --skip-staged --tp 1 --tokens 16 --grids \
            --occupy-sms 0 --layers-tokens
        step wide_traces 80 python3 benchmarks/mono_trace.py --tokens 8 16 --out "$RESULTS" ;;
    final_split)  # FINAL's shared down-projection before its own wait for the latent (MonoOptions.final_split),
        # and the shared weights into L2 while the chain settles (prefetch_shared): timed against the defaults at
        # S = 1 (shared tasks late, the default, and early), 8 and 16
        step final_split_s1 130 python3 benchmarks/defaults_ab.py --field final_split --values 0 1 --tokens 1
        step prefetch_shared_s1 110 python3 benchmarks/defaults_ab.py --field prefetch_shared --values 0 1 --tokens 1 \
            --also final_split=1
        step prefetch_shared_s1_early 100 python3 benchmarks/defaults_ab.py --field prefetch_shared --values 0 1 \
            --tokens 1 --also final_split=1 shared_late=0
        step final_split_s816 220 python3 benchmarks/defaults_ab.py --field final_split --values 0 1 --tokens 8 16 ;;
    options_ab)  # the token groups (S = 16, 8) and the split FINAL with the shared prefetch (S = 1), timed only
        step x_groups_ab 280 python3 benchmarks/defaults_ab.py --field x_token_groups --values 0 1 --tokens 16 8
        step final_split_s1 130 python3 benchmarks/defaults_ab.py --field final_split --values 0 1 --tokens 1
        step prefetch_shared_s1 110 python3 benchmarks/defaults_ab.py --field prefetch_shared --values 0 1 --tokens 1 \
            --also final_split=1 ;;
    options_check)  # the token groups and the split FINAL with the shared prefetch checked, then the S = 1 trace
        step x_groups_check 160 python3 benchmarks/gpu_check.py --skip-staged --tp 8 --tokens 16 6 \
            --x-token-groups 1 --grids --occupy-sms 0 --layers-tokens
        step final_split_check 280 python3 benchmarks/gpu_check.py --skip-staged --tp 8 1 --tokens 1 16 \
            --final-split 1 --prefetch-shared 1 --grids 132 1 --occupy-sms 0 --layers-tokens
        step final_split_trace 120 python3 benchmarks/mono_trace.py --tokens 1 --set final_split=1 prefetch_shared=1 \
            --out "$RESULTS" ;;
    latent_parts)  # the latent norm in parts (LATENT_PART) checked, then timed with FINAL's
        # weights prefetched early (MonoOptions.prefetch_final_early) and at 3 CTAs a SM at S = 1 (168 registers
        # offline at b32ece9), and the traces at S = 1 and 8
        step latent_parts_check 200 python3 benchmarks/gpu_check.py --tp 8 1 --tokens 1 8 16 --grids 132 1 \
            --occupy-sms 0
        step prefetch_final_early 120 python3 benchmarks/defaults_ab.py --field prefetch_final_early --values 0 1 \
            --tokens 1 8
        step ctas3_s1 80 python3 benchmarks/defaults_ab.py --field ctas_per_sm --values 2 3 --tokens 1
        step latent_parts_trace 100 python3 benchmarks/mono_trace.py --tokens 1 8 --out "$RESULTS" ;;
    final_split_check)  # both on: checked (T = 1 and loopback T = 8, S = 1 and 16, grids of 132 and 1 CTAs), and
        # the S = 1 trace beside the defaults'
        step final_split_check 300 python3 benchmarks/gpu_check.py --skip-staged --tp 8 1 --tokens 1 16 \
            --final-split 1 --prefetch-shared 1 --grids 132 1 --occupy-sms 0 --layers-tokens
        step final_split_trace 200 python3 benchmarks/mono_trace.py --tokens 1 --set final_split=1 prefetch_shared=1 \
            --out "$RESULTS" ;;
    tiles)  # gate/up and down task rows (TileChoice.gate_up_rows, down_rows), mono only, S = 1, 2 and 8
        step mono_tiles_s1 200 python3 benchmarks/mono_sweep.py --tokens 1 --ctas 2 --prefetch 0 --expert-lookahead 1 \
            --oproj-rows 32 --final-rows 32 --gate-up-rows 32 16 8 --down-rows 32 16 8 --skip-staged
        step mono_tiles_s28 200 python3 benchmarks/mono_sweep.py --tokens 2 8 --ctas 2 --prefetch 0 --expert-lookahead 1 \
            --oproj-rows 32 --final-rows 32 --gate-up-rows 32 16 --down-rows 32 16 8 --skip-staged ;;
    bulk)  # the bulk L2 prefetch, modes 0 / 2 (mono): S = 1, 8, the S = 1 trace
        MONO="$MONO_SWEEP"
        step bulk_s1 70 $MONO --tokens 1 --ctas 2 --prefetch 0 2 --expert-lookahead 1 --down-rows 16
        step bulk_s8 70 $MONO --tokens 8 --ctas 2 --prefetch 0 2 --expert-lookahead 1
        step bulk_trace 100 python3 benchmarks/mono_trace.py --tokens 1 --prefetch 0 2 --out "$RESULTS" ;;
    ctas3)  # S = 1 at 3 CTAs a SM (no lookahead: 168 registers) and smaller expert tasks, beside the defaults (mono)
        MONO="$MONO_SWEEP --tokens 1 --prefetch 0"
        step ctas3_default 40 $MONO --ctas 2 --expert-lookahead 1 --down-rows 16
        step ctas3_s1 120 $MONO --ctas 3 --expert-lookahead 0 --gate-up-rows 32 16 --down-rows 16 8 ;;
    shared)  # shared gate/up task rows 8 / 4 / 2 (TileChoice.shared_rows, FMA path), mono, S = 1, 2, 4
        MONO="$MONO_SWEEP --ctas 2 --prefetch 0"
        step shared_rows_s1 100 $MONO --tokens 1 --down-rows 16 --expert-lookahead 1 --shared-rows 8 4 2
        step shared_rows_s24 150 $MONO --tokens 2 4 --expert-lookahead 1 --shared-rows 8 4 2 ;;
    route)  # the route's tasks before SHARED_GU in the table or after (MonoOptions.route_early), mono, S = 1, 2, 8, 16
        MONO="$MONO_SWEEP --ctas 2 --prefetch 0"
        step route_s1 80 $MONO --tokens 1 --down-rows 16 --shared-rows 2 --expert-lookahead 1 --route-early 0 1
        step route_s2_8_16 200 $MONO --tokens 2 8 16 --expert-lookahead 1 --route-early 0 1 ;;
    tiles_check)  # S = 1 and 2: down rows 32 against 16 (the S = 1 default), gate/up rows 32 (mono)
        step mono_tiles_check 150 python3 benchmarks/mono_sweep.py --tokens 1 2 --ctas 2 --prefetch 0 --expert-lookahead 1 \
            --oproj-rows 32 --final-rows 32 --down-rows 32 16 --skip-staged ;;
    final_bulk)  # PREFETCH_FINAL tasks (bulk L2 prefetch) off / on at the eighth session's defaults, S = 1, 2, 8, 16
        MONO="$MONO_SWEEP --ctas 2 --prefetch 0 --expert-lookahead 1"
        step final_bulk_s1 90 $MONO --tokens 1 --down-rows 16 --shared-rows 2 --route-early 1 --prefetch-final 0 1
        step final_bulk_s2_8_16 200 $MONO --tokens 2 8 16 --prefetch-final 0 1 ;;
    shared_late)  # SHARED_GU after EXPERT_GU in the table or before it (MonoOptions.shared_late), mono, S = 1, 2, 4, 8
        MONO="$MONO_SWEEP --ctas 2 --prefetch 0 --expert-lookahead 1 --prefetch-final 1"
        step shared_late_s1 90 $MONO --tokens 1 --down-rows 16 --shared-rows 2 --route-early 1 --shared-late 0 1
        step shared_late_s1_rows8 60 $MONO --tokens 1 --down-rows 16 --shared-rows 8 --route-early 1 --shared-late 1
        step shared_late_s2_4_8 200 $MONO --tokens 2 4 8 --shared-late 0 1 ;;
    mla_check_one)  # the MLA check's one case: fp8 cache, 32 K, S = 1 (staged and the folds)
        step gpu_check_mla_one 300 python3 benchmarks/gpu_check_mla.py --tokens 1 --contexts 32768 --kv fp8 ;;
    m1c_profile)  # Nsight Compute counters of M1c alone: fp8, 32 K, S = 4, 66 splits, the default tile (64 x 2)
        step m1c_profile 120 ncu --clock-control none --launch-count 1 --kernel-name regex:_mla_attn $NCU_SECTIONS \
            python3 benchmarks/m1c_tiles.py --tokens 4 --splits 66 --block-n 64 --stages 2 --warps 4 --budget-s 20 ;;
    m1c_halves)  # M1c alone at 32 K, the latent dims in two halves (fp8: e4m3 column pairs): tiles, fp8 and bf16
        step m1c_halves_fp8 200 python3 benchmarks/m1c_tiles.py --tokens 1 4 16 --kv fp8 --block-n 32 64 --stages 2 3 \
            --warps 4 --budget-s 170
        step m1c_halves_bf16 100 python3 benchmarks/m1c_tiles.py --tokens 1 4 16 --kv bf16 --block-n 32 --stages 2 3 \
            --warps 4 --budget-s 80 ;;
    mla_bench_fp8)  # the MLA layer rows, fp8 cache at 32 K
        step bench_mla 120 python3 -m k3mono bench --tp --tokens $MLA_TOKENS --mla --contexts 32768 --kv fp8 \
            --out "$RESULTS" ;;
    m1c_tiles)  # M1c alone at 32 K: positions a step, steps in flight, warps, splits (fp8, S = 1, 4, 16)
        step m1c_tiles 260 python3 benchmarks/m1c_tiles.py --tokens 1 4 16 --budget-s 230 ;;
    stalls)  # every counter (the stall reasons among them) of the expert stages and the mono launch, S = 1
        step stalls_s1 200 ncu --clock-control none --profile-from-start off --set full \
            --kernel-name regex:"expert|mono" python3 benchmarks/profile_stages.py --tokens 1 --mono ;;
    m1b)
        step m1b_timing 200 python3 benchmarks/m1b_timing.py --fold-tokens 1 4 16 ;;
    profile)  # Nsight Compute counters of every staged stage and the mono launch, S = 1 and 8
        for S in 1 8; do
            step "profile_s$S" 150 ncu --clock-control none --profile-from-start off $NCU_SECTIONS \
                python3 benchmarks/profile_stages.py --tokens "$S" --mono
        done ;;
    gpus)
        T=$(nvidia-smi -L | wc -l)
        for S in 1 4 16; do
            step "ranks_gpus_t${T}_s${S}" 300 python3 -m k3mono ranks --tp "$T" --tokens "$S" --replays 100 --unfused --out "$RESULTS"
        done
        step "ranks_gpus_t${T}_layers" 300 python3 -m k3mono ranks --tp "$T" --tokens 1 --replays 100 --other-layers 92 \
            --out "$RESULTS" ;;
    *)
        echo "unknown step $s" ;;
    esac
done
tar czf /tmp/k3mono-session.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && \
    mv /tmp/k3mono-session.tar.gz "$OUT/session.tar.gz"
