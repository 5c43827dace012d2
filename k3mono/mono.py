"""The mono driver: layer_post as ONE persistent launch per rank (kernels/mono.py).

Build key and cache
    ``MonoBuild`` (frozen): the config, tokens, T, option bits, the AttnRes
    candidate pad, loopback, the SM count the grid is planned for, the
    prefetch mode, the flag scope and, on an MLA layer whose launch runs M1b
    first, the shape of M1b's inputs (planner.M1bShape) and, when M1c runs
    before it, of M1c's (planner.M1cShape). ``build(key)`` plans
    the task table (planner.plan) and derives every constexpr and region
    offset; the result is cached per key (the table tensor per device).

Buffers of a rank (flat uint8, every region REGION_ALIGN-aligned)
    peer     [parity 0 | parity 1 | flags]: each parity is layout.peer_layout
             (ar1, logits, z, ar2, ar3), epoch e uses parity e & 1; flags are
             the planner's int32 flag words (never cleared; epoch e waits for
             e * count).
    scratch  layout.scratch_layout (layout.SCRATCH_REGIONS: x, the route's,
             expert_act, latent_sq, latent, shared_act, the seam's; split_o
             and split_lse, M1c's split outputs, with M1C), then ``ctl``:
             the ticket counter and the CTAs-done counter (the last CTA of
             a launch resets both: no host work between launches, so the
             launch can be captured and replayed).
    epoch    int32 [1] on the device: read by the launch, advanced by its last
             CTA (a replay finds the next epoch there).
    health   int32 [sync.HEALTH_WORDS]: the alarm word and the record of the
             first wait that timed out.

k2_launch argument names (the seed's) -> LayerWeights fields
    w_o o_proj, ares_nw ares_norm, ares_qk ares_proj, in_nw post_norm,
    w_gate router, bias router_bias, w_ld latent_down, w_sgu (shared_gate,
    shared_up) (the seed fuses them; here a pair), w_sd shared_down,
    w13 (w1_packed, w3_packed), w13s (w1_scale, w3_scale) (pairs likewise),
    w2 w2_packed, w2s w2_scale, ln_w latent_norm, w_up latent_up; with
    TileChoice.expert_mma, w13 and w2 in mma order (k3mono.mxfp4.mma_order),
    with TileChoice.expert_f16 in f16 order (k3mono.mxfp4.f16_order).
    ``alarm`` is the wait bound: polls a wait may spin before it gives up.
    ``m1b_in`` (M1b builds only): the rank's heads' o, lse, w_v, w_v_scale and
    gate (kernels/mla_back.py); the launch writes ``core`` from them first.
    With M1C, m1b_in is only w_v, w_v_scale and gate, and ``m1c_in`` the
    rank's heads' q, kv, kv_scale, qsl, seq_lens, pages, indptr and scale
    (kernels/mla_attn.py): the launch writes the split outputs into its
    scratch first, and M1b reads them there.

Ranks
    ``RankBuffers``: a rank's scratch, epoch word, health and the peer buffers
    it pushes into (peers.py says where they come from: one device, host
    shared memory, symmetric memory). ``MonoRank``: one rank's launch of one
    layer on a RankBuffers (its input copies, out, the layer's weights);
    ``for_layer`` gives another layer's on the same buffers (the build key
    differs in the AttnRes candidate pad only: the same table and layouts).
    ``MonoRunner``: T ranks on one device.
    loopback (the default for T > 1): each rank's launch runs alone; the
    other ranks' pushes of this input are pre-written into both parities of
    its peer buffer by the host (from a staged run of the same input), its
    own slots / columns are poisoned, and the table's peer-wait counts are
    divided by T (only its own raises arrive). Every rank is run this way,
    one after another, and every rank's outputs are returned.
    full (loopback=False): every launch pushes into all T peer buffers, so
    the T launches must run at once: ``run(streams)`` puts each on its own
    stream (green contexts of disjoint SMs on one GPU); ranks in separate
    processes (ranks.py) run one MonoRank each. A rank launched alone times
    out cleanly, naming the exchange and the ranks whose pushes never came.
    T = 1 is the same in both modes.
    MLA layers (options.m1b): ``layer_post_mla(m1b_in, prefix, blocks)``, one
    dict of M1b inputs a rank; each rank's launch writes its own core from
    its heads' inputs. In loopback the other ranks' pushes come from a staged
    run on the core every rank's staged M1b writes (mla.rank_cores). With
    options.m1c, ``layer_post_mla(m1b_in, prefix, blocks, m1c_in=...)``:
    m1b_in the weights (w_v, w_v_scale, gate) and m1c_in one dict of M1c
    inputs a rank; in loopback the core comes from every rank's staged M1c
    (mla.mla_attn), then its staged M1b.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from .config import MAX_TOKENS, K3Config
from .errors import K3InputError, check_same_device, check_unit_stride, expect_dtype, expect_tensor
from .layout import REGION_ALIGN, layout_bytes, peer_layout, region_views, scratch_layout
from .mxfp4 import ExpertOrderCache, expert_order, expert_order_cache
from .planner import (COL, MONO_WARPS, OPT_EXPERT_EVICT_FIRST, PEER_FLAGS, M1bShape, M1cShape, MonoOptions,
                      TileChoice, next_pow2, plan, resident_register_cap, timing_variant)
from .staged import SLOT_EXCHANGES, StagedResult, _check_shards
from .validate import check_blocks, check_layer_inputs
from .weights import LayerWeights, check_shard

CTL_WORDS = 2  # ticket counter, CTAs done
DEFAULT_SPIN = 1 << 22
"""Polls a wait may take on the GPU (an acquire atomic each, a few hundred ns:
about a second)."""
INTERPRET_SPIN = 64
"""Under the interpreter the table is walked in order, so a wait is met at its
first poll or never."""


def _aligned(n: int) -> int:
    return -(-n // REGION_ALIGN) * REGION_ALIGN


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


TRACE_WORDS = 4  # kernels/mono.py: a traced ticket's SM, taken, ready, done
PREFETCH_MODES = (0, 1, 2)
"""Weights asked into L2 before a task's waits (kernels/mono.py: one bulk
prefetch a range, from one thread): 0 never, 1 when a wait would block, 2
always. A third mode, every gate/up task also asking for its share of its
expert's down rows, measured slower at every S (docs/PERF.md) and was dropped."""
DEFAULT_PREFETCH = 0
"""Measured on the H200 (benchmarks/mono_sweep.py --prefetch, docs/PERF.md): mode 2
through the copy engine S = 1 86.1 against 85.3 us, S = 8 228.2 against 223.2;
the expert tasks did not shorten with their rows asked for early (the trace of
the dropped third mode: 14.7 against 13.9 us a gate/up task), being bound by their
instruction issue, and the early requests slowed the latency chain (REDUCE1, the
seam) instead."""
MAX_POLL_SLEEP_NS = 1000
"""The longest pause between polls: a wait's bound is counted in polls
(DEFAULT_SPIN), so the pause stretches it; at 1 us a timed-out wait still
reports within a few seconds, not hours."""
DEFAULT_CTAS_PER_SM = 2
"""Measured on the H200 at one rank of TP8 (benchmarks/mono_sweep.py, docs/PERF.md):
two CTAs a SM took S = 1 from 182 to 148 us and S = 8 from 415 to 341 us (four
gave nothing more); the L2 prefetch before a blocking wait (mode 1), then a
read through the SM, cost 20 to 40 us (it read each weight tile twice through the
SM and kept nothing in registers across the wait)."""

MANY_TOKENS_CTAS_PER_SM = 3
MANY_CTAS_MIN_TOKENS = 12
"""From S = MANY_CTAS_MIN_TOKENS on the mono launch plans MANY_TOKENS_CTAS_PER_SM
CTAs a SM, capped at the registers that keep them resident (168,
planner.resident_register_cap): with the f16 expert sums (TileChoice.expert_f16)
no step loop spills at that cap (offline sm_90a builds), and the expert phases,
long at these S, get 12 warps a SM instead of 8. Measured on one H100, one rank of
TP8 (benchmarks/mono_sweep.py --ctas 2 3 4, f16 sums, docs/PERF.md), 2 -> 3
CTAs: S = 16 361.6 -> 348.6 us and again 360.9 -> 348.8, S = 12 290.4 -> 283.7;
S = 8 218.5 -> 222.6 and S = 1 75.6 -> 88.3 lose (the latency chain's tasks share
their SM with two more CTAs); 4 CTAs (128 registers) lost at every S but 16 (350.6)."""


FOLDED_M1C_CTAS_PER_SM = 2
"""CTAs a SM of a launch with M1c folded in, at every S: at MANY_TOKENS_CTAS_PER_SM
(168 registers) its M1C step loop spills, at 2 (255) it does not (offline sm_90a,
one rank of TP8, fp8 cache: S = 16 25 local loads and 6 stores a step, S = 12 20
and 31 in two step loops, none at 2). Measured on one H100 at S = 16, 32 K fp8
cache, 16 splits (benchmarks/mla_layers.py, docs/PERF.md): 590.0 us at 3 against
566.6 at 2, while the plain and M1b-folded launches keep 3 (464.0 -> 472.7 and
478.9 -> 492.7 at 2); S = 12 (22 splits), another H100: 476.0 at 3 against 448.3."""


FOLDED_M1C_DEEP_STAGES = 3
FOLDED_M1C_DEEP_MIN_TOKENS = 4
"""From S = FOLDED_M1C_DEEP_MIN_TOKENS on, the folded M1C tasks' context loop
keeps FOLDED_M1C_DEEP_STAGES steps in flight (TileChoice.m1c_stages; below,
planner.ATTN_FOLDED_STAGES' 2): at FOLDED_M1C_CTAS_PER_SM (255 registers) 3
stages build without a step-loop spill (offline sm_90a, fp8, TP8 loopback,
S = 8 and 16). Measured, the MLA layer with M1c and M1b folded in, fp8 cache
at 32 K (benchmarks/mla_layers.py, docs/PERF.md), 2 -> 3 stages: S = 16 556.5
-> 547.7 us, S = 8 334.2 -> 325.0 (one H100, thirty-fourth session); S = 4
225.9 -> 223.1, but S = 1 154.0 -> 158.3 (one H100, thirty-first session: a
split of 124 positions is four steps, and the deeper prologue costs more than
it hides). The stages change no sums: the same bits (benchmarks/gpu_check_mla.py
--set m1c_stages=3 at S = 8 and 16). Over an fp8 cache only: a bf16 cache's fold
was not timed at 3 (its step takes 93,440 B of shared memory there, room for
the 2 CTAs a SM still), so it keeps 2."""


FOLDED_M1C_M1B_ROWS = 64
FOLDED_M1C_WIDE_M1B_MIN_TOKENS = 16
"""From S = FOLDED_M1C_WIDE_M1B_MIN_TOKENS on, a launch with M1c folded in gives
an M1B task FOLDED_M1C_M1B_ROWS value rows (TileChoice.m1b_rows; planner.
BACK_BLOCK_DV's 32 otherwise): every M1B task combines its head's splits again,
and at S = 16 the 768 tasks of 32 rows ran 8.2 us each in three waves after the
last M1C task, 26.5 us (the trace mla-trace-fp8-32768-S16-m1c-0196bdd-h100.json).
Measured, the MLA layer with M1c and M1b folded in, fp8 cache at 32 K, one H100
(benchmarks/mla_layers.py, docs/PERF.md, thirty-fourth session), 32 -> 64 rows:
S = 16 548.7 -> 532.6 us, then alternating 551.1, 545.8 -> 531.7, 537.3; S = 8
325.4 -> 326.0 (the M1b-folded launch, M1c apart: S = 16 478.2 -> 481.6, 477.9,
480.6 -> 481.8, 481.8, so it keeps 32). The same bits (gpu_check_mla.py --set
m1b_rows=64, S = 16). Either cache: the M1B tasks read M1c's fp32 split outputs
and w_v, not the cache (a bf16 cache's fold was not timed)."""


def default_ctas_per_sm(tokens: int, m1c_folded: bool = False) -> int:
    """CTAs a SM the mono launch of S = ``tokens`` plans: DEFAULT_CTAS_PER_SM, from
    MANY_CTAS_MIN_TOKENS on MANY_TOKENS_CTAS_PER_SM; FOLDED_M1C_CTAS_PER_SM where
    M1c is folded in (``m1c_folded``)."""
    if m1c_folded:
        return FOLDED_M1C_CTAS_PER_SM
    return MANY_TOKENS_CTAS_PER_SM if tokens >= MANY_CTAS_MIN_TOKENS else DEFAULT_CTAS_PER_SM


EXPERT_F16_SUMS = True
"""Whether the mono launch's expert loops sum each MXFP4 group in f16, at every S
(TileChoice.expert_f16, weights in f16 order): 3.0 / 3.7 instructions a weight
value for gate/up / down against 4.3 / 5.0. Mono launch, fp32 -> f16 sums, one
H100 each time (benchmarks/mono_sweep.py --expert-f16 0 1, docs/PERF.md): S = 1
76.7 -> 75.6 us and 76.8 -> 75.6, S = 2 101.1 -> 101.7 and 101.2 -> 101.4, S = 4
142.5 -> 143.1, S = 8 228.0 -> 218.3, S = 16 381.1 -> 361.3. Below S = 8 each
task's first read of its token's activations (for their scale) costs about what
the shorter loop saves; one order for every S lets an engine turn its experts once,
in place (weights.experts_in_f16_order_), and hold no second copy of them."""


MONO_X_K_PARTS = 4
"""Parts of K a router or latent down row tile of the mono launch is cut into on
the tl.dot path, S > 4 (TileChoice.x_k_parts; planner.X_K_PARTS says how; the
staged path, a program a tile with nothing to wait for, keeps 1). Measured on
one H100 (benchmarks/defaults_ab.py, one rank of TP8, docs/PERF.md), parts 1 /
7 / 4, us: S = 8 210.6, 209.3 / 208.1, 207.5 / 205.1, 204.4; S = 16 325.2, 324.0
/ 321.9, 321.7 / 321.5, 322.2; parts 4 / 2 on another H100: S = 8 204.9, 204.9
/ 203.6, 202.7, S = 16 321.2, 320.9 / 324.5, 325.0. The S = 8 trace at 7 parts
had the route's first token at 32.7 us (48.5 at 1 part on an H200); the expert
gate/up phase, its tasks together near the copy bandwidth, ended where it did.
With the router short, the route's tasks before SHARED_GU (route_early) still
gained nothing: S = 8 205.2, 205.6 -> 204.9, 204.6, S = 16 322.0, 321.9 ->
321.9, 322.6."""

DEFAULT_TILES = TileChoice(expert_lookahead=True, oproj_rows=32, final_rows=32, expert_f16=EXPERT_F16_SUMS,
                           x_k_parts=MONO_X_K_PARTS)
"""The staged path's tiles (32 expert rows, 2 router rows) with the router and
latent down by MONO_X_K_PARTS parts of K above S = 4, expert loops
summing in f16 (EXPERT_F16_SUMS) and loading a step ahead, and 32-row o_proj
and FINAL tasks, measured on the H200
(benchmarks/mono_sweep.py, docs/PERF.md): the lookahead took S = 1 from 125.9
to 122.2 and from 113.9 to 112.8 us, S = 8 from 249.4 to 246.9 and from 248.4
to 246.1 (two machines; the staged path's S = 8 lost 11 us with it, so the
planner's default keeps it off); 16 expert rows took S = 1 from 118.5 to 129.5
us and S = 8 from 264.1 to 319.9 (an earlier machine had shown the opposite,
140.9 -> 127.4). o_proj / FINAL rows 8 / 8, 16 / 16, 32 / 32, 64 / 64: S = 1
100.8, 93.9, 89.7 (89.4 on a second machine), 101.5 us; S = 8 (16 rows at
least) 235.7, 224.1 (224.2), 233.0 (the staged path, non-persistent, keeps 8:
its S = 1 took 107.5 us at 8 / 8 and 112.1 at 32 / 32)."""
DEFAULT_POLL_SLEEP_NS = 0
"""Measured on the H200 (benchmarks/mono_sweep.py, mono_trace.py): a 250 ns
pause between polls moved S = 1 by -3.5 to +0.7 us and S = 8 by +0.4 to +2.0,
within the runs' spread; 1000 ns cost 2.7. Spinning stays the default (no inline asm)."""


SINGLE_TOKEN_DOWN_ROWS = 16
"""Down task rows of the mono launch at S = 1 (the other sizes keep DEFAULT_TILES'
32). At 32 rows S = 1 has 112 down tasks for 264 CTAs; 16 rows make 224, the
same bytes a step. Measured on the H200 (benchmarks/mono_sweep.py --gate-up-rows
--down-rows, docs/PERF.md): gate/up / down rows 32 / 32 89.5 us, 32 / 16 86.5,
32 / 8 88.8, 16 / 16 86.0, 8 / 8 95.6; at S = 8 32 / 16 cost 16 us (240.2
against 224.3) and fewer gate/up rows more."""


SINGLE_TOKEN_SHARED_STEP_KB = 16
"""KB a shared gate/up task loads a step at S = 1 (TileChoice.shared_step_kb; the
other sizes keep DEFAULT_TILES' 8): the 96 shared tasks run late at S = 1
(SINGLE_TOKEN_SHARED_LATE), a chain of memory round trips each, 28 steps of
8 KB. Measured on one H200 (mono_sweep --shared-step-kb 8 16 32 at the S = 1
defaults, docs/PERF.md): 72.7 (8 KB) -> 71.1 (16) and 72.4 (32, which spills
48 B in an offline sm_90a build); 8 KB again 72.8. S = 2 94.3 -> 96.0 and S = 8
220.0 -> 226.2 with 16 KB. FINAL's step at 16 KB (a separate knob, not kept)
gained nothing: 72.7 both."""


WIDE_OPROJ_MAX_TOKENS = 8
WIDE_OPROJ_STEP_KB = 16
"""KB an o_proj task loads a step up to S = WIDE_OPROJ_MAX_TOKENS
(TileChoice.oproj_step_kb; from there on DEFAULT_TILES' 8): every later task
waits for o_proj, and a 32-row task at S = 1 is 12 steps of 8 KB, one in
flight (planner.DENSE_STEP_KB), at 2.0 TB/s over all of o_proj's 22 MB (TP8; the S = 1 trace at cfd5a34
on an H100: done at 10.9 us). Offline sm_90a builds: S = 1 168 registers and
24 B of stack as at 8 KB (32 KB takes 255 registers); S = 8 255 and 56 B (40 B
at 8 KB), 48 KB of shared memory (32). Measured on two H100s
(benchmarks/defaults_ab.py, one rank of TP8, docs/PERF.md), us, 8 / 16 / 32 KB:
S = 1 71.1, 71.2 / 70.2, 70.1 / 71.2, 71.1; S = 8 197.8, 197.5 / 197.3, 196.8 /
200.4, 200.2; S = 16 316.6, 316.9 / 321.6, 321.4 / 367.2, 367.4; on the second,
8 / 16 KB: S = 2 96.6, 96.6 / 96.8, 96.7, S = 4 136.4, 136.5 / 131.0, 130.7.
S = 3, 5, 6 and 7 were not timed."""


SINGLE_TOKEN_ROUTER_ROWS = 1
SINGLE_TOKEN_LATENT_ROWS = 4
"""Router and latent down task rows of the mono launch at S = 1 (the other sizes
keep DEFAULT_TILES' 2 and 8): 112 router tasks of 14 KB and 112 latent tasks of
57 KB, each a shorter chain of memory round trips on the path from x to the
experts (the S = 1 trace at 80f0b49, an H200: 3.5 us a 2-row router task, 8.7 a
8-row latent task, the latent done with the route). Measured on one H200
(benchmarks/defaults_ab.py, docs/PERF.md), us: router rows 2 / 1 at 8 latent rows
70.0, 69.9 / 69.3, 69.6; latent rows 8 / 4 at 1 router row 69.1, 69.5 / 68.3, 68.7
and again 69.2, 69.4 / 68.3, 68.5; router rows 2 / 1 at 4 latent rows 68.8, 69.1
/ 68.3, 68.5. An earlier H200 had 74.3 (2 / 8) against 73.4 (1 / 4)
(planner.LATENT_ROWS); at S = 2 and 4 one router row was slower there."""


WIDE_DOWN_MIN_TOKENS = 8
WIDE_DOWN_ROWS = 64
WIDE_DOWN_STEP_KB = 16
"""From S = WIDE_DOWN_MIN_TOKENS on, the mono launch's expert down tasks take
WIDE_DOWN_ROWS rows and WIDE_DOWN_STEP_KB a step (TileChoice.down_rows,
down_step_kb; planner.DOWN_STEP_KB says why): twice the bytes in flight a
step, the extra weight registers paid by the rows, not by more activations.
Offline sm_90a builds (benchmarks/resource_check.py, TP8 loopback): S = 8 255
registers, 40 B of stack (16 before), no step loop spills; S = 16 168 and 312 B
(264), none either; 32 rows at 16 KB spilled in S = 16's step loops. Measured
on one H100 (benchmarks/defaults_ab.py, one rank of TP8, docs/PERF.md), us:
rows / KB 32 / 8 against 32 / 16: S = 1 (16 rows) 70.5, 70.7 / 70.5, 70.5, S = 8
205.3, 205.6 / 194.4, 193.6, S = 16 321.7, 322.5 / 324.2, 325.4; then 32 / 16
against 64 / 16: S = 8 194.3, 193.5 / 191.2, 191.6, S = 16 325.1, 324.8 / 310.8,
311.3."""


def default_tiles(tokens: int, m1c: M1cShape | None = None, **given) -> TileChoice:
    """DEFAULT_TILES for S = ``tokens``: at S = 1 SINGLE_TOKEN_DOWN_ROWS down rows,
    SINGLE_TOKEN_SHARED_STEP_KB a shared gate/up step and SINGLE_TOKEN_ROUTER_ROWS /
    SINGLE_TOKEN_LATENT_ROWS router / latent rows, up to S = WIDE_OPROJ_MAX_TOKENS
    WIDE_OPROJ_STEP_KB an o_proj step, from S = WIDE_DOWN_MIN_TOKENS the wide
    down tasks; where M1c is folded in (``m1c``, its M1cShape) from S =
    FOLDED_M1C_WIDE_M1B_MIN_TOKENS FOLDED_M1C_M1B_ROWS value rows an M1B task and, over
    an fp8 cache, from S = FOLDED_M1C_DEEP_MIN_TOKENS FOLDED_M1C_DEEP_STAGES; any field
    in ``given`` overrides its default. The
    tensor-core experts read mma order, so asking for them drops the default
    f16 sums (the other order) unless expert_f16 is given too."""
    tiles = DEFAULT_TILES
    if tokens == 1:
        tiles = dataclasses.replace(tiles, down_rows=SINGLE_TOKEN_DOWN_ROWS, shared_step_kb=SINGLE_TOKEN_SHARED_STEP_KB,
                                    router_rows=SINGLE_TOKEN_ROUTER_ROWS, latent_rows=SINGLE_TOKEN_LATENT_ROWS)
    if tokens <= WIDE_OPROJ_MAX_TOKENS:
        tiles = dataclasses.replace(tiles, oproj_step_kb=WIDE_OPROJ_STEP_KB)
    if tokens >= WIDE_DOWN_MIN_TOKENS:
        tiles = dataclasses.replace(tiles, down_rows=WIDE_DOWN_ROWS, down_step_kb=WIDE_DOWN_STEP_KB)
    if m1c is not None and m1c.kv_fp8 and tokens >= FOLDED_M1C_DEEP_MIN_TOKENS:
        tiles = dataclasses.replace(tiles, m1c_stages=FOLDED_M1C_DEEP_STAGES)
    if m1c is not None and tokens >= FOLDED_M1C_WIDE_M1B_MIN_TOKENS:
        tiles = dataclasses.replace(tiles, m1b_rows=FOLDED_M1C_M1B_ROWS)
    if given.get("expert_mma"):
        given = {"expert_f16": False, **given}
    return dataclasses.replace(tiles, **given)


SINGLE_TOKEN_SHARED_LATE = True
"""At S = 1 the table runs the route, then EXPERT_GU, then SHARED_GU
(MonoOptions.shared_late): the 192 gate/up tasks get CTAs the moment the route
is known, and the 96 shared tasks (planner.SHARED_ROWS rows) run on the 72 CTAs
they leave free. Before (sixth to eighth sessions), 384 shared tasks of 2 rows
ran ahead of the gate/up tasks, with the route moved before them
(route_early): some gate/up tasks then started only when the shared tasks
ended, 7.7 us after the route was known (the trace at 5122178). Measured on the
H200 (benchmarks/mono_sweep.py --shared-late --shared-rows, docs/PERF.md),
2 rows route first -> 8 rows shared late: 79.3 -> 78.3, 78.9 -> 78.3, 78.8 ->
78.2 us (4 rows shared late 86.5, 2 rows 83.6); S = 2, 4, 8 lose with it (104.4
-> 110.7, 150.9 -> 164.6, 223.2 -> 227.0)."""


DEFAULT_PREFETCH_FINAL = True
"""PREFETCH_FINAL tasks (MonoOptions.prefetch_final): after the expert tasks in
the table, each asks the copy engine for one FINAL task's weight rows
(kernels/common.py prefetch_l2, one instruction a range), so FINAL finds them in
L2 while the MXFP4 tasks, bound by their instructions, leave HBM idle. Measured
on the H200 (benchmarks/device_session.sh final_bulk, twice on one machine,
docs/PERF.md), off -> on: S = 1 81.4 -> 80.3 and 81.0 -> 80.0 us, S = 2 106.2 ->
105.5 and 106.1 -> 105.4, S = 8 225.1 -> 223.9 and 225.2 -> 224.3, S = 16 370.6
-> 369.7 and 370.7 -> 369.5. (With the old prefetch, rows read through the SM
into registers, it gained nothing: 3056def.)"""


EVICT_FIRST_MAX_TOKENS = 4
"""Up to this many tokens a launch the expert tasks load their weights evict_first
(MonoOptions.expert_evict_first): read once, they go first when L2 makes room,
ahead of what PREFETCH_FINAL put there for FINAL. From S = 8 on, tokens share
experts, and the L2 hits the policy gives up cost more than it saves. Measured on one H200 (mono_sweep
--expert-evict-first 0 1 at the defaults, docs/PERF.md), off -> on: S = 1 75.4
-> 73.5 us, S = 2 98.7 -> 94.8, S = 4 142.6 -> 137.9, S = 16 371.5 -> 381.3;
S = 8 222.1 -> 224.8 on another call's machine."""


def default_options(tokens: int, **choices) -> MonoOptions:
    """MonoOptions at the measured defaults for S = ``tokens`` (default_ctas_per_sm,
    default_tiles, DEFAULT_POLL_SLEEP_NS, DEFAULT_PREFETCH_FINAL, SINGLE_TOKEN_SHARED_LATE
    at S = 1, expert_evict_first up to EVICT_FIRST_MAX_TOKENS), any field overridden by ``choices``
    (an M1cShape ``m1c`` among them sets the M1c fold's CTAs a SM and tiles)."""
    m1c_folded = choices.get("m1c") is not None
    fields = dict(ctas_per_sm=default_ctas_per_sm(tokens, m1c_folded), tiles=default_tiles(tokens, choices.get("m1c")),
                  poll_sleep_ns=DEFAULT_POLL_SLEEP_NS, prefetch_final=DEFAULT_PREFETCH_FINAL,
                  shared_late=SINGLE_TOKEN_SHARED_LATE and tokens == 1, expert_evict_first=tokens <= EVICT_FIRST_MAX_TOKENS)
    return MonoOptions(**{**fields, **choices})


OPTION_FIELDS = ("prefetch_final", "prefetch_final_early", "prefetch_shared", "route_early", "shared_late",
                 "expert_evict_first", "final_split", "prefetch_gate_up", "prefetch_down", "prefetch_oproj",
                 "poll_sleep_ns",
                 "ctas_per_sm")
"""The MonoOptions fields ``default_options_with`` sets (the others are shapes or tiles)."""


def default_options_with(tokens: int, fields: dict[str, int], **shapes) -> MonoOptions:
    """default_options(S, **shapes) with ``fields`` set: TileChoice fields or OPTION_FIELDS,
    by name, each an int (0 / 1 for a bool), as the benchmarks' command lines give them;
    ``shapes`` the MLA layer's (m1b, m1c), as MonoOptions takes them."""
    tile_types = {field.name: type(field.default) for field in dataclasses.fields(TileChoice)}
    option_types = {field.name: type(field.default) for field in dataclasses.fields(MonoOptions)}
    tiles, options = {}, {}
    for name, value in fields.items():
        if name in tile_types:
            tiles[name] = tile_types[name](value)
        elif name in OPTION_FIELDS:
            options[name] = option_types[name](value)
        else:
            raise K3InputError(f"options: {name!r} is neither a TileChoice field nor one of {OPTION_FIELDS}")
    return default_options(tokens, tiles=default_tiles(tokens, shapes.get("m1c"), **tiles), **options, **shapes)


def parse_option_fields(items: list[str]) -> dict[str, int]:
    """NAME=INTEGER pairs (a command line's) -> {name: value}, for default_options_with."""
    pairs = [item.partition("=") for item in items]
    if any(not name.isidentifier() or not sep or not value.lstrip("-").isdigit() for name, sep, value in pairs):
        raise K3InputError(f"options: expected NAME=INTEGER pairs, got {items}")
    return {name: int(value) for name, _, value in pairs}


@dataclass(frozen=True)
class MonoBuild:
    cfg: K3Config
    tokens: int
    tp: int
    opt: int = 0  # planner option bits (MonoOptions.bits)
    cands: int = 2  # AttnRes candidates, padded to a power of two
    loopback: bool = False
    sms: int = 1  # the grid is planned for this many SMs (1 under the interpreter: device_sms)
    ctas_per_sm: int = 1
    prefetch: int = DEFAULT_PREFETCH  # PREFETCH_MODES
    scope: str = "gpu"
    m1b: M1bShape | None = None  # with the m1b bit of opt (MonoOptions.m1b)
    m1c: M1cShape | None = None  # with the m1c bit of opt (MonoOptions.m1c)
    variant: tuple[str, int] | None = None  # (how, TaskKind code): planner.timing_variant, timing only
    max_registers: int | None = None  # ptxas's cap a thread (Triton's maxnreg); None: the compiler's choice
    tiles: TileChoice = TileChoice()  # MonoOptions.tiles
    trace: bool = False  # record each ticket's SM and times (k3mono/trace.py); compiled builds only
    poll_sleep_ns: int = 0  # MonoOptions.poll_sleep_ns

    def __post_init__(self):
        if not isinstance(self.tokens, int) or not 1 <= self.tokens <= MAX_TOKENS:
            raise K3InputError(f"tokens: expected an integer in 1..{MAX_TOKENS}, got {self.tokens!r}")
        if self.prefetch not in PREFETCH_MODES:
            raise K3InputError(f"prefetch: expected one of {PREFETCH_MODES}, got {self.prefetch!r}")
        if self.scope not in ("gpu", "sys"):
            raise K3InputError(f"scope: expected 'gpu' or 'sys', got {self.scope!r}")
        sleep = self.poll_sleep_ns
        if not (isinstance(sleep, int) and 0 <= sleep <= MAX_POLL_SLEEP_NS):
            raise K3InputError(f"poll_sleep_ns: expected an integer in 0..{MAX_POLL_SLEEP_NS}, got {sleep!r}")
        if self.max_registers is not None and not (isinstance(self.max_registers, int) and 24 <= self.max_registers <= 255):
            raise K3InputError(f"max_registers: expected an integer in 24..255 or None, got {self.max_registers!r}")

    @property
    def options(self) -> MonoOptions:
        return MonoOptions.from_bits(self.opt, self.ctas_per_sm, self.m1b, self.m1c, self.tiles, self.poll_sleep_ns)


# -- layouts -------------------------------------------------------------------------------


def data_layout(key: MonoBuild) -> dict:
    """One parity's data regions: name -> (byte offset, shape, dtype)."""
    return peer_layout(key.cfg, key.tp, key.tokens)


def peer_regions(key: MonoBuild, num_flag_words: int) -> dict:
    """A rank's peer buffer: name -> (byte offset, bytes): parity0, parity1, flags."""
    half = layout_bytes(data_layout(key))
    flags = _aligned(4 * num_flag_words)
    return {"parity0": (0, half), "parity1": (half, half), "flags": (2 * half, flags), "__end__": (2 * half + flags, 0)}


def scratch_regions(key: MonoBuild) -> dict:
    """A rank's scratch buffer: layout.scratch_layout's regions, then ``ctl``: name -> (byte offset, bytes)."""
    return build(key).scratch


def _scratch_regions(lay: dict) -> dict:
    out = {}
    for name, (off, shape, dtype) in lay.items():
        if name != "__end__":
            n = dtype.itemsize
            for d in shape:
                n *= d
            out[name] = (off, n)
    end = layout_bytes(lay)
    out["ctl"] = (end, 4 * CTL_WORDS)
    out["__end__"] = (end + _aligned(4 * CTL_WORDS), 0)
    return out


def buffer_bytes(regions: dict) -> int:
    return regions["__end__"][0]


# -- build -------------------------------------------------------------------------------------


@dataclass
class Compiled:
    key: MonoBuild
    table: object  # planner.TaskTable
    rows: torch.Tensor  # int32 [tasks, columns] (CPU; peer counts / T in loopback)
    grid: int
    consts: dict
    peer: dict  # peer_regions
    scratch: dict  # scratch_regions
    data: dict  # data_layout (one parity)
    scratch_lay: dict  # layout.scratch_layout of the launch (the split outputs with M1C)
    _on_device: dict = dataclasses.field(default_factory=dict)

    def rows_on(self, device) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._on_device:
            self._on_device[device] = self.rows.to(device)
        return self._on_device[device]


_CACHE: dict[MonoBuild, Compiled] = {}


def _table_rows(table, loopback: bool) -> torch.Tensor:
    rows = table.as_int_tensor()
    if loopback and table.tp > 1:
        for i in range(2):
            words, counts = rows[:, COL[f"wait{i}_word"]], rows[:, COL[f"wait{i}_count"]]
            for r in range(rows.shape[0]):
                word = int(words[r])
                if word >= 0 and table.flag_of_word(word)[0] in PEER_FLAGS:
                    assert int(counts[r]) % table.tp == 0
                    counts[r] //= table.tp
    return rows.contiguous()


def build(key: MonoBuild) -> Compiled:
    if key in _CACHE:
        return _CACHE[key]
    if key.trace and _interpreting():
        raise K3InputError("trace: the task trace reads the GPU's timer (inline PTX); the interpreter has none")
    from .kernels import common
    from .kernels.experts import DEFAULT_DEQUANT, DEQUANT_F16, _block_groups
    from .kernels.gemv import even_k

    cfg, T, S = key.cfg, key.tp, key.tokens
    table = plan(cfg, T, S, key.sms, key.options)
    if key.variant is not None:
        table = timing_variant(table, *key.variant)
    g = table.geometry
    H, C, E, L, I, SI = cfg.matrix_dims
    data = data_layout(key)
    peer = peer_regions(key, table.num_flag_words)
    scratch_lay = scratch_layout(cfg, T, S, g.m1c, g.x_parts)
    scratch = _scratch_regions(scratch_lay)
    half = peer["parity1"][0]
    # The interpreter runs programs one after another: the first walks the whole
    # table, the rest find no ticket left and only count themselves out.
    grid = table.ctas

    def elems(offset: int, itemsize: int) -> int:
        assert offset % itemsize == 0
        return offset // itemsize

    consts = dict(
        NCOL=len(COL),
        NP=1 if key.loopback else T, T=T, S=S, SP=g.tokens_pad, H=H, C_R=C // T, E=E, E_R=E // T,
        E_PAD=next_pow2(E), RC=g.route_chunk, PC=g.latent_part, PL=-(-L // g.latent_part),
        KTOP=cfg.num_experts_per_token, L=L, L_R=L // T, I_R=I // T, SI_R=SI // T,
        USE_DOT=g.use_dot, XG=g.x_group, XGP=g.x_group_pad, XG_DOT=g.x_group_dot, ROUTER_RMS=g.router_rms,
        UPCAST=common.UPCAST_DOT,
        O_ROWS=g.oproj.rows, O_BK=g.oproj.block_k, O_EVEN=even_k(C // T, g.oproj.block_k),
        X_PARTS=g.x_parts,  # the router and latent down tiles cover H / X_PARTS columns a task
        R_ROWS=g.router.rows, R_BK=g.router.block_k, R_EVEN=even_k(H // g.x_parts, g.router.block_k),
        LD_ROWS=g.latent_down.rows, LD_BK=g.latent_down.block_k,
        LD_EVEN=even_k(H // g.x_parts, g.latent_down.block_k),
        SG_ROWS=g.shared_gate_up.rows, SG_BK=g.shared_gate_up.block_k, SG_EVEN=even_k(H, g.shared_gate_up.block_k),
        F_ROWS=g.final.rows, F_BK=g.final.block_k, F_EVEN_L=even_k(L // T, g.final.block_k),
        F_EVEN_S=even_k(SI // T, g.final.block_k),
        GU_ROWS=g.expert_gate_up.rows, GU_BG=_block_groups(g.expert_gate_up),
        DN_ROWS=g.expert_down.rows, DN_BG=_block_groups(g.expert_down), EXPERT_LOOKAHEAD=g.expert_gate_up.lookahead,
        EXPERT_EVICT_FIRST=bool(key.opt & OPT_EXPERT_EVICT_FIRST), EXPERT_MMA=key.tiles.expert_mma,
        PREFETCH_KINDS=key.options.always_prefetched(),
        EXPERT_DEQUANT=DEQUANT_F16 if key.tiles.expert_f16 else DEFAULT_DEQUANT,
        CANDS=key.cands, CP=scratch_lay["seam_part"][1][-1], SC=g.seam_cols, SCORE_COLS=g.score_cols,
        RC1=next_pow2(table.reduce1_cols), RC3=next_pow2(table.reduce3_cols),
        BETA=float(cfg.situ_beta), LINEAR_BETA=float(cfg.situ_linear_beta),
        AR1_F=elems(data["ar1"][0], 4), LOG_F=elems(data["logits"][0], 4), Z_B=elems(data["z"][0], 2),
        AR2_F=elems(data["ar2"][0], 4), AR3_F=elems(data["ar3"][0], 4),
        PAR_F=elems(half, 4), PAR_B=elems(half, 2), FLAG_I=elems(peer["flags"][0], 4),
        X_B=elems(scratch["x"][0], 2), IDS_I=elems(scratch["route_ids"][0], 4), RW_F=elems(scratch["route_w"][0], 4),
        RK_I=elems(scratch["route_keys"][0], 4),
        ACT_B=elems(scratch["expert_act"][0], 2), LAT_B=elems(scratch["latent"][0], 2),
        LSQ_F=elems(scratch["latent_sq"][0], 4),
        SACT_B=elems(scratch["shared_act"][0], 2), SPART_F=elems(scratch["seam_part"][0], 4),
        SH_B=elems(scratch["seam_h"][0], 2), SHSQ_F=elems(scratch["seam_hsq"][0], 4), CTL_I=elems(scratch["ctl"][0], 4),
        LPARTS_F=elems(scratch["logits_parts"][0], 4) if g.x_parts > 1 else 0,
        ZPARTS_F=elems(scratch["z_parts"][0], 4) if g.x_parts > 1 else 0,
        PREFETCH=key.prefetch, SCOPE=key.scope, **_m1b_consts(g.m1b), **_m1c_consts(g.m1c),
        TRACE=key.trace,
        SLEEP_NS=0 if _interpreting() else key.poll_sleep_ns,  # the interpreter has no sleep (a timing knob only)
    )
    compiled = Compiled(key, table, _table_rows(table, key.loopback), grid, consts, peer, scratch, data, scratch_lay)
    _CACHE[key] = compiled
    return compiled


def _m1b_consts(m1b) -> dict:
    """The M1B constexprs; without M1B the branch is compiled out and these are 1s."""
    if m1b is None:
        return dict(M1B=False, SPLITS=1, SPLITS_P=1, D_LATENT=1, D_V=1, M1B_SHORT_SPLITS=1, M1B_CHUNK=1,
                    M1B_PAIRS=1, M1B_STAGES=1, M1B_DV=1, W_V_FP8=False)
    return dict(M1B=True, SPLITS=m1b.splits, SPLITS_P=next_pow2(m1b.splits), D_LATENT=m1b.latent, D_V=m1b.value,
                M1B_SHORT_SPLITS=m1b.short_splits, M1B_CHUNK=min(m1b.chunk, m1b.latent), M1B_PAIRS=m1b.pairs,
                M1B_STAGES=m1b.stages, M1B_DV=m1b.block_dv, W_V_FP8=m1b.w_v_fp8)


def _m1c_consts(m1c) -> dict:
    """The M1C constexprs; without M1C the branch is compiled out and these are 1s."""
    if m1c is None:
        return dict(M1C=False, M1C_HEADS=1, M1C_B=1, M1C_BP=1, PAGE_SIZE=1, D_ROPE=1, KV_FP8=False, M1C_BH=1,
                    M1C_HB=1, M1C_BN=1, M1C_STAGES=1)
    return dict(M1C=True, M1C_HEADS=m1c.heads, M1C_B=m1c.requests, M1C_BP=next_pow2(m1c.requests),
                PAGE_SIZE=m1c.page_size, D_ROPE=m1c.rope, KV_FP8=m1c.kv_fp8, M1C_BH=m1c.block_h,
                M1C_HB=m1c.head_blocks, M1C_BN=m1c.block_n, M1C_STAGES=m1c.stages)


# -- the launcher ----------------------------------------------------------------------------

def split_outputs(key: MonoBuild, scratch) -> tuple | None:
    """(o, lse): the split outputs in a rank's flat uint8 ``scratch`` where the
    key's launch writes them itself (M1C), else None."""
    if key.m1c is None:
        return None
    views = region_views(scratch, build(key).scratch_lay)
    return views["split_o"], views["split_lse"]


def check_m1b_inputs(key: MonoBuild, m1b_in, core, splits=None) -> None:
    """m1b_in is given iff ``key`` runs M1b, shaped for the key (the rank's heads,
    its splits, latent width and w_v dtype) and as kernels/mla_back.py takes it.
    ``splits``: the launch's own (o, lse) (split_outputs) where it runs M1c, and
    m1b_in then holds only M1b's weights and gate (mla.M1B_WEIGHTS)."""
    from .kernels.mla_back import FP8, check_mla_back_args
    from .mla import M1B_INPUTS, M1B_WEIGHTS, check_m1b_keys

    if key.m1b is None:
        if m1b_in is not None:
            raise K3InputError("m1b_in: this build runs no M1b (MonoOptions.m1b unset): expected None")
        return
    check_m1b_keys("m1b_in", m1b_in, M1B_INPUTS if key.m1c is None else M1B_WEIGHTS)
    g, S = build(key).table.geometry.m1b, key.tokens
    o, lse = (m1b_in["o"], m1b_in["lse"]) if splits is None else splits
    w_v_dtype = FP8 if g.w_v_fp8 else torch.bfloat16
    expect_tensor("o", o, (g.splits, S, g.heads, g.latent), torch.float32)
    expect_tensor("lse", lse, (g.splits, S, g.heads), torch.float32)
    expect_tensor("w_v", m1b_in["w_v"], (g.heads, g.value, g.latent), w_v_dtype)
    expect_tensor("gate", m1b_in["gate"], (S, g.heads * g.value), torch.bfloat16)
    check_mla_back_args(o, lse, m1b_in["w_v"], m1b_in["gate"], core, m1b_in["w_v_scale"])


def check_m1c_inputs(key: MonoBuild, m1c_in, splits) -> None:
    """m1c_in is given iff ``key`` runs M1c, shaped for the key (the rank's heads,
    S tokens, B requests, page size, widths, kv dtype) and as kernels/mla_attn.py
    takes it; ``splits`` the launch's own (o, lse) it writes (split_outputs).
    The request layout's values are not read (reference.mla.check_requests)."""
    from .kernels.mla_attn import FP8, check_mla_attn_args, shape_text
    from .mla import M1C_INPUTS, check_m1b_keys

    if key.m1c is None:
        if m1c_in is not None:
            raise K3InputError("m1c_in: this build runs no M1c (MonoOptions.m1c unset): expected None")
        return
    check_m1b_keys("m1c_in", m1c_in, M1C_INPUTS)
    g, S = build(key).table.geometry.m1c, key.tokens
    dqk = g.latent + g.rope
    kv = m1c_in["kv"]
    expect_tensor("q", m1c_in["q"], (S, g.heads, dqk), torch.bfloat16)
    if not isinstance(kv, torch.Tensor) or kv.dim() != 3 or tuple(kv.shape[1:]) != (g.page_size, dqk):
        raise K3InputError(f"kv: expected shape [pages, {g.page_size}, {dqk}], got {shape_text(kv)}")
    expect_dtype("kv", kv, FP8 if g.kv_fp8 else torch.bfloat16)
    expect_tensor("seq_lens", m1c_in["seq_lens"], (g.requests,), torch.int32)
    check_mla_attn_args(m1c_in["q"], kv, m1c_in["qsl"], m1c_in["seq_lens"], m1c_in["pages"], m1c_in["indptr"],
                        *splits, m1c_in["kv_scale"])
    if not isinstance(m1c_in["scale"], (int, float)) or isinstance(m1c_in["scale"], bool):
        raise K3InputError(f"scale: expected the softmax scale as a float, got {type(m1c_in['scale']).__name__}")


def _m1b_args(m1b_in, core, splits) -> list:
    """The kernel's M1b arguments (o .. stride_gs); placeholders without M1b.
    o and lse are the launch's own (``splits``) where it runs M1c."""
    if m1b_in is None:
        return [core, 0, 0, 0, core, 0, 0, core, 0, 0, 1.0, core, 0]
    o, lse = (m1b_in["o"], m1b_in["lse"]) if splits is None else splits
    w_v, gate = m1b_in["w_v"], m1b_in["gate"]
    return [o, o.stride(0), o.stride(1), o.stride(2), lse, lse.stride(0), lse.stride(1),
            w_v, w_v.stride(0), w_v.stride(1), float(m1b_in["w_v_scale"]), gate, gate.stride(0)]


def _m1c_args(m1c_in, core) -> list:
    """The kernel's M1c arguments (q .. attn_scale); placeholders without M1c."""
    if m1c_in is None:
        return [core, 0, 0, core, 0, 0, 1.0, core, core, core, core, 1.0]
    q, kv = m1c_in["q"], m1c_in["kv"]
    return [q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.stride(1), float(m1c_in["kv_scale"]), m1c_in["qsl"],
            m1c_in["seq_lens"], m1c_in["pages"], m1c_in["indptr"], float(m1c_in["scale"])]



def _pair(name, value):
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise K3InputError(f"{name}: expected a pair of tensors (the seed's fused tensor, as its two halves)")
    return value


def k2_launch(
    key: MonoBuild,
    *,
    core,
    w_o,
    prefix,
    blocks,
    ares_nw,
    ares_qk,
    in_nw,
    w_gate,
    bias,
    w_ld,
    w_sgu,
    w_sd,
    w13,
    w13s,
    w2,
    w2s,
    ln_w,
    w_up,
    out,
    scratch,
    peers,
    peer_table,
    rank,
    epoch,
    layer,
    health,
    alarm,
    own=None,
    m1b_in=None,
    m1c_in=None,
    trace=None,
) -> None:
    """One rank's layer_post in one launch (on the current stream).

    core [S, C/T] bf16 (the rank's o_proj input; a column view of the whole
    core is fine), prefix [S, H] bf16 updated in place, blocks [S, nb_max, H]
    bf16, out [S, H] bf16; weights as the module docstring maps them.
    scratch: the rank's flat uint8 scratch; peers: the T ranks' flat uint8
    peer buffers (loopback: the rank's own only); peer_table: int64 [NP] on
    the launch's device, the peers' addresses in order (peer_address_table;
    the kernel reads the peers through it); own: the rank's own peer
    buffer (default peers[rank], loopback peers[0]); epoch: int32 [1] device
    word (the launch's epoch; advanced by the launch); health: int32
    [HEALTH_WORDS]; alarm: the wait bound in polls. m1b_in: required iff
    key.m1b (check_m1b_inputs): the launch writes core from it first. m1c_in:
    required iff key.m1c (check_m1c_inputs): the launch writes M1b's split
    outputs into its scratch before that, and m1b_in is M1b's weights only.
    trace: required iff key.trace, int64 [tasks, 4] on the launch's device:
    each ticket's SM, taken, ready and done times (k3mono/trace.py)."""
    from .kernels.common import register_cap
    from .kernels.mono import _mono_kernel

    c = build(key)
    peers = list(peers)
    if len(peers) != c.consts["NP"]:
        raise K3InputError(f"peers: expected {c.consts['NP']} buffers, got {len(peers)}")
    if own is None:
        own = peers[0] if key.loopback else peers[rank]
    expect_tensor("peer_table", peer_table, (len(peers),), torch.int64)
    if peer_table.device != own.device:
        raise K3InputError(f"peer_table: expected on {own.device}, got {peer_table.device}")
    for name, buf, need in [("scratch", scratch, buffer_bytes(c.scratch)), ("own", own, buffer_bytes(c.peer))] + [
        (f"peers[{i}]", p, buffer_bytes(c.peer)) for i, p in enumerate(peers)
    ]:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < need:
            raise K3InputError(f"{name}: expected a flat uint8 buffer of at least {need} bytes")
    splits = split_outputs(key, scratch)
    check_m1b_inputs(key, m1b_in, core, splits)
    check_m1c_inputs(key, m1c_in, splits)
    trace = _trace_arg(key, trace, len(c.table.tasks), health)
    w_sg, w_su = _pair("w_sgu", w_sgu)
    w1, w3 = _pair("w13", w13)
    w1s, w3s = _pair("w13s", w13s)
    check_expert_order(key, w1, w3, w2)
    nb = key.cfg.num_blocks(layer)
    views = lambda b, dt: b.view(dt)  # noqa: E731
    _mono_kernel[(c.grid,)](
        c.rows_on(core.device), core, core.stride(0), *_m1b_args(m1b_in, core, splits),
        *_m1c_args(m1c_in, core), w_o, prefix, prefix.stride(0),
        blocks, blocks.stride(0), blocks.stride(1), nb, ares_nw, ares_qk, in_nw, float(key.cfg.rms_norm_eps),
        w_gate, bias, float(key.cfg.routed_scaling_factor), w_ld, w_sg, w_su, w_sd, w1, w1s, w3, w3s, w2, w2s, ln_w,
        w_up, out, out.stride(0),
        views(scratch, torch.bfloat16), views(scratch, torch.int32), views(scratch, torch.float32),
        views(own, torch.float32), views(own, torch.bfloat16), views(own, torch.int32),
        peer_table,
        rank, epoch, layer, health, int(alarm), len(c.table.tasks), trace,
        **c.consts, num_warps=MONO_WARPS, **register_cap(key.max_registers),
    )


def _trace_arg(key: MonoBuild, trace, num_tasks: int, health):
    """The trace buffer (checked) where the build records one; else a placeholder the kernel never writes."""
    if not key.trace:
        if trace is not None:
            raise K3InputError("trace: given, but the build records no trace (MonoBuild.trace)")
        return health
    expect_tensor("trace", trace, (num_tasks, TRACE_WORDS), torch.int64)
    if trace.device != health.device:
        raise K3InputError(f"trace: expected on {health.device}, got {trace.device}")
    return trace


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes two tensors span (first element to last) intersect."""
    def span(t):
        last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1


def peer_address_table(peers, device) -> torch.Tensor:
    """int64 [NP] on ``device``: each peer buffer's address, in order (k2_launch's peer_table)."""
    return torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=device)


def launch_args(w: LayerWeights, expert_words: ExpertOrderCache | None = None) -> dict:
    """The seed's weight argument names for a rank's shard; with ``expert_words``
    (TileChoice.expert_mma or expert_f16) w13 and w2 in that cache's order
    (k3mono.mxfp4.mma_order, f16_order): hold the result, not the shard, across launches."""
    order = expert_words if expert_words is not None else (lambda packed: packed)
    return dict(
        w_o=w.o_proj, ares_nw=w.ares_norm, ares_qk=w.ares_proj, in_nw=w.post_norm, w_gate=w.router,
        bias=w.router_bias, w_ld=w.latent_down, w_sgu=(w.shared_gate, w.shared_up), w_sd=w.shared_down,
        w13=(order(w.w1_packed), order(w.w3_packed)), w13s=(w.w1_scale, w.w3_scale), w2=order(w.w2_packed),
        w2s=w.w2_scale, ln_w=w.latent_norm, w_up=w.latent_up,
    )


def check_expert_order(key: MonoBuild, w1, w3, w2) -> None:
    """The expert weights in the order the build reads (k3mono.mxfp4.expert_order)."""
    _, want, order = expert_order(key.tiles)
    for name, t in (("w13[0]", w1), ("w13[1]", w3), ("w2", w2)):
        if not isinstance(t, torch.Tensor) or t.dtype != want:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise K3InputError(f"{name}: expected {want} ({order}), got {got}")


# -- one rank ---------------------------------------------------------------------------------


class MonoTimeout(RuntimeError):
    """A wait of the mono launch ran out of polls (the health record says which)."""


@dataclass(eq=False)
class RankBuffers:
    """What one rank's launches share across layers: its scratch, its own peer
    buffer ``own`` among the ``peers`` it pushes into (NP of them: every
    rank's, or in loopback only ``[own]``), the epoch word, the health record,
    and what a timeout broke. Every layer of one build family runs on one set
    (MonoRank.for_layer): their launches run in stream order, so each finds the
    scratch free, the epoch one past the last launch's whichever layer ran it,
    every flag at the last epoch's count (one task table), and the peer regions
    of the parity the last launch did not use. After a timeout the set is broken
    (flags and epoch words no longer agree) for every layer on it, until
    MonoRank.reset() on every rank of the group at once."""

    scratch: torch.Tensor  # uint8 [scratch bytes]
    own: torch.Tensor  # uint8 [peer bytes]
    peers: list  # NP x uint8 [peer bytes]
    epoch_word: torch.Tensor  # int32 [1]: the epoch the next launch runs
    health: torch.Tensor  # int32 [HEALTH_WORDS]
    broken: str | None = None  # the timeout that broke them
    symmetric_handle: object = None  # keeps a symmetric-memory mapping of the peers alive
    _table: torch.Tensor | None = None
    _table_for: list | None = None

    @classmethod
    def allocate(cls, compiled: Compiled, own: torch.Tensor, peers) -> "RankBuffers":
        """Scratch, epoch word (epoch 1) and health on ``own``'s device for a build's launches."""
        from .kernels.sync import HEALTH_WORDS

        dev = own.device
        buffers = cls(scratch=torch.zeros(buffer_bytes(compiled.scratch), dtype=torch.uint8, device=dev), own=own,
                      peers=list(peers), epoch_word=torch.ones(1, dtype=torch.int32, device=dev),
                      health=torch.zeros(HEALTH_WORDS, dtype=torch.int32, device=dev))
        buffers.peer_table()  # made here, so that even a first launch may be captured in a CUDA graph
        return buffers

    def peer_table(self) -> torch.Tensor:
        """The peers' address table, remade (host side, no sync) if ``peers`` was reassigned."""
        addresses = [p.data_ptr() for p in self.peers]
        if self._table_for != addresses:
            self._table, self._table_for = peer_address_table(self.peers, self.own.device), addresses
        return self._table


class MonoRank:
    """One rank's launch of one layer: its build, the layer's shard, input copies
    (core columns, prefix) and out, on ``buffers`` (RankBuffers: scratch, peer
    buffers, epoch word, health), which other layers' ranks may share
    (``for_layer``).

    A rank is what one process of an engine holds; ``MonoRunner`` holds T of
    them on one device, ``rankjob.mono_rank_worker`` one per spawned process."""

    def __init__(self, key: MonoBuild, shard: LayerWeights, rank: int, buffers: RankBuffers, *, layer: int,
                 spin_limit: int, expert_words: ExpertOrderCache | None = None):
        self.key, self.compiled, self.rank, self.layer = key, build(key), rank, layer
        self.buffers = buffers
        self.spin_limit = spin_limit
        cfg, S, dev = key.cfg, key.tokens, buffers.own.device
        self.compiled.rows_on(dev)  # the task table on the device now, so that even a first launch may be captured
        # k3mono/trace.py reads it: the last launch's tickets (trace builds only)
        self.trace = (torch.zeros((len(self.compiled.table.tasks), TRACE_WORDS), dtype=torch.int64, device=dev)
                      if key.trace else None)
        self.core = torch.empty((S, cfg.core_width // key.tp), dtype=torch.bfloat16, device=dev)
        self.prefix = torch.empty((S, cfg.hidden_size), dtype=torch.bfloat16, device=dev)
        self.out = torch.empty((S, cfg.hidden_size), dtype=torch.bfloat16, device=dev)
        self.blocks = None
        self.m1b_in = None  # M1b builds: the rank's heads' M1b inputs (load_m1b_inputs)
        self.m1c_in = None  # M1c builds: the rank's heads' M1c inputs (load_m1b_inputs)
        # the runner's cache where its ranks share tensors, else this rank's own (None: the checkpoint's bytes)
        self.expert_words = expert_words if expert_words is not None else expert_order_cache(key.tiles)
        self._args = launch_args(shard, self.expert_words)

    def for_layer(self, layer: int, shard: LayerWeights) -> "MonoRank":
        """This rank's launch of ``layer`` (``shard``: that layer's weights of this
        rank) on this rank's buffers: an engine holds one RankBuffers a rank per
        token count and option set, not one per layer (at T = 8, S = 16 a peer
        buffer is 18.7 MB). The build differs at most in the AttnRes candidate
        pad (the layer's block count), which changes neither the task table nor
        a buffer's layout. Launches of the two run in stream order. Each keeps
        its own out and prefix copy; its routes and logits (``result()``) are
        in the shared buffers, valid until the next launch on them."""
        from .kernels.attnres import num_candidates_pad

        cfg = self.key.cfg
        cfg.validate_layer(layer)
        check_shard("shard", shard, cfg, self.key.tp, self.rank)
        check_same_device(("the rank's buffers", self.buffers.own),
                          *((f"shard.{name}", t) for name, t in shard.tensors().items()))
        key = dataclasses.replace(self.key, cands=num_candidates_pad(cfg.num_blocks(layer)))
        return MonoRank(key, shard, self.rank, self.buffers, layer=layer, spin_limit=self.spin_limit,
                        expert_words=self.expert_words)

    def timing_variant(self, how: str, kind) -> "MonoRank":
        """This rank's launch on a timing variant of its table (planner.timing_variant:
        skip or double one task kind), sharing every buffer, flag and epoch word
        of this rank: launch the plain rank first, the variant then reads what it
        wrote. Its outputs are not layer_post's; its time is the point."""
        varied = copy.copy(self)
        varied.key = dataclasses.replace(self.key, variant=(how, int(kind)))
        varied.compiled = build(varied.key)
        if self.key.trace:  # the variant's own tickets
            varied.trace = torch.zeros((len(varied.compiled.table.tasks), TRACE_WORDS), dtype=torch.int64,
                                       device=self.trace.device)
        return varied

    # -- views -------------------------------------------------------------------------------
    def parity_views(self, parity: int) -> dict:
        off, n = self.compiled.peer[f"parity{parity}"]
        return region_views(self.buffers.own[off : off + n], self.compiled.data)

    def flags(self) -> torch.Tensor:
        off, n = self.compiled.peer["flags"]
        return self.buffers.own[off : off + n].view(torch.int32)[: self.compiled.table.num_flag_words]

    def scratch(self) -> dict:
        return region_views(self.buffers.scratch, self.compiled.scratch_lay)

    def ctl(self) -> torch.Tensor:
        off, _ = self.compiled.scratch["ctl"]
        return self.buffers.scratch[off : off + 4 * CTL_WORDS].view(torch.int32)

    def epoch(self) -> int:
        """The epoch the next launch will run (the last launch ran epoch() - 1)."""
        return int(self.buffers.epoch_word.item())

    # -- a run -------------------------------------------------------------------------------
    def load_inputs(self, core, prefix, blocks) -> None:
        """Copies of this rank's core columns and of prefix; ``blocks`` is read in place
        (contiguous in its last dim). The caller has validated them."""
        width = self.core.shape[1]
        self.core.copy_(core[:, self.rank * width : (self.rank + 1) * width])
        self.prefix.copy_(prefix)
        self.blocks = blocks

    def bind(self, core, prefix, blocks, out) -> None:
        """The caller's own tensors in place of this rank's copies (plain layers):
        the launch reads core [S, C/T] (this rank's columns; a column view of the
        whole core is fine) and blocks [S, nb_max, H], updates prefix [S, H] in
        place and writes out [S, H], all bf16 on the buffers' device with unit
        stride in the last dim. An engine binds its activation tensors once and
        captures launch() alone: one kernel a layer in its graph, no copies beside
        it. Checked here, before any launch; load_inputs then copies into them."""
        if self.key.m1b is not None:
            raise K3InputError("core: this rank's launch runs M1b and writes core itself; bind takes plain layers")
        cfg, S = self.key.cfg, self.key.tokens
        expect_tensor("core", core, (S, cfg.core_width // self.key.tp), torch.bfloat16)
        expect_tensor("prefix", prefix, (S, cfg.hidden_size), torch.bfloat16)
        check_blocks(cfg, self.layer, blocks, S)
        expect_tensor("out", out, (S, cfg.hidden_size), torch.bfloat16)
        named = {"core": core, "prefix": prefix, "blocks": blocks, "out": out}
        check_same_device(("the rank's buffers", self.buffers.own), *named.items())
        check_unit_stride(*named.items())
        for written in ("prefix", "out"):  # the launch writes them while it still reads the others
            for name, t in named.items():
                if name != written and _overlap(named[written], t):
                    raise K3InputError(f"{written}: expected memory of its own, got bytes within {name}'s span")
        self.core, self.prefix, self.blocks, self.out = core, prefix, blocks, out

    def load_m1b_inputs(self, m1b_in, prefix, blocks, m1c_in=None) -> None:
        """An MLA layer (M1b build): this rank's heads' M1b inputs (checked, then
        read in place: the launch writes core from them), with M1c (M1c build)
        its M1c inputs too, a copy of prefix; ``blocks`` as load_inputs."""
        splits = split_outputs(self.key, self.buffers.scratch)
        check_m1b_inputs(self.key, m1b_in, self.core, splits)
        check_m1c_inputs(self.key, m1c_in, splits)
        self.m1b_in = dict(m1b_in)
        self.m1c_in = None if m1c_in is None else dict(m1c_in)
        self.prefix.copy_(prefix)
        self.blocks = blocks

    def poison(self, peer_regions: bool) -> None:
        """NaN / -1 into the scratch data regions (the split outputs included)
        and out (not ctl), and into core where the launch writes it (M1b); with
        ``peer_regions`` also into both parities of the own peer buffer (only
        safe while no other rank can be pushing into it)."""
        for t in self.scratch().values():
            t.fill_(float("nan") if t.dtype.is_floating_point else -1)
        self.out.fill_(float("nan"))
        if self.key.m1b is not None:
            self.core.fill_(float("nan"))
        if peer_regions:
            for parity in (0, 1):
                for t in self.parity_views(parity).values():
                    t.fill_(float("nan"))

    def launch(self) -> None:
        """This rank's launch on the current stream (no sync, no health check)."""
        b = self.buffers
        if b.broken:
            raise RuntimeError(f"mono rank {self.rank}: broken by an earlier timeout ({b.broken}); call reset()")
        k2_launch(
            self.key, core=self.core, prefix=self.prefix, blocks=self.blocks, **self._args, out=self.out,
            scratch=b.scratch, peers=b.peers, peer_table=b.peer_table(), rank=self.rank, epoch=b.epoch_word,
            layer=self.layer, health=b.health, alarm=self.spin_limit, own=b.own, m1b_in=self.m1b_in,
            m1c_in=self.m1c_in, trace=self.trace,
        )

    def check_health(self) -> None:
        """Raise MonoTimeout naming rank, task, flag, expected and seen on a failed wait
        (and, across ranks, the first exchange with ranks none of whose pushes arrived)."""
        from .kernels import sync

        h = self.buffers.health.tolist()
        if not h[sync.H_ALARM]:
            return
        table = self.compiled.table
        ticket, word = h[sync.H_TICKET], h[sync.H_WORD]
        task = table.tasks[ticket] if 0 <= ticket < len(table.tasks) else None
        try:
            flag, index = table.flag_of_word(word)
            flag_name = f"{flag.name}[{index}]"
        except IndexError:
            flag, flag_name = None, "?"
        what = f"{task.kind.name} tile {task.tile} token {task.token}" if task else "?"
        broken = (
            f"rank {h[sync.H_RANK]} layer {h[sync.H_LAYER]} epoch {h[sync.H_EPOCH]}: ticket {ticket} ({what}) "
            f"timed out waiting for flag {flag_name} (word {word}): expected {h[sync.H_EXPECTED]}, "
            f"seen {h[sync.H_SEEN]} ({h[sync.H_ALARM]} failed wait(s) on rank {self.rank})"
        )
        if self.key.tp > 1 and not self.key.loopback:
            broken += self._stalled_exchange(h[sync.H_EPOCH] & 1)
        self.buffers.broken = broken
        raise MonoTimeout(f"mono launch: {broken}")

    def _stalled_exchange(self, parity: int) -> str:
        """The first exchange, in the launch's order, that misses some rank's push.

        The failed wait on record need not be the exchange's own: every wait has
        the same bound, so one downstream of the stall (a local flag that the
        stalled reduce would have raised) can run out first."""
        for flag in sorted(PEER_FLAGS):
            region = flag.name.lower()
            absent = self.absent_pushes(region, parity)
            if absent:
                return f"; exchange {region}: nothing arrived from rank(s) {absent}"
        return ""

    def absent_pushes(self, region: str, parity: int) -> list[int]:
        """Other ranks whose part of ``region`` (a slot, or a column block) is still
        all poison (NaN): valid after ``poison(peer_regions=True)``."""
        view, tp = self.parity_views(parity)[region], self.key.tp
        if region in SLOT_EXCHANGES:
            parts = [view[t] for t in range(tp)]
        else:
            width = view.shape[1] // tp
            parts = [view[:, t * width : (t + 1) * width] for t in range(tp)]
        return [t for t, part in enumerate(parts) if t != self.rank and bool(torch.isnan(part.float()).all())]

    def reset(self) -> None:
        """Zero flags, control words and health; epoch 1 (for every layer on these buffers)."""
        self.flags().zero_()
        self.ctl().zero_()
        self.buffers.health.zero_()
        self.buffers.epoch_word.fill_(1)
        self.buffers.broken = None

    def result(self) -> StagedResult:
        sc = self.scratch()
        return StagedResult(
            moe_out=self.out.clone(),
            prefix=self.prefix.clone(),
            route_ids=sc["route_ids"].to(torch.int64),
            route_weights=sc["route_w"].clone(),
            router_logits=self.parity_views((self.epoch() - 1) & 1)["logits"].clone(),
        )


def distributed_mono_rank(cfg: K3Config, shard: LayerWeights, tokens: int, layer: int, *, group=None, device,
                          spin_limit: int = DEFAULT_SPIN, options: MonoOptions | None = None) -> MonoRank:
    """This process's rank of ``group`` (default: the world), its peer buffers
    set up through symmetric memory over the group (collective: every rank of
    the group calls it with the same cfg, tokens, layer and options). Flags
    are system-scope: peers write over NVLink or from other processes. The
    other layers of the same tokens and options take the same buffers
    (``for_layer``, no collective): every rank then launches the layers in the
    same order. A shard whose experts were turned in place
    (weights.experts_in_f16_order_) is read as it is; one of the checkpoint's
    bytes is turned into a copy held by the rank."""
    import torch.distributed as dist

    from .peers import symmetric_buffers

    group = group or dist.group.WORLD
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    if shard.tp != tp or shard.rank != rank:
        raise K3InputError(f"shard: expected rank {rank} of {tp} (the group's), got rank {shard.rank} of {shard.tp}")
    key = mono_key(cfg, tokens, tp, layer, loopback=False, sms=device_sms(device), options=options, scope="sys")
    peers, handle = symmetric_buffers(buffer_bytes(build(key).peer), device, group)
    buffers = RankBuffers.allocate(build(key), peers[rank], peers)
    buffers.symmetric_handle = handle
    return MonoRank(key, shard, rank, buffers, layer=layer, spin_limit=spin_limit)


def launch_concurrently(ranks, streams, events=None) -> None:
    """Each rank's launch on its own stream, after the current stream's work and
    before its next: T launches in flight at once (their cross-rank waits need
    it). ``events``: optional (start, end) CUDA event pairs, one per rank,
    recorded around its launch on its stream."""
    if len(streams) != len(ranks):
        raise K3InputError(f"streams: expected one per rank ({len(ranks)}), got {len(streams)}")
    current = torch.cuda.current_stream()
    for stream in streams:
        stream.wait_stream(current)
    for i, (rank, stream) in enumerate(zip(ranks, streams)):
        with torch.cuda.stream(stream):
            if events is not None:
                events[i][0].record(stream)
            rank.launch()
            if events is not None:
                events[i][1].record(stream)
    for stream in streams:
        current.wait_stream(stream)


# -- T ranks on one device --------------------------------------------------------------------


def device_sms(device) -> int:
    """The SMs a launch's grid is planned for: 1 under the interpreter (one program)."""
    return 1 if _interpreting() else torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


def mono_key(cfg: K3Config, tokens: int, tp: int, layer: int, *, loopback: bool, sms: int,
             options: MonoOptions | None = None, prefetch: int = DEFAULT_PREFETCH, scope: str = "gpu",
             max_registers: int | None = None, trace: bool = False) -> MonoBuild:
    """The build key of a rank's launch for ``layer`` (its AttnRes candidate pad),
    the measured defaults (default_options, DEFAULT_PREFETCH) unless given; the
    register cap, unless given, the one that keeps options.ctas_per_sm CTAs
    resident (planner.resident_register_cap)."""
    from .kernels.attnres import num_candidates_pad

    options = options or default_options(tokens)
    if max_registers is None:
        max_registers = resident_register_cap(options.ctas_per_sm)
    return MonoBuild(cfg=cfg, tokens=tokens, tp=tp, opt=options.bits(), cands=num_candidates_pad(cfg.num_blocks(layer)),
                     loopback=loopback, sms=sms, ctas_per_sm=options.ctas_per_sm, prefetch=prefetch, scope=scope,
                     m1b=options.m1b, m1c=options.m1c, max_registers=max_registers,
                     tiles=options.tiles, trace=trace, poll_sleep_ns=options.poll_sleep_ns)


class MonoRunner:
    """layer_post through the mono launch, T = len(shards) ranks on one device.

    ``rank_states[r]`` is rank r's MonoRank; their peer buffers are ordinary
    tensors of this device. loopback (the default for T > 1): each rank runs
    alone against the others' pushes pre-written from a staged run; full
    (loopback=False, T > 1): the T launches must run at once, so ``run`` takes
    one stream a rank (``peers.green_streams``: disjoint SM partitions, and
    ``sms`` the SMs of one partition, for which the grid is planned).
    ``layer_post(core, prefix, blocks)`` returns rank 0's outputs
    (staged.StagedResult); ``rank_results()`` every rank's. With
    ``options.m1b`` (an MLA layer) ``layer_post_mla(m1b_in, prefix, blocks)``
    instead: one dict of M1b inputs a rank (check_m1b_inputs); with
    ``options.m1c`` also ``m1c_in=``, one dict of M1c inputs a rank
    (check_m1c_inputs), and m1b_in holds M1b's weights and gate only."""

    def __init__(self, cfg: K3Config, shards, tokens: int, layer: int, *, device=None, loopback=None,
                 options: MonoOptions | None = None, prefetch: int = DEFAULT_PREFETCH,
                 spin_limit: int | None = None, sms: int | None = None, max_registers: int | None = None,
                 trace: bool = False):
        from .peers import local_buffers

        cfg.validate_layer(layer)
        if not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
            raise K3InputError(f"tokens: expected an integer in 1..{MAX_TOKENS}, got {tokens!r}")
        self.tp = _check_shards(cfg, shards)
        self.cfg, self.shards, self.tokens, self.layer = cfg, list(shards), tokens, layer
        self.device = torch.device(device) if device is not None else shards[0].o_proj.device
        if self.device != shards[0].o_proj.device:
            raise K3InputError(f"device: the shards live on {shards[0].o_proj.device}, not {self.device}")
        self.loopback = self.tp > 1 if loopback is None else bool(loopback)
        self.key = mono_key(cfg, tokens, self.tp, layer, loopback=self.loopback, sms=sms or device_sms(self.device),
                            options=options, prefetch=prefetch, max_registers=max_registers, trace=trace)
        self.compiled = build(self.key)
        spin = spin_limit if spin_limit is not None else (INTERPRET_SPIN if _interpreting() else DEFAULT_SPIN)
        buffers = local_buffers(self.tp, buffer_bytes(self.compiled.peer), self.device)
        # tiles.expert_mma / expert_f16: each distinct expert tensor in that order once, for every rank and the
        # staged prewrite
        self.expert_words = expert_order_cache(self.key.tiles)
        self.rank_states = [
            MonoRank(self.key, self.shards[r], r,
                     RankBuffers.allocate(self.compiled, buffers[r], [buffers[r]] if self.loopback else buffers),
                     layer=layer, spin_limit=spin, expert_words=self.expert_words)
            for r in self.ranks
        ]
        self._staged = None

    def for_layer(self, layer: int, shards) -> "MonoRunner":
        """A runner of ``layer`` (``shards``: its weights, one a rank) on this
        runner's buffers (MonoRank.for_layer): one set of buffers serves every
        layer of a token count. The two runners' calls run one after the other."""
        if _check_shards(self.cfg, shards) != self.tp:
            raise K3InputError(f"shards: expected {self.tp} (this runner's ranks), got {len(shards)}")
        other = copy.copy(self)
        other.shards, other.layer, other._staged = list(shards), layer, None
        other.rank_states = [rank.for_layer(layer, shard) for rank, shard in zip(self.rank_states, shards)]
        other.key, other.compiled = other.rank_states[0].key, other.rank_states[0].compiled
        return other

    @property
    def ranks(self) -> range:
        return range(self.tp)

    @property
    def health(self) -> list[torch.Tensor]:
        return [r.buffers.health for r in self.rank_states]

    # -- views of rank ``rank`` -------------------------------------------------------------
    def parity_views(self, rank: int, parity: int) -> dict:
        return self.rank_states[rank].parity_views(parity)

    def flags(self, rank: int) -> torch.Tensor:
        return self.rank_states[rank].flags()

    def scratch(self, rank: int) -> dict:
        return self.rank_states[rank].scratch()

    def ctl(self, rank: int) -> torch.Tensor:
        return self.rank_states[rank].ctl()

    def epoch(self, rank: int = 0) -> int:
        return self.rank_states[rank].epoch()

    # -- a run -------------------------------------------------------------------------------
    def _checked_activations(self, core, prefix, blocks):
        """blocks, contiguous in its last dim, once core, prefix and blocks passed the checks."""
        tokens = check_layer_inputs(self.cfg, self.layer, core, prefix, blocks)
        if tokens != self.tokens:
            raise K3InputError(f"core: expected {self.tokens} tokens (this MonoRunner's build), got {tokens}")
        for name, t in (("core", core), ("prefix", prefix), ("blocks", blocks)):
            if t.device != self.device:
                raise K3InputError(f"{name}: expected device {self.device}, got {t.device}")
        return blocks if blocks.stride(-1) == 1 else blocks.contiguous()

    def load_inputs(self, core, prefix, blocks) -> None:
        if self.key.m1b is not None:
            raise K3InputError("core: this MonoRunner runs M1b and writes core itself; use layer_post_mla(m1b_in, ...)")
        blocks = self._checked_activations(core, prefix, blocks)
        for rank in self.rank_states:
            rank.load_inputs(core, prefix, blocks)
        if self.loopback and self.tp > 1:
            self._prewrite(core, prefix, blocks)

    def load_mla_inputs(self, m1b_in, prefix, blocks, m1c_in=None) -> None:
        """An MLA layer's inputs (M1b build): m1b_in one dict a rank, with M1c
        (M1c build) m1c_in one dict a rank too, every one checked before
        anything runs. In loopback the other ranks' pushes come from the core
        every rank's staged M1c (M1c build; mla.with_split_outputs: the split
        outputs the other ranks' launches would write) and M1b write."""
        from .mla import folded_attn_tile, rank_cores, with_split_outputs
        from .reference.mla import check_requests

        if self.key.m1b is None:
            raise K3InputError("m1b_in: this MonoRunner runs no M1b (options.m1b unset); use layer_post(core, ...)")
        self._check_per_rank("m1b_in", "M1b", m1b_in)
        if self.key.m1c is not None:
            self._check_per_rank("m1c_in", "M1c", m1c_in)
        elif m1c_in is not None:
            raise K3InputError("m1c_in: this MonoRunner runs no M1c (options.m1c unset): expected None")
        for r, rank in enumerate(self.rank_states):
            splits = split_outputs(self.key, rank.buffers.scratch)
            check_m1b_inputs(self.key, m1b_in[r], rank.core, splits)
            check_m1c_inputs(self.key, None if m1c_in is None else m1c_in[r], splits)
            if m1c_in is not None:
                check_requests(*(m1c_in[r][name] for name in ("q", "kv", "qsl", "seq_lens", "pages", "indptr")))
        # core is the launch's own output: a stand-in of its shape lets the shared check judge prefix and blocks
        shape_of_core = torch.empty((self.tokens, self.cfg.core_width), dtype=torch.bfloat16, device=self.device)
        blocks = self._checked_activations(shape_of_core, prefix, blocks)
        for r, rank in enumerate(self.rank_states):
            rank.load_m1b_inputs(m1b_in[r], prefix, blocks, None if m1c_in is None else m1c_in[r])
        if self.loopback and self.tp > 1:
            back_in = m1b_in if m1c_in is None else with_split_outputs(
                m1c_in, m1b_in, self.key.m1b.splits, folded_attn_tile(self.compiled.table.geometry.m1c))
            self._prewrite(rank_cores(back_in), prefix, blocks)

    def _check_per_rank(self, name: str, what: str, per_rank) -> None:
        if not isinstance(per_rank, (list, tuple)) or len(per_rank) != self.tp:
            got = len(per_rank) if isinstance(per_rank, (list, tuple)) else type(per_rank).__name__
            raise K3InputError(f"{name}: expected one dict of {what} inputs a rank ({self.tp}), got {got}")

    def _prewrite(self, core, prefix, blocks) -> None:
        """Every rank's buffer gets the other ranks' pushes of this input (a staged
        run at the launch's tiles: the bits the other ranks' launches would push),
        in both parities; its own slots / columns are poisoned (NaN)."""
        from .staged import StagedLayer

        if self._staged is None:
            self._staged = StagedLayer(self.cfg, self.shards, self.tokens, self.layer, tiles=self.key.tiles,
                                       expert_words=self.expert_words)
        self._staged.load_inputs(core, prefix, blocks)
        self._staged.run()
        T = self.tp
        for r in self.ranks:
            for parity in (0, 1):
                views = self.parity_views(r, parity)
                for name, t in views.items():
                    t.copy_(self._staged.peer[r][name])
                for name in SLOT_EXCHANGES:
                    views[name][r].fill_(float("nan"))
                for name in ("logits", "z"):
                    w = views[name].shape[1] // T
                    views[name][:, r * w : (r + 1) * w].fill_(float("nan"))

    def poison(self) -> None:
        """NaN / -1 into every rank's scratch data regions and out; without loopback
        also into the peer regions (nothing is in flight between runs)."""
        for rank in self.rank_states:
            rank.poison(peer_regions=not self.loopback)

    def launch(self, rank: int) -> None:
        """Rank ``rank``'s launch (no sync, no health check)."""
        self.rank_states[rank].launch()

    def check_health(self) -> None:
        for rank in self.rank_states:
            rank.check_health()

    def reset(self) -> None:
        """Zero every rank's flags, control words and health; epoch 1 (after a timeout)."""
        for rank in self.rank_states:
            rank.reset()

    def run(self, streams=None, events=None) -> None:
        """Every rank's launch, then sync and the health check. Without loopback
        (T > 1) ``streams`` (one a rank) is required: the launches run at once."""
        if streams is not None:
            launch_concurrently(self.rank_states, streams, events)
        elif not self.loopback and self.tp > 1:
            raise K3InputError(
                "MonoRunner: T > 1 without loopback needs the T launches running at once (blocking cross-rank "
                "waits): pass one stream a rank (peers.green_streams), or use loopback"
            )
        else:
            for rank in self.rank_states:
                rank.launch()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.check_health()

    def result(self, rank: int = 0) -> StagedResult:
        return self.rank_states[rank].result()

    def rank_results(self) -> list[StagedResult]:
        return [rank.result() for rank in self.rank_states]

    def layer_post(self, core, prefix, blocks, streams=None) -> StagedResult:
        """One layer_post: rank 0's outputs; ``prefix`` itself is not modified."""
        self.load_inputs(core, prefix, blocks)
        self.poison()
        self.run(streams)
        return self.result(0)

    __call__ = layer_post

    def layer_post_mla(self, m1b_in, prefix, blocks, streams=None, m1c_in=None) -> StagedResult:
        """One MLA layer's layer_post with M1b (and M1c, with m1c_in) in the launch:
        rank 0's outputs."""
        self.load_mla_inputs(m1b_in, prefix, blocks, m1c_in)
        self.poison()
        self.run(streams)
        return self.result(0)
