"""Geometry of the stage kernels: how each stage's work is cut into tasks.

Every block size the kernels use is chosen here, from the shapes alone, so a
kernel file holds no magic numbers. Why these values:

* GEMV stages read each weight byte once; a task streams ``rows`` weight rows
  of ``block_k`` columns at a time, always along K (the contiguous dim), so a
  thread's weight load is a 16-byte vector. Both tiles below put 8 KB of weight
  in flight per program and step (4 warps, 64 bytes a thread), so a few
  resident programs per SM cover the ~32 KB an SM needs to hide HBM latency.
* Up to ``FMA_MAX_TOKENS`` tokens (the most kernels/gemv.py keeps FMA
  accumulators for) the dense GEMVs run on CUDA-core FMAs: at 4 tokens that
  is 4 FMAs per weight element, well under the FMA rate HBM can feed. The FMA
  tile is 8 rows x 512 columns: few rows per task spread the stages with few
  output rows (the router: E/T = 112 rows at T = 8) over more SMs. Above it
  the tokens are padded to 16 (``tokens_pad``) and the GEMVs use tl.dot (the
  tensor cores do the padded work for free, while 5 to 16 FMAs per weight
  element would not keep up with HBM); tl.dot needs 16 rows, so that tile is
  16 x 256.
* ``rows`` (tasks = ceil(out / rows): the o_proj at T = 8 has 7168 rows, 896 FMA
  tasks) and ``block_k`` never exceed the dims they cover (rounded up to a power
  of two; masks handle the rest), except where tl.dot needs 16.
* Vector stages loop over the hidden size in ``vector_block`` columns (8
  fp32 a thread at 4 warps: two 16-byte loads per rank slot). The norms and
  AttnRes need a whole row, so they take one token per program; the reduces
  (AR1 + prefix, AR3) are elementwise and take one token's chunk of
  ``vector_block`` columns per program (S * H / vector_block programs).
* M1b (the MLA back-end, kernels/mla_back.py) cuts a rank's heads into tasks
  of ``BACK_BLOCK_DV`` value rows of one head, each for all S tokens, so each
  w_v tile is read once a launch (``M1bGeometry``).
* M1c (the MLA decode attention, kernels/mla_attn.py) cuts the work into one
  task (or program) a query token, context split and ``ATTN_BLOCK_H`` heads,
  ``attn_steps``: context positions a step and the context loop's pipeline
  stages, by the cache's dtype (``M1cGeometry``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from .config import MAX_TOKENS, MXFP4_GROUP, K3Config
from .errors import K3InputError
from .weights import shard_shapes

DOT_MIN_TOKENS = 16
"""tl.dot needs at least 16 rows in its first operand (and 16 columns in its second)."""

FMA_MAX_TOKENS = 4
"""The most tokens the dense GEMVs serve with CUDA-core FMAs; above, tl.dot."""

X_FMA_MAX_TOKENS = 8
"""The most tokens a router or latent down task serves with FMAs (their token
groups, TileChoice.x_group_tokens; kernels/gemv.py FMA_MAX_SP): a tl.dot task
needs 16 weight rows and streams them alone, a FMA task needs 1 to 8."""

FMA_TILE = (8, 512)
"""(rows, block_k) of a dense GEMV task on the FMA path: 8 KB of bf16 weight a step."""

DOT_TILE = (16, 256)
"""(rows, block_k) of a dense GEMV task on the tl.dot path: 8 KB of bf16 weight a step."""

DENSE_STEP_KB = 8
DENSE_STEP_KB_CHOICES = (8, 16, 32)
"""KB of bf16 weight a dense GEMV tile loads a step (FMA_TILE and DOT_TILE);
the mono launch may widen it (TileChoice.dense_step_kb): with only 2 CTAs a
SM resident (the persistent kernel's registers) it keeps 2 steps in flight an
SM, half of the ~32 KB HBM latency wants, and the o_proj's K = C/T = 1536 at
T = 8 is only 3 steps of 512, each a full memory round trip. Measured on the
H200 (docs/PERF.md, 2026-12-03): 16 and 32 KB were slower; 8 stays. The shared
gate/up tasks may take their own (TileChoice.shared_step_kb): at TP8, S = 1 a
shared task is a latency-bound chain of 28 steps of 8 KB, where o_proj's are few
(mono.SINGLE_TOKEN_SHARED_STEP_KB); so may the o_proj tasks
(TileChoice.oproj_step_kb): every other task waits for them, and a 32-row task at
S = 1 is 12 steps of 8 KB, one in flight (kernels/gemv.py: Triton's pipelined
range for this loop, cp.async 2 or 3 steps ahead, made the mono launch slower
on an H100, 69.6 -> 110.3 / 97.6 us at S = 1; docs/PERF.md, twenty-sixth
session). The S = 1 router's one-row tasks (14 KB at TP8, two 8 KB steps on
the chain from the seam to the route) in one 16 KB step gained nothing (one
H100, defaults_ab.py, a router_step_kb field since removed: 69.1, 69.4 us at
8 KB against 69.4, 69.4; docs/PERF.md, thirty-fourth session)."""


SHARED_ROWS = FMA_TILE[0]
SHARED_ROWS_CHOICES = (2, 4, 8)
"""Rows of a shared-expert gate/up task on the FMA path (TileChoice.shared_rows;
the tl.dot path keeps DOT_TILE's 16). Its 96 tasks at 8 rows (TP8, S = 1) start
with the router's once x is ready and stream 229 KB each, a step a memory round
trip: the trace had them running 18 us a task, still busy 9 us after the route
was known, on CTAs the expert tasks then lacked (skipping them saved 6.7 us at
S = 1, benchmarks/mono_variants.py). Fewer rows: more, shorter tasks of the same
bytes a step."""

ROUTER_ROWS = 2
ROUTER_ROWS_CHOICES = (1, 2, 4, 8)
"""Rows of a router task on the FMA path (S <= FMA_MAX_TOKENS, or X_TOKEN_GROUPS; tl.dot needs 16).
The router is on the latency chain (x -> logits -> route -> experts) and has
only E/T = 112 rows at T = 8: 8 rows a task made 14 tasks, each streaming 115 KB
alone, a step (8 KB) a memory round trip (the trace: 9.5 us a task at S = 1).
2 rows make 56 tasks of the same bytes a step, a quarter of the steps each:
measured on the H200 (benchmarks/mono_sweep.py, docs/PERF.md), S = 1 went from
111.3 to 106.8 us (mono) and from 110.6 to 105.2 (staged) in one run."""

LATENT_ROWS = FMA_TILE[0]
LATENT_ROWS_CHOICES = (2, 4, 8)
"""Rows of a latent down-projection task on the FMA path (TileChoice.latent_rows;
the tl.dot path keeps DOT_TILE's 16). Its z gates the expert tasks beside the
route: at 8 rows (56 tasks at TP8, 115 KB each, a step a memory round trip) the
S = 1 trace had them done with the route, 8.6 us a task. Fewer rows: more,
shorter tasks of the same bytes a step, as ROUTER_ROWS. Measured on one H200
(benchmarks/mono_sweep.py, the mono defaults otherwise), router / latent rows:
S = 1 2 / 8 74.3 us, 2 / 4 74.4, 2 / 2 74.1, 1 / 8 75.0, 1 / 4 73.4, 1 / 2 75.2;
S = 2 and 4 2 / 8 98.3 and 141.4, 2 / 2 98.8 and 143.9, 1 / 8 111.6 and 155.5,
1 / 2 98.8 and 143.0: within a run's spread or slower, so 8 stays (the route's
own chain sets when the experts start). At S = 1 the mono launch takes 1 router
and 4 latent rows (mono.SINGLE_TOKEN_ROUTER_ROWS, SINGLE_TOKEN_LATENT_ROWS:
68.3 to 68.7 us against 69.1 to 70.0 on an H200, docs/PERF.md)."""

ROUTER_RMS_MAX_TOKENS = 1
"""Up to this many tokens (1 at most: gemv's X_RMS and the router tasks' wait for
token 0's mix take one token) the mono launch's router tasks form x
= rms(h, post_attention_layernorm) from the seam's h as they stream their rows
(kernels/gemv.py X_RMS; the scale from the mix's sums, as the norm's tasks
compute it: the same bits), so the route does not wait for the seam's norm
step: its poll hop and round trip, 2.3 us of the S = 1 trace at 74e726e
(the mix done at 15.2, the router ready at 17.6). A token's x costs a task
two loads and six operations a weight column, against its one FMA: with one
row a task at S = 1 (the router's 112 rows at TP8) that hides behind the
memory round trips; more tokens or rows would not. The latent down and shared
tasks still read the norm's x (the route, not z, sets when the experts start).
The staged path keeps its norm kernel; both give the same logits. Measured on
two H100s against the commit before (docs/PERF.md, cfd5a34): S = 1 72.4, 72.5
-> 71.2, 71.0 us and 71.8, 71.7 -> 70.4, 70.5."""

SEAM_COLS = 512
SEAM_MIN_CHUNKS = 2
"""Columns of H a seam task covers (StageGeometry.seam_cols): the AttnRes seam
is three steps of a task per (token, chunk) (kernels/attnres.py), so at H = 7168
one token's seam spreads over 14 CTAs (one CTA took 14 us of the mono launch
at S = 1). 512 columns keep a task's loads at one 16-byte vector per candidate
and thread (4 warps); narrower configs get at least SEAM_MIN_CHUNKS chunks, so
the small test presets sum partials across chunks (the last one partial) as the
released one does; two, not more: the interpreter walks every task."""


def seam_cols(hidden: int) -> int:
    return min(SEAM_COLS, max(1, next_pow2(hidden) // SEAM_MIN_CHUNKS))


def seam_candidates_max(cfg: K3Config) -> int:
    """CP: the widest seam of the model (its last layer's blocks and P), a power
    of two: the seam partials' extent, so one scratch layout serves every layer."""
    return next_pow2(cfg.num_blocks(cfg.num_hidden_layers - 1) + 1)


ROUTE_CHUNK = 128
ROUTE_MIN_PARTS = 2
"""Experts a route part sorts (kernels/route.py): a token's top-K is the top-K
of its parts' top-Ks, each a CTA; at E = 896, 7 parts of 128 and a merge of
their 7 x 16 keys, instead of one CTA sorting 1024 keys (8 to 14 us of the mono
launch at S = 1, its trace). Narrower configs get at least ROUTE_MIN_PARTS
parts (never fewer experts than K_PAD a part), so the small test presets merge
parts (the last one partial) as the released one does; two, not more: the
interpreter walks every task."""


def route_chunk(num_experts: int, top_k: int) -> int:
    return max(next_pow2(top_k), min(ROUTE_CHUNK, next_pow2(num_experts) // ROUTE_MIN_PARTS))


LATENT_PART_COLS = 512
LATENT_MIN_PARTS = 2
"""Columns of L a latent-norm part sums over the ranks (StageGeometry.latent_part,
kernels/latent_norm.py): the norm is one step, a task per (token, part) that
writes the part's sum of squares and, in the rank's columns, the weighted
latent; FINAL applies the scale (a number a token) after its dot. One CTA
summing the ranks over all of L (T * L * 4 = 114 KB at TP8) ran 5.3 us at
S = 1 on the launch's critical path (an H100 trace of the twentieth session);
parts of 512 columns keep a part's loads at one 16-byte vector per rank slot
and thread (4 warps): 7 parts at L = 3584, each one memory round trip. The
scale's deferral took out a norm task a token after the parts: on one H200,
S = 1 68.0, 68.1 -> 66.3, 66.3 us, S = 8 201.0, 201.2 -> 200.8, 201.0
(docs/PERF.md, 74e726e). Narrower configs get at
least LATENT_MIN_PARTS parts (the small presets sum partials across parts,
the last one partial, as the released one does); two, not more: the
interpreter walks every task."""


def latent_part_cols(latent: int) -> int:
    return min(LATENT_PART_COLS, max(1, next_pow2(latent) // LATENT_MIN_PARTS))


HIDDEN_ROWS = 8
HIDDEN_ROWS_CHOICES = (8, 16, 32, 64)
"""Rows of an o_proj or a FINAL task (TileChoice.oproj_rows, final_rows): the
two stages whose outputs are all H = 7168 rows. At 8 rows (FMA_TILE) S = 1 has
896 tasks of each for the mono launch's 264 CTAs, 3.1 to 3.4 us a task of
which one or two steps are weight loads (the trace at 517679f): the rest is
what every task pays (its ticket, its table row, the push and the raise). 16,
32 or 64 rows spread the same bytes over 2x, 4x or 8x fewer tasks, the step (in
KB) unchanged, so K is taken in more, narrower steps; on the tl.dot path (16
rows at least) likewise from 16. Measured (docs/PERF.md): the mono launch takes
32 / 32 (mono.DEFAULT_TILES); the staged path, a launch per stage with no
ticket to pay, keeps 8."""

EXPERT_ROWS = 32
EXPERT_ROWS_CHOICES = (8, 16, 32, 64)
"""Output rows of an MXFP4 expert task, gate/up and down each their own
(TileChoice.gate_up_rows, down_rows). At 32, S = 1 at TP8 has 192 gate/up tasks
(16 experts x 12 tiles of I/T = 384) and 112 down tasks (L = 3584 / 32) for the
mono launch's 264 CTAs: a third to a half of them idle, while each busy one
streams about 100 KB alone. 16 or 8 rows spread the same bytes over 2x or 4x
the tasks; a step keeps its bytes (EXPERT_STEP_GROUPS groups of EXPERT_ROWS
rows), so K is taken in as many times fewer, wider steps."""

EXPERT_STEP_GROUPS = 16
"""MXFP4 groups of a row an expert step loads at EXPERT_ROWS rows (32 x 16
groups of 16 bytes: 8 KB a matrix, 64 bytes a thread at 4 warps); a task of
fewer rows loads as many more groups a step. 16 groups put 16 lanes on
consecutive 16-byte groups of a row and the warps on rows, so each thread
keeps one group column over several rows and reuses its activations for each
(kernels/experts.py); down's input row is the K chosen experts' groups."""


def expert_step_groups(rows: int, widen: int = 1) -> int:
    """Groups of a row an expert step of ``rows`` rows loads (the same bytes as
    EXPERT_ROWS', times ``widen``)."""
    return widen * EXPERT_STEP_GROUPS * EXPERT_ROWS // rows


DOWN_STEP_KB = 8
DOWN_STEP_KB_CHOICES = (8, 16)
"""KB of MXFP4 weight an expert down step loads (TileChoice.down_step_kb; 8 is
EXPERT_STEP_GROUPS at EXPERT_ROWS rows). A gate/up step loads two matrices of
8 KB, a down step one: in the mono launch, 2 or 3 CTAs a SM, the down tasks
keep half the bytes in flight of the gate/up tasks (the S = 8 trace at
cb26ab8, an H100: gate/up near the copy bandwidth, the down tasks 13.6 us for
98 KB, the phase 66 us against the staged stage's 40 at 10 CTAs a SM). 16 KB
doubles a down step's weight registers (and, at the same rows, its activations')."""


EXPERT_LOOKAHEAD = False
"""An MXFP4 expert loop loads step i + 1 into registers before it runs step i's
math (GemvTile.lookahead): each thread then keeps two steps of weights in flight
instead of one, for the mono launch's few resident warps an SM (the trace had a
100 KB expert task at 16 us, one memory round trip and its math a step). The
step's activations (and, for down, its route weights) come with it: loaded in the
step they are used, their L2 round trip opened every step (the mono launch at
one rank of TP8 on the H200, the same machine: S = 1 78.4 -> 77.2 us, S = 8
222.4 -> 219.7 with them loaded ahead). Off here (the staged path: its S = 8
lost 11 us with it, docs/PERF.md); the mono launch's default turns it on
(mono.DEFAULT_TILES). Same bits either way."""


EXPERT_MMA_ROWS = 64
EXPERT_MMA_GROUPS = 8
"""The tensor-core expert loops (TileChoice.expert_mma; weights in mma order,
kernels/mxfp4.py e2m1_mma_tile): 64 output rows a task, the M of one Hopper
warpgroup MMA at 4 warps (a 32-row probe compiled to mma.sync with the tile
through shared memory), and 8 groups (256 inputs) a step: two matrices' bf16
tiles of 64 registers a thread for gate/up, half the block-diagonal
activations' MMA_N = 16 columns. Offline sm_90a builds at TP8 (docs/PERF.md):
2.64 (gate/up) and 3.82 (down) instructions a weight value, against 4.34 and
5.00 for the FMA loops; 16 groups a step spilled in a probe of gate/up. Off
by default: on the H200 they are correct but 1.7 to 2.5 times slower than the
FMA loops (staged gate/up at S = 8 119.9 us against 66.1, the mono launch
143.7 us against 70.6 at S = 1; docs/PERF.md, thirteenth session). Half as
many tasks, and one barrier-bound warpgroup MMA a step, keep fewer bytes in
flight. The FMA loops' lookahead and expert_evict_first do not apply to these
loops."""


def expert_mma_tile(out_dim: int) -> GemvTile:
    """The tensor-core expert tile for ``out_dim`` output rows (tl.dot's M is at least DOT_MIN_TOKENS)."""
    rows = max(DOT_MIN_TOKENS, min(EXPERT_MMA_ROWS, next_pow2(out_dim)))
    return GemvTile(rows=rows, block_k=EXPERT_MMA_GROUPS * MXFP4_GROUP, warps=4)


X_TOKEN_GROUPS = False
X_GROUP_TOKENS = FMA_MAX_TOKENS
X_GROUP_TOKENS_CHOICES = (FMA_MAX_TOKENS, X_FMA_MAX_TOKENS)
"""Above FMA_MAX_TOKENS tokens, the router and the latent down-projection (the
two GEMVs of x that gate the experts) on the FMA path by groups of
X_GROUP_TOKENS tokens (TileChoice.x_token_groups, TileChoice.x_group_tokens: 4
or 8; S when fewer): a task per (row tile, group), a tile's first group reading
its weight rows from HBM, the others from L2. On
the tl.dot path a task needs 16 rows: at S = 16 and TP8 the router
is 7 tasks of 229 KB, 20.6 us each, and the latent down-projection 28 such tasks,
alone on the latency chain from x to the experts while some 300 CTAs wait (the
trace at 292242e, an H100, docs/PERF.md). By groups the router is 56 row tiles
of ROUTER_ROWS times S / 4 groups (224 tasks of 29 KB at S = 16). Measured
on an H100 (the mono defaults against it, docs/PERF.md): S = 16 334.8 against
345.0 us, S = 8 212.6 against 214.9; the route comes 8 us sooner at S = 16 but
the latent down tasks (224 of 8 rows, 16 us each) then gate the experts as
late as before. Off, for the mono launch too.
Offline sm_90a builds of the mono kernel at TP8 keep their registers (255 at
S = 8, 168 at S = 16) with 7 and 99 stack loads and stores in the task loop (8
and 76 without), none in a step loop. Groups of 8 tokens (X_FMA_MAX_TOKENS)
take S = 8 in one group, every weight row read once (offline: 255 registers at
S = 8 with 7 task-loop stack accesses, 168 at S = 16 with 119). Measured on an
H200 (08d74d5, docs/PERF.md): S = 8 204.1, 203.4 against 201.3, 201.9 us;
S = 16 314.7, 314.3 against 308.9, 309.6; with 1 router row, latent rows 8 / 2
at S = 8 202.3, 202.1 / 202.6, 202.7. Eight tokens' FMAs make the tasks
compute-bound (the S = 8 trace: 13.7 us a 2-row router task, 18.2 a latent
task, the route at 41.9 us): off."""

X_K_PARTS = 1
X_K_PARTS_CHOICES = (1, 2, 4, 7, 14)
"""On the tl.dot path (S > FMA_MAX_TOKENS, no token groups) the router and the
latent down-projection may cut K = H into this many parts (TileChoice.x_k_parts;
H a multiple of it): a task per (row tile, part) streams 1/parts of the tile's
rows, 16 rows being tl.dot's least. At TP8 the router is 7 such tiles and the
latent down 28, each 229 KB a step (8 KB) a memory round trip after another:
17.6 us a task in the S = 8 trace at 74e726e (x ready at 18.5, the route at
48.5), while the rest of the grid waits. The parts before a tile's last store
their fp32 partials in scratch and raise a local flag; the last part (last in
table order) computes its own, polls that flag in the task, sums the parts in
part order from zero and pushes the tile (the logits; z rounded to bf16 after
the sum). The staged path sums the same parts in the same order in one program
(kernels/gemv.py gemv_parts_tile), so both give the same bits. 1 here and in the
staged path (a program a tile, nothing to wait for); the mono launch takes
mono.MONO_X_K_PARTS, measured there."""


BACK_BLOCK_DV = 32
BACK_BLOCK_DV_CHOICES = (16, 32, 64)  # tl.dot's N is at least 16
"""Value rows of one head an M1b task (or program) produces for one token: 4 a
head, 48 tasks a token at TP8 (12 heads of 128), so at S = 1 M1b spreads over a
third of an H200; a task's w_v tile is 32 rows x the whole latent (32 KB in
bf16, 64 registers a thread at 4 warps). The mono launch may take other counts
(TileChoice.m1b_rows): every task recombines its token's splits of its head,
so fewer rows make more, shorter tasks that repeat the combine."""


BACK_PAIRS = 8
"""Splits' rows of o (one token's) an M1b combine step reads at once: [8, 512]
fp32 is 16 KB (32 registers a thread at 4 warps); at S = 1 the 16 splits the
mono launch folds in are two steps. 16 rows a step (one step) left the mono
launch with M1b folded in at 248 B of spills in an offline sm_90a build; 8 rows,
16 B."""

BACK_STAGES = 3
"""M1b steps in flight, in both combines. The short one (BACK_SHORT_SPLITS): at S =
1 M1b alone took 5.0 us at 3, 5.2 at 4, 5.3 at 5 (one H100, twenty-seventh
session). The long one (the MLA layer's M1c runs 264 splits at S = 1, 66 at S = 4,
33 at S = 8; a step reads BACK_PAIRS rows of o, 16 KB, and unpipelined each would
wait out its load): M1b alone on inputs from HBM took 17.4 us at 264 splits and
S = 1, 14.4 / 14.1 / 14.2 at 4 / 5 / 6, but 10.2 at 66 splits and S = 4, 10.6 /
11.2 / 11.7 deeper; in the MLA layer, where M1c has just written o, S = 1 at 4 and
6 was no faster in any of the three ways (one H100, docs/PERF.md, thirty-sixth
session)."""

BACK_SHORT_SPLITS = 16
"""At most this many splits (the mono fold's 16 at S = 1), M1b's combine steps
over the latent: BACK_CHUNK columns of every split's row of o and of the task's
w_v rows a step, copied to shared memory asynchronously (kernels/mla_back.py
_short_back). Combined at once, every row in registers, w_v's shared-memory copy
waited for its load first and ptxas put the combine's loads behind it (offline
sm_90a SASS). More splits step over the splits, BACK_PAIRS rows a step."""

BACK_CHUNK = 128
"""Latent columns a short combine's step: 16 splits x 128 fp32 (8 KB) and 32 w_v
rows x 128 bf16 (8 KB) of shared memory a stage."""


ATTN_BLOCK_H = 16
"""Heads an M1c task (or program) covers: tl.dot's smallest M; a TP8 rank's 12
heads fit one block, so every cache row is read once per token and split."""

ATTN_BLOCK_N = 32
"""Context positions an M1c step covers over a bf16 cache: a 32 x 512 bf16 latent
tile is 32 KB of shared memory, and the fp32 accumulator [16, 512] another 32 KB of
registers (64 a thread at 4 warps)."""

ATTN_STAGES = 3
"""The context loop's num_stages over a bf16 cache (Triton's software pipeline).
Each step loads the next step's page ids and carries them (kernels/mla_attn.py
_page_pair), so its cache copies depend on no load of their own step and take
the pipeline's first stage: 3 stages keep one step's copies in flight while a
step computes (async_wait 4 in the TTGIR; 93,440 B of shared memory at 32
positions, 2 programs a SM at 180 registers), 4 two (130,304 B, one program).
Before, each step loaded its own ids, which took a stage of their own, and 2 to
4 stages waited for every copy at the loop's top (offline sm_90a builds,
docs/PERF.md, twenty-eighth session). Then, timed at 32 positions on H100s, 3
stages beat 2 over a bf16 cache (24.0 against 25.6 us at S = 1, sixteenth
session). With the ids a step ahead the bf16 cache's times did not move (32 K,
one H100: 22.3 / 62.8 / 215.0 us at S = 1 / 4 / 16 against 21.8 / 63.9 / 219.5
before; twenty-ninth session)."""

ATTN_FOLDED_STAGES = 2
"""The folded M1C tasks' num_stages over either cache. At 3 (ATTN_STAGES) a bf16
cache's tasks take 93,440 B of shared memory, room for 2 CTAs a SM where the
mono launch plans 3 from MANY_CTAS_MIN_TOKENS tokens (mono.default_ctas_per_sm);
at 2, 56,576 B (offline sm_90a, TP8, S = 16). Over an fp8 cache 3 stages fit,
but with the page ids a step ahead the MLA layer with M1c folded in was slower
at 3 than at 2 (one H100, fp8, 32 K, S = 1 / 4 / 16: 158.3 / 223.1 / 675.0 us
against 154.0 / 225.9 / 595.6; the loop before, ids loaded in their own step, at
3 stages 153.9 / 231.4 / 599.3 in the same session; docs/PERF.md, thirty-first
session). At S = 16 that launch then planned 3 CTAs a SM (168 registers), where
the step loop spilled; at the 2 it plans now (mono.FOLDED_M1C_CTAS_PER_SM, 255
registers) 3 stages build without a spill in a step loop (offline sm_90a, fp8,
TP8 loopback: 224 B of stack against 208 at 2, 56,576 B of shared memory).
TileChoice.m1c_stages picks 2 or 3 (mono.FOLDED_M1C_DEEP_MIN_TOKENS: 3 from
S = 4, measured): the stages change where a step's copies wait, not its sums,
so the bits stay."""

ATTN_FOLDED_STAGES_CHOICES = (2, 3)

ATTN_FP8_BLOCK_N = 64
"""Context positions an M1c step covers over an fp8 cache: 36 KB a step, as a bf16
step of 32. Once a step's two page ids were scalar loads (kernels/mla_attn.py
_step_pages), 64 positions at 2 stages streamed 32 K of fp8 cache at 90 % of the
copy at S = 16 and 65 % at S = 4, against 72 % and 56 % at 32 positions and 3
stages (one H100, docs/PERF.md, twenty-seventh session); before that change 64
positions lost at S = 4 and 16 (sixteenth session)."""

ATTN_FP8_STAGES = 3
"""The context loop's num_stages over an fp8 cache. With the page ids a step
ahead (ATTN_STAGES), 3 stages at 64 positions keep one step's copies in flight
(async_wait 2; 94,464 B of shared memory, 2 programs a SM at 255 registers).
Timed at 32 K on an H100 (docs/PERF.md, twenty-ninth session): 23.9 / 46.8 /
126.4 us at S = 1 / 4 / 16 (33 / 66 / 98 % of the copy) against 24.5 / 48.9 /
146.5 at 2 stages and 27.0 / 56.0 / 153.1 at 4 (one program a SM), and the
loop before (ids loaded in their own step) at 2 stages 23.7 / 47.3 / 149.3."""


ATTN_FOLDED_BLOCK_N = ATTN_BLOCK_N
"""Context positions a folded M1C task's step covers, either cache (M1cGeometry;
mla.folded_attn_tile gives a launch alone the same tile, for the loopback
pre-writes). 64 (ATTN_FP8_BLOCK_N, over an fp8 cache) spilled in the step loop
(offline sm_90a, TP8: 183 stack accesses a step at S = 16 at 3 CTAs a SM; at 2,
11 and 6 at S = 16, 6 and 5 at S = 1) and, timed as a TileChoice field since
removed, lost (the MLA layer with M1c folded in, fp8, 32 K, one H100: at 3 CTAs a
SM S = 1 157.1 -> 166.0 us, S = 16 637.6 -> 694.2, twenty-seventh session; at
2, 3 stages, S = 16 548.7 -> 543.7, S = 8 327.3 -> 343.9, S = 4 222.2 -> 243.1,
thirty-fourth session; docs/PERF.md), where M1c launched alone streams 32 K of
fp8 cache at 98 % of the copy at S = 16 with 64 positions a step and 72 % with
32 (ATTN_FP8_BLOCK_N, ATTN_FP8_STAGES)."""


@dataclass(frozen=True)
class TileChoice:
    """Task shapes the mono launch may take other than the staged path's (a
    build-key part; docs at DENSE_STEP_KB, EXPERT_ROWS, DOWN_STEP_KB, ROUTER_ROWS,
    LATENT_ROWS, SHARED_ROWS, EXPERT_LOOKAHEAD, HIDDEN_ROWS, BACK_BLOCK_DV, EXPERT_MMA_ROWS, X_TOKEN_GROUPS,
    X_K_PARTS and ATTN_FOLDED_STAGES)."""

    dense_step_kb: int = DENSE_STEP_KB
    gate_up_rows: int = EXPERT_ROWS
    down_rows: int = EXPERT_ROWS
    down_step_kb: int = DOWN_STEP_KB
    router_rows: int = ROUTER_ROWS
    latent_rows: int = LATENT_ROWS
    shared_rows: int = SHARED_ROWS
    expert_lookahead: bool = EXPERT_LOOKAHEAD
    oproj_rows: int = HIDDEN_ROWS
    final_rows: int = HIDDEN_ROWS
    m1b_rows: int = BACK_BLOCK_DV
    shared_step_kb: int = DENSE_STEP_KB
    oproj_step_kb: int = DENSE_STEP_KB
    expert_mma: bool = False  # the expert tasks on tensor cores (EXPERT_MMA_ROWS; gate_up_rows, down_rows unused)
    expert_f16: bool = False  # the expert loops' sums in f16 (weights in k3mono.mxfp4.f16_order; kernels/mxfp4.py)
    x_token_groups: bool = X_TOKEN_GROUPS  # above FMA_MAX_TOKENS: router and latent down by groups of tokens
    x_group_tokens: int = X_GROUP_TOKENS  # tokens such a group takes (X_GROUP_TOKENS_CHOICES)
    x_k_parts: int = X_K_PARTS  # the tl.dot router and latent down: parts of K a row tile (X_K_PARTS_CHOICES)
    m1c_stages: int = ATTN_FOLDED_STAGES  # the folded M1C tasks' context loop stages (ATTN_FOLDED_STAGES_CHOICES)

    def check(self) -> None:
        for name in ("dense_step_kb", "shared_step_kb", "oproj_step_kb"):
            step_kb = getattr(self, name)
            if step_kb not in DENSE_STEP_KB_CHOICES:
                raise K3InputError(f"tiles.{name}: expected one of {DENSE_STEP_KB_CHOICES}, got {step_kb!r}")
        for name in ("oproj_rows", "final_rows"):
            if getattr(self, name) not in HIDDEN_ROWS_CHOICES:
                raise K3InputError(f"tiles.{name}: expected one of {HIDDEN_ROWS_CHOICES}, got {getattr(self, name)!r}")
        for name in ("gate_up_rows", "down_rows"):
            if getattr(self, name) not in EXPERT_ROWS_CHOICES:
                raise K3InputError(f"tiles.{name}: expected one of {EXPERT_ROWS_CHOICES}, got {getattr(self, name)!r}")
        if self.down_step_kb not in DOWN_STEP_KB_CHOICES:
            raise K3InputError(f"tiles.down_step_kb: expected one of {DOWN_STEP_KB_CHOICES}, got {self.down_step_kb!r}")
        if self.router_rows not in ROUTER_ROWS_CHOICES:
            raise K3InputError(f"tiles.router_rows: expected one of {ROUTER_ROWS_CHOICES}, got {self.router_rows!r}")
        if self.latent_rows not in LATENT_ROWS_CHOICES:
            raise K3InputError(f"tiles.latent_rows: expected one of {LATENT_ROWS_CHOICES}, got {self.latent_rows!r}")
        if self.x_group_tokens not in X_GROUP_TOKENS_CHOICES:
            raise K3InputError(f"tiles.x_group_tokens: expected one of {X_GROUP_TOKENS_CHOICES}, "
                               f"got {self.x_group_tokens!r}")
        if self.x_k_parts not in X_K_PARTS_CHOICES:
            raise K3InputError(f"tiles.x_k_parts: expected one of {X_K_PARTS_CHOICES}, got {self.x_k_parts!r}")
        if self.shared_rows not in SHARED_ROWS_CHOICES:
            raise K3InputError(f"tiles.shared_rows: expected one of {SHARED_ROWS_CHOICES}, got {self.shared_rows!r}")
        for name in ("expert_lookahead", "expert_mma", "expert_f16", "x_token_groups"):
            if not isinstance(getattr(self, name), bool):
                raise K3InputError(f"tiles.{name}: expected a bool, got {getattr(self, name)!r}")
        if self.expert_mma and self.expert_f16:
            raise K3InputError("tiles: expert_mma and expert_f16 are two orders of the expert weights; pick one")
        if self.m1b_rows not in BACK_BLOCK_DV_CHOICES:
            raise K3InputError(f"tiles.m1b_rows: expected one of {BACK_BLOCK_DV_CHOICES}, got {self.m1b_rows!r}")
        if self.m1c_stages not in ATTN_FOLDED_STAGES_CHOICES:
            raise K3InputError(f"tiles.m1c_stages: expected one of {ATTN_FOLDED_STAGES_CHOICES}, "
                               f"got {self.m1c_stages!r}")


def attn_steps(kv_fp8: bool) -> tuple[int, int]:
    """(positions a step, the context loop's num_stages) of M1c launched alone over an
    fp8 or a bf16 cache (the mono launch's M1C tasks take ATTN_FOLDED_BLOCK_N and
    TileChoice.m1c_stages: M1cGeometry)."""
    return (ATTN_FP8_BLOCK_N, ATTN_FP8_STAGES) if kv_fp8 else (ATTN_BLOCK_N, ATTN_STAGES)


ATTN_WARPS = 4
"""Warps of an M1c program launched alone (the mono launch's M1C tasks run at
the launch's): the [16, 512] fp32 accumulator is 64 registers a thread at 4."""


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class GemvTile:
    rows: int  # weight rows (outputs) a task produces
    block_k: int  # weight columns loaded per step
    warps: int
    lookahead: bool = False  # MXFP4 expert loops: step i + 1 loaded before step i's math (EXPERT_LOOKAHEAD)


@dataclass(frozen=True)
class StageGeometry:
    tokens: int  # S
    tokens_pad: int  # S rounded up to a power of two (16 when use_dot)
    use_dot: bool
    oproj: GemvTile
    router: GemvTile  # by x_group tokens a task
    latent_down: GemvTile  # by x_group tokens a task
    shared_gate_up: GemvTile
    final: GemvTile  # latent up + shared down
    expert_gate_up: GemvTile  # MXFP4, block_k a multiple of MXFP4_GROUP
    expert_down: GemvTile  # MXFP4
    vector_block: int  # columns a vector stage handles per step
    vector_warps: int
    seam_cols: int  # columns of H an AttnRes seam task covers (SEAM_COLS)
    score_cols: int  # columns of H a seam score chunk covers (SEAM_SCORE_COLS)
    route_chunk: int  # experts a route part sorts (ROUTE_CHUNK)
    latent_part: int  # columns of L a latent-norm part sums (LATENT_PART_COLS)
    x_group: int  # tokens a router / latent down task takes (X_TOKEN_GROUPS): S, or a group's
    x_group_dot: bool  # whether the router and latent down tasks run tl.dot (else FMAs)
    router_rms: bool  # whether the router tasks form x from the seam's h (ROUTER_RMS_MAX_TOKENS)
    x_parts: int = 1  # parts of K a router / latent down row tile is cut into (X_K_PARTS; 1 off the tl.dot path)
    m1b: "M1bGeometry | None" = None  # the mono launch's M1b tasks (MonoOptions.m1b)
    m1c: "M1cGeometry | None" = None  # the mono launch's M1c tasks (MonoOptions.m1c)

    @property
    def x_groups(self) -> int:
        return -(-self.tokens // self.x_group)

    @property
    def x_group_pad(self) -> int:
        """The router and latent down tiles' token extent (SP of their gemv_tile)."""
        return self.tokens_pad if self.x_group_dot else next_pow2(self.x_group)


@dataclass(frozen=True)
class M1bShape:
    """What an MLA layer's M1b inputs look like (a build-key part: the launch's
    constexprs): ``splits`` M1c context splits, ``latent`` DL the latent width
    (512 in Kimi-K3; smaller test presets use less), ``w_v_fp8`` w_v in fp8
    e4m3 (else bf16)."""

    splits: int
    latent: int
    w_v_fp8: bool = False


@dataclass(frozen=True)
class M1bGeometry:
    """M1b in a rank's launch: ``heads`` = num_attention_heads / T heads of
    ``value`` = v_head_dim rows, cut into tasks of ``block_dv`` rows of one
    head for one of the ``tokens`` (a task for all S combined 16 tokens' splits
    one after another at S = 16: the fold cost 59.2 us, a task a token 33.0 on
    the same H100), ``pairs`` rows of o a combine step (``chunk`` latent
    columns when at most ``short_splits``), ``stages`` steps in flight."""

    heads: int
    value: int
    latent: int
    splits: int
    w_v_fp8: bool
    tokens: int
    block_dv: int
    short_splits: int
    chunk: int
    pairs: int
    stages: int

    @property
    def blocks_per_head(self) -> int:
        return self.value // self.block_dv

    @property
    def tasks(self) -> int:
        return self.tokens * self.heads * self.blocks_per_head


def m1b_geometry(cfg: K3Config, tp: int, tokens: int, shape: M1bShape, block_dv: int = BACK_BLOCK_DV) -> M1bGeometry:
    return M1bGeometry(
        heads=cfg.num_attention_heads // tp,
        value=cfg.v_head_dim,
        latent=shape.latent,
        splits=shape.splits,
        w_v_fp8=shape.w_v_fp8,
        tokens=tokens,
        block_dv=min(block_dv, cfg.v_head_dim),
        short_splits=BACK_SHORT_SPLITS,
        chunk=BACK_CHUNK,
        pairs=BACK_PAIRS,
        stages=BACK_STAGES,
    )


@dataclass(frozen=True)
class M1cShape:
    """What an MLA layer's M1c inputs look like (a build-key part, like M1bShape;
    the splits and the latent width are M1bShape's): ``page_size`` cache rows a
    page, ``requests`` B (1 <= B <= S), ``rope`` DR the positional width after
    the latent (64 in Kimi-K3), ``kv_fp8`` the cache in fp8 e4m3 (else bf16)."""

    page_size: int
    requests: int
    rope: int = 64
    kv_fp8: bool = False


@dataclass(frozen=True)
class M1cGeometry:
    """M1c in a rank's launch: ``heads`` = num_attention_heads / T, ``tokens`` S
    query tokens, ``splits`` of each request's context; a task is one (token,
    split, block of ``block_h`` heads), ``block_n`` positions a step. Its
    split outputs o [splits, S, heads, latent] and lse [splits, S, heads]
    (fp32) are the launch's own scratch (layout.scratch_layout)."""

    heads: int
    tokens: int
    latent: int
    rope: int
    splits: int
    page_size: int
    requests: int
    kv_fp8: bool
    block_h: int
    block_n: int
    stages: int

    @property
    def head_blocks(self) -> int:
        return -(-self.heads // self.block_h)

    @property
    def tasks(self) -> int:
        return self.tokens * self.splits * self.head_blocks


def m1c_geometry(cfg: K3Config, tp: int, tokens: int, m1b: M1bShape, shape: M1cShape,
                 tiles: TileChoice = TileChoice()) -> M1cGeometry:
    block_n, stages = ATTN_FOLDED_BLOCK_N, tiles.m1c_stages
    return M1cGeometry(
        heads=cfg.num_attention_heads // tp,
        tokens=tokens,
        latent=m1b.latent,
        rope=shape.rope,
        splits=m1b.splits,
        page_size=shape.page_size,
        requests=shape.requests,
        kv_fp8=shape.kv_fp8,
        block_h=ATTN_BLOCK_H,
        block_n=block_n,
        stages=stages,
    )


def _gemv(rows: int, out_dim: int, in_dim: int, block_k: int, warps: int = 4, lookahead: bool = False) -> GemvTile:
    """A tile no larger than the output and the input it covers."""
    return GemvTile(rows=min(rows, next_pow2(out_dim)), block_k=min(block_k, next_pow2(in_dim)), warps=warps,
                    lookahead=lookahead)


def _dense(out_dim: int, in_dim: int, use_dot: bool, step_kb: int, rows: int = FMA_TILE[0]) -> GemvTile:
    """A dense bf16 GEMV tile for the path ``use_dot`` selects, its step widened
    along K to ``step_kb`` KB of weight; ``rows`` rows a task (on the tl.dot path
    at least DOT_TILE's), the step as much shorter along K as the task has more
    rows than FMA_TILE or DOT_TILE (the same bytes a step)."""
    widen = step_kb // DENSE_STEP_KB
    if not use_dot:
        return _gemv(rows, out_dim, in_dim, FMA_TILE[1] * widen * FMA_TILE[0] // rows)
    dot_rows = max(DOT_TILE[0], rows)
    tile = _gemv(dot_rows, out_dim, in_dim, DOT_TILE[1] * widen * DOT_TILE[0] // dot_rows)
    return GemvTile(rows=max(tile.rows, DOT_MIN_TOKENS), block_k=max(tile.block_k, DOT_MIN_TOKENS), warps=tile.warps)


def _expert(rows: int, out_dim: int, in_dim: int, lookahead: bool, widen: int = 1) -> GemvTile:
    """An MXFP4 expert tile [groups, rows] (kernels/experts.py): ``rows`` rows a
    task, expert_step_groups(rows, widen) groups a step."""
    return _gemv(rows, out_dim, in_dim, expert_step_groups(rows, widen) * MXFP4_GROUP, lookahead=lookahead)


def stage_geometry(cfg: K3Config, tp: int, tokens: int, m1b: M1bShape | None = None,
                   m1c: M1cShape | None = None, tiles: TileChoice = TileChoice()) -> StageGeometry:
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"stage_geometry: tokens must be 1..{MAX_TOKENS}, got {tokens}")
    tiles.check()
    step_kb = tiles.dense_step_kb
    H, C, E, L, I, SI = cfg.matrix_dims
    use_dot = tokens > FMA_MAX_TOKENS
    x_dot = use_dot and not tiles.x_token_groups
    x_group = min(tokens, tiles.x_group_tokens) if use_dot and tiles.x_token_groups else tokens
    x_parts = tiles.x_k_parts if x_dot else 1
    if H % x_parts:
        raise K3InputError(f"tiles.x_k_parts: hidden_size {H} is not a multiple of {x_parts} parts")
    return StageGeometry(
        tokens=tokens,
        tokens_pad=max(next_pow2(tokens), DOT_MIN_TOKENS) if use_dot else next_pow2(tokens),
        use_dot=use_dot,
        oproj=_dense(H, C // tp, use_dot, tiles.oproj_step_kb, tiles.oproj_rows),
        router=_dense(E // tp, H // x_parts, x_dot, step_kb, tiles.router_rows),  # a part's K
        latent_down=_dense(L // tp, H // x_parts, x_dot, step_kb, tiles.latent_rows),
        shared_gate_up=_dense(SI // tp, H, use_dot, tiles.shared_step_kb, tiles.shared_rows),
        final=_dense(H, max(L, SI) // tp, use_dot, step_kb, tiles.final_rows),
        expert_gate_up=(expert_mma_tile(I // tp) if tiles.expert_mma
                        else _expert(tiles.gate_up_rows, I // tp, L, tiles.expert_lookahead)),
        expert_down=(expert_mma_tile(L) if tiles.expert_mma
                     else _expert(tiles.down_rows, L, cfg.num_experts_per_token * I // tp, tiles.expert_lookahead,
                                  tiles.down_step_kb // DOWN_STEP_KB)),
        vector_block=min(1024, next_pow2(H)),
        vector_warps=4,
        seam_cols=seam_cols(H),
        score_cols=SEAM_SCORE_COLS,
        route_chunk=route_chunk(E, cfg.num_experts_per_token),
        latent_part=latent_part_cols(L),
        x_group=x_group,
        x_group_dot=x_dot,
        router_rms=tokens <= ROUTER_RMS_MAX_TOKENS,
        x_parts=x_parts,
        m1b=None if m1b is None else m1b_geometry(cfg, tp, tokens, m1b, tiles.m1b_rows),
        m1c=None if m1c is None else m1c_geometry(cfg, tp, tokens, m1b, m1c, tiles),
    )


# ===========================================================================
# The mono launch: one persistent launch per layer walks a task table
# ===========================================================================
#
# Every rank runs the SAME table (``plan`` takes no rank): ticket i is the same
# task on every rank, only its rank offsets (which logits / z columns, which
# peer slot) differ. CTAs take tickets from a global counter in table order and
# grab the next one once the current one's waits are met (a blocked CTA holds
# one ticket); a task issues its weight loads (or L2 prefetch) before it polls
# its data waits.
#
# Invariant (``plan`` checks it, tests/test_planner.py proves no deadlock with
# it): every wait's raisers have strictly lower tickets, on this rank and, for
# peer flags, on every rank (same table, same ticket). Then the lowest
# unfinished ticket of all ranks only waits for finished tasks, so any grid
# size completes, and one program (the interpreter) walks the table in order.
#
# Table order (the dependency chain fixes the kinds' order; the freedom left is
# used so weights stream while the exchanges settle):
#
#   M1C           (option, with M1B) first: the split outputs o / lse into the
#                 launch's scratch, one (token, split, head block) a task,
#                 token-major; no wait, they read only the cache and q
#   M1B           (option, MLA layers) next: the rank's core from M1c's split
#                 outputs, a head's BLOCK_DV value rows a task, all tokens;
#                 with M1C each waits for every M1C task (SPLITS: it combines
#                 every split of its head for all tokens), issuing nothing first
#   OPROJ         all tiles next: 22 MB at T = 8 stream at once; with M1B each
#                 issues its weights, then waits for the whole core (CORE: it
#                 reads every column of the rank's heads), otherwise no wait
#   REDUCE1       AR1 per (column tile, token): a tile reduces as soon as its
#                 o_proj rows arrived from every rank, not after the whole
#                 o_proj; then the token's seam candidates' partial sums there
#                 (SEAM_SCORE_COLS: the seam's score step). A task a token: one
#                 memory round trip each, where a tile's task looping over S
#                 tokens paid S in a row (its prefix store, which may alias the
#                 next token's block rows, orders them): the S = 16 trace on an
#                 H100 (b0dd80b, docs/PERF.md) had such tasks running 18 us
#                 each, the seam waiting for them until 32.7 us, o_proj done
#                 at 13.2
#   SEAM_MIX      per (token, chunk): the scores from every tile's partials of
#                 its token, the chunk's h and its partial sum of squares
#   SEAM_NORM     per (token, chunk): x; these steps spread the seam (on
#                 the critical path, it needs all of H twice) over CTAs
#   ROUTER        critical path (logits -> route -> experts): first
#   LATENT_DOWN   next (z gates the experts)
#   PREFETCH_SHARED (option) SHARED_GU's weights into L2 while the chain settles
#   SHARED_GU     last of the three: only FINAL needs it. All three issue their
#                 weights before waiting X_READY, so they stream during the
#                 AR1 + seam chain
#   ROUTE_PART    per (token, part of the experts), after every rank's router
#                 rows: the part's top-K keys
#   ROUTE         per token: the top-K of its parts' (the merge)
#                 (option route_early: ROUTE_PART and ROUTE before SHARED_GU, so
#                 the CTAs that take them wait for the router instead of being
#                 taken last, behind every shared task; option shared_late:
#                 SHARED_GU after EXPERT_GU, the route before both)
#   EXPERT_GU     token-major, then slot, then tile: ACT[0] completes first
#   EXPERT_DOWN   token-major, AFTER every EXPERT_GU (not interleaved per token:
#                 interleaving would leave CTAs idle at every token boundary,
#                 waiting for that token's last gate/up tile; grouped, ACT[t]
#                 is long complete when EXPERT_DOWN(t) is taken). Its w2 loads
#                 wait only for ROUTED (the expert ids), not for ACT
#   PREFETCH_FINAL (option) FINAL's weights into L2 while the AR2 chain settles
#                 (option prefetch_final_early: right after LATENT_DOWN instead)
#   LATENT_PART   per (token, part of L), all together at the end: each waits
#                 for every rank's down-projection of its token, sums the ranks
#                 over its part and writes the part's sum of squares and, in
#                 the rank's L/T columns, the weighted latent; interleaving
#                 them with EXPERT_DOWN would block CTAs mid-phase for no gain
#                 (the last token's chain is the critical path either way)
#   FINAL         latent up + shared down, after every part of every token
#                 (the norm's scale from the parts' sums, applied after the
#                 dot); its weights are issued before its waits, so the first
#                 CTAs there stream while AR2 settles
#                 (option final_split: the shared down first, then the wait
#                 for the latent, polled by the task itself)
#   REDUCE3       AR3 per (column tile, token), as REDUCE1
#
# Flags are counters, indexed at the CONSUMER's granularity (a consumer polls
# one word per wait, at most MAX_WAITS waits a task). They are never cleared:
# a launch of epoch e (1, 2, ...) waits until word >= e * count, every launch
# raises each flag exactly ``count`` times (tested). Peer flags are raised on
# every rank (the push goes with its data), local flags on the own rank only.
# The words are int32 and grow by ``count`` a launch (AR2's is the largest,
# T * L / 16 = 1792 at T = 8):
# compare as int32(word - target) >= 0, right across the wrap while no waiter
# lags 2^31 raises behind.

REDUCE_TILE_COLS = 128
"""Columns of H a REDUCE1 / REDUCE3 task sums over the ranks, for one token
(rounded up to a whole number of its producer's row tiles). The seed's reduce
ran on 56 CTAs at H = 7168: 128 columns, enough tasks to spread the AR1
reduction over a third of an H200 at S = 1 (56 * S tasks) while each task
still reads T * 512 contiguous bytes."""

SEAM_SCORE_COLS = REDUCE_TILE_COLS
"""Columns of H a seam score chunk covers (StageGeometry.score_cols): a REDUCE1
tile, so the mono launch's REDUCE1 task scores the P it has just summed there
(kernels/attnres.py score_partials) instead of a SEAM_SCORE step after every
tile (the S = 1 trace: 3.1 us a score task, its loads cold, between REDUCE1 and
SEAM_MIX); the staged path's score step takes the same chunks, so both give
the same partials. Measured on one H200 (one rank of TP8, the mono defaults):
S = 1 76.9 -> 74.3 us, S = 2 102.9 -> 98.1, S = 8 219.0 -> 219.9, S = 16
368.5 -> 369.3 (the seam's mix now starts 3 us sooner at S = 1). A first form
that loaded the block rows after the prefix store paid a second round trip a
token: S = 8 220.3 -> 234.9."""

MAX_WAITS = 2
"""Waits a task may carry: the int table has this many wait column pairs."""

OPT_PREFETCH_FINAL = 1 << 0
OPT_M1B = 1 << 1
OPT_M1C = 1 << 2
OPT_ROUTE_EARLY = 1 << 3
OPT_SHARED_LATE = 1 << 4
OPT_EXPERT_EVICT_FIRST = 1 << 5
OPT_FINAL_SPLIT = 1 << 6
OPT_PREFETCH_SHARED = 1 << 7
OPT_PREFETCH_FINAL_EARLY = 1 << 8
OPT_PREFETCH_GATE_UP = 1 << 9
OPT_PREFETCH_DOWN = 1 << 10
OPT_PREFETCH_OPROJ = 1 << 11
OPT_ALL = (OPT_PREFETCH_FINAL | OPT_M1B | OPT_M1C | OPT_ROUTE_EARLY | OPT_SHARED_LATE | OPT_EXPERT_EVICT_FIRST
           | OPT_FINAL_SPLIT | OPT_PREFETCH_SHARED | OPT_PREFETCH_FINAL_EARLY | OPT_PREFETCH_GATE_UP
           | OPT_PREFETCH_DOWN | OPT_PREFETCH_OPROJ)


class TaskKind(enum.IntEnum):
    """Task kinds; the value is the kind code of the int table (build-key stable)."""

    OPROJ = 0
    REDUCE1 = 1  # with the seam's score step (SEAM_SCORE_COLS); code 2 was a separate score kind
    ROUTER = 3
    LATENT_DOWN = 4
    SHARED_GU = 5
    ROUTE = 6
    EXPERT_GU = 7
    EXPERT_DOWN = 8
    PREFETCH_FINAL = 9
    # code 10 was a norm task after the latent parts (its scale is now FINAL's)
    FINAL = 11
    REDUCE3 = 12
    M1B = 13
    NOP = 14  # a timing variant's skipped task: its waits and its raise, no work (timing_variant)
    M1C = 15
    SEAM_MIX = 16
    SEAM_NORM = 17
    ROUTE_PART = 18
    PREFETCH_SHARED = 19
    LATENT_PART = 20


class Flag(enum.IntEnum):
    """Flag kinds; each has ``flag_slots`` words in a rank's flag array."""

    AR1 = 0  # [reduce1 tile]  o_proj partial rows arrived      (peer)
    P_READY = 1  # [token]     prefix columns reduced
    X_READY = 2  # [1]         x written, every (token, chunk)
    LOGITS = 3  # [1]          router logits columns arrived     (peer)
    Z = 4  # [1]               latent z columns arrived          (peer)
    SHARED_READY = 5  # [1]    shared activations written
    ROUTED = 6  # [token]      route ids / weights written
    ACT = 7  # [token]         expert activations written
    AR2 = 8  # [token]         expert down partial rows arrived (peer)
    LATENT_READY = 9  # [1]    latent parts' weighted columns and sums of squares written, every (token, part)
    AR3 = 10  # [reduce3 tile] final partial rows arrived        (peer)
    CORE = 11  # [1, 0 without M1B] the rank's core columns written (M1B)
    SPLITS = 12  # [1, 0 without M1C] the split outputs o / lse written (M1C)
    MIXED = 14  # [token]      seam h and its partial squares written, every chunk
    RANKED = 15  # [token]     route parts' top-K keys written, every part
    DISCARD = 16  # [1]        raised by a timing variant's task copies only; never awaited
    LOGIT_PARTS = 17  # [router tile, 0 unsplit] the tile's first parts' partial logits written (X_K_PARTS)
    Z_PARTS = 18  # [latent tile, 0 unsplit]     the tile's first parts' partial z written (X_K_PARTS)


PEER_FLAGS = frozenset({Flag.AR1, Flag.LOGITS, Flag.Z, Flag.AR2, Flag.AR3})
"""Flags raised on every rank (they travel with a push into peer regions)."""

X_PART_FLAGS = {TaskKind.ROUTER: Flag.LOGIT_PARTS, TaskKind.LATENT_DOWN: Flag.Z_PARTS}
"""The local flag a split-K kind's first parts raise (X_K_PARTS), by kind."""


@dataclass(frozen=True)
class MonoOptions:
    """Options of the mono launch.

    prefetch_final (a build-key bit, ``bits()``): add PREFETCH_FINAL tasks that
    pull FINAL's weights into L2 right after the expert down-projections, so
    HBM streams them while the AR2 -> latent norm chain settles; FINAL then
    reads them from L2 (off here; mono.default_options turns it on, as measured:
    mono.DEFAULT_PREFETCH_FINAL).
    m1b (a build-key bit when set; its M1bShape is a build-key part, like
    ctas_per_sm not in ``bits()``): an MLA layer's launch runs M1b first, so
    o_proj starts from M1c's split outputs instead of a finished core.
    m1c (a build-key bit when set, its M1cShape a build-key part; needs m1b):
    the launch runs M1c before M1b, so it starts from q and the paged latent
    cache and writes the split outputs itself.
    ctas_per_sm (launch only, not in ``bits()``): resident CTAs an SM is given.
    One program of the GEMV geometry keeps one tile step (8 KB) in flight and an
    SM wants about 32 KB, so more than one may pay; the benchmark decides. It
    never risks a deadlock: a CTA that is not resident holds no ticket.
    tiles (a build-key part, not in ``bits()``): task sizes other than the
    staged path's (TileChoice: the dense GEMV step, the expert and router task rows).
    poll_sleep_ns (a build-key part, not in ``bits()``): a waiting CTA sleeps this
    long between polls (compiled NVIDIA builds; 0: it spins), leaving the issue
    slots of its SM to the CTA beside it.
    route_early (a build-key bit, ``bits()``): the route's tasks (ROUTE_PART,
    ROUTE) come before SHARED_GU in the table instead of after it.
    shared_late (a build-key bit, ``bits()``): SHARED_GU comes after EXPERT_GU
    (and the route before both), so the gate/up tasks get CTAs the moment the
    route is known while the shared tasks fill the CTAs the gate/up tasks leave
    free (at S = 1, 192 gate/up tasks for 264 CTAs); FINAL, their only consumer,
    comes long after.
    expert_evict_first (a build-key bit, ``bits()``): the MXFP4 expert tasks load
    their weights with L2 policy evict_first: read once, they are the first to go
    when L2 makes room, ahead of what PREFETCH_FINAL put there for FINAL; where
    tokens share experts (S > 1) it also gives up the L2 hits of the second
    token's reads. The same table and the same sums.
    final_split (a build-key bit, ``bits()``): a FINAL task runs its shared
    down-projection (its K = SI/T columns: 63 % of its bytes at TP8) as soon as
    the shared activations are written, then waits for the normed latent and
    runs the latent up-projection: only that part (K = L/T) stays behind the
    AR2 -> latent norm chain. The wait for the latent is the task's own
    (Wait.in_task; a trace's FINAL run time then includes it). The same sums
    (routed + shared, added once both are done). Measured slower on an H100
    (S = 1 77.6 against 75.3 us: its tasks compete with the last down tasks): off.
    prefetch_shared (a build-key bit, ``bits()``): PREFETCH_SHARED tasks right
    after LATENT_DOWN in the table, each asking the copy engine for one shared
    gate/up task's weight rows (as PREFETCH_FINAL for FINAL): taken while the
    AR1 -> seam -> route chain leaves HBM nearly idle (the S = 1 trace: only the
    router and latent rows, 8 MB, stream from 10 to 27 us), so the shared
    tasks then read L2 (at S = 1 they ran 18.5 us each, a memory round trip a
    step, through the expert phase). The same sums. Measured slower on an H100
    (with final_split, S = 1 79.4 against 77.6 us): off.
    prefetch_final_early (a build-key bit, ``bits()``; needs prefetch_final): the
    PREFETCH_FINAL tasks right after LATENT_DOWN instead of after the expert
    down-projections, so FINAL's 17 MB (TP8) stream while the AR1 -> seam ->
    route chain leaves HBM nearly idle, not beside the down-projections' own
    weights (the S = 1 trace of the twentieth session, an H100: the down tasks
    ran 49.6 to 59.3 us while PREFETCH_FINAL pulled FINAL's rows, 47.4 to 60.2).
    They must then stay in L2 through the expert phase. The same sums. Measured
    slower on an H100 (S = 1 76.9 against 75.0 us, S = 8 211.3 against 209.6): off.
    prefetch_gate_up, prefetch_down (build-key bits, ``bits()``): every
    EXPERT_GU / EXPERT_DOWN task asks the copy engine for all of its weight rows
    and scales once its expert ids are known, before its other waits, whatever
    the launch's prefetch mode (kernels/mono.py step 2): a task's loop keeps one
    or two 8 KB steps in flight, so its rows otherwise arrive a memory round
    trip a step; asked for at once, they stream while the loop reads L2. The
    same table and the same sums. Measured slower on an H100 (one rank of TP8,
    benchmarks/defaults_ab.py, us): prefetch_down S = 1 70.4, 70.7 -> 72.2, 72.1,
    S = 8 205.3, 205.6 -> 211.7, 211.4, S = 16 322.0, 321.8 -> 353.6, 355.0;
    prefetch_gate_up S = 1 70.6, 70.6 -> 74.7, 74.4, S = 8 205.9, 204.9 -> 210.6,
    209.8 (the S = 8 trace: a down task 12.3 us against 13.6, but the phase ended
    7 us later): off.
    prefetch_oproj (a build-key bit, ``bits()``; acts only with m1b): every OPROJ
    task asks the copy engine for all of its w_o rows before it waits for the
    core M1B writes, whatever the launch's prefetch mode, so the 22 MB (TP8) of
    w_o stream into L2 while M1b combines the splits, and o_proj then reads L2
    instead of starting its stream from HBM once the core exists. The same sums.
    Measured slower on two H100s (benchmarks/defaults_ab.py --m1b, S = 1, one
    rank of TP8, us; the plain launch 71.1 to 71.4): the fold 79.4, 79.1 -> 83.9,
    84.1; at 16 KB o_proj steps 78.6, 78.6 -> 81.5, 81.7; S = 16 376.9, 377.8 ->
    383.7, 385.2. The traces: the M1B tasks ran 9.1 us instead of 6.3 (HBM
    shared with the 22 MB asked for), and an o_proj task still took 7.9 us
    after the core (10.0 without): off.
    """

    prefetch_final: bool = False
    ctas_per_sm: int = 1
    m1b: M1bShape | None = None
    m1c: M1cShape | None = None
    tiles: TileChoice = TileChoice()
    poll_sleep_ns: int = 0
    route_early: bool = False
    shared_late: bool = False
    expert_evict_first: bool = False
    final_split: bool = False
    prefetch_shared: bool = False
    prefetch_final_early: bool = False
    prefetch_gate_up: bool = False
    prefetch_down: bool = False
    prefetch_oproj: bool = False

    def bits(self) -> int:
        return ((OPT_PREFETCH_FINAL if self.prefetch_final else 0) | (OPT_M1B if self.m1b is not None else 0)
                | (OPT_M1C if self.m1c is not None else 0) | (OPT_ROUTE_EARLY if self.route_early else 0)
                | (OPT_SHARED_LATE if self.shared_late else 0)
                | (OPT_EXPERT_EVICT_FIRST if self.expert_evict_first else 0)
                | (OPT_FINAL_SPLIT if self.final_split else 0) | (OPT_PREFETCH_SHARED if self.prefetch_shared else 0)
                | (OPT_PREFETCH_FINAL_EARLY if self.prefetch_final_early else 0)
                | (OPT_PREFETCH_GATE_UP if self.prefetch_gate_up else 0)
                | (OPT_PREFETCH_DOWN if self.prefetch_down else 0)
                | (OPT_PREFETCH_OPROJ if self.prefetch_oproj else 0))

    def always_prefetched(self) -> int:
        """Bit k set: tasks of kind code k ask the copy engine for their rows
        before their other waits whatever the launch's prefetch mode
        (prefetch_gate_up, prefetch_down, prefetch_oproj; kernels/mono.py step 2)."""
        chosen = ((TaskKind.EXPERT_GU, self.prefetch_gate_up), (TaskKind.EXPERT_DOWN, self.prefetch_down),
                  (TaskKind.OPROJ, self.prefetch_oproj))
        return sum(1 << kind for kind, on in chosen if on)

    @classmethod
    def from_bits(cls, bits: int, ctas_per_sm: int = 1, m1b: M1bShape | None = None,
                  m1c: M1cShape | None = None, tiles: TileChoice = TileChoice(),
                  poll_sleep_ns: int = 0) -> "MonoOptions":
        if bits & ~OPT_ALL:
            raise K3InputError(f"options: unknown option bits {bits & ~OPT_ALL:#x}")
        if bool(bits & OPT_M1B) != (m1b is not None):
            raise K3InputError(f"options: the m1b bit and the M1b shape go together, got bits {bits:#x} and {m1b}")
        if bool(bits & OPT_M1C) != (m1c is not None):
            raise K3InputError(f"options: the m1c bit and the M1c shape go together, got bits {bits:#x} and {m1c}")
        return cls(prefetch_final=bool(bits & OPT_PREFETCH_FINAL), ctas_per_sm=ctas_per_sm, m1b=m1b, m1c=m1c,
                   tiles=tiles, poll_sleep_ns=poll_sleep_ns, route_early=bool(bits & OPT_ROUTE_EARLY),
                   shared_late=bool(bits & OPT_SHARED_LATE), expert_evict_first=bool(bits & OPT_EXPERT_EVICT_FIRST),
                   final_split=bool(bits & OPT_FINAL_SPLIT), prefetch_shared=bool(bits & OPT_PREFETCH_SHARED),
                   prefetch_final_early=bool(bits & OPT_PREFETCH_FINAL_EARLY),
                   prefetch_gate_up=bool(bits & OPT_PREFETCH_GATE_UP), prefetch_down=bool(bits & OPT_PREFETCH_DOWN),
                   prefetch_oproj=bool(bits & OPT_PREFETCH_OPROJ))


@dataclass(frozen=True)
class Wait:
    flag: Flag
    index: int
    count: int  # raises per launch that complete it (the epoch-e target is e * count)
    sources: tuple[int, ...]  # tickets of the raising tasks (the same on every rank)
    before_loads: bool = False  # the task's weight addresses depend on it (expert ids)
    in_task: bool = False  # the task polls it itself, after a first part that does not need it (the last waits)


@dataclass(frozen=True)
class Raise:
    flag: Flag
    index: int

    @property
    def every_rank(self) -> bool:
        return self.flag in PEER_FLAGS


@dataclass(frozen=True)
class Task:
    """One ticket. ``span`` is the [start, stop) range of the kind's tiled axis
    (output rows of a GEMV, columns of a reduce; (0, 0) for per-token kinds);
    ``tile`` its tile number; ``token`` / ``slot`` -1 where they do not apply.
    ``streams``: (weight tensor, bytes) this task is the first to read from HBM."""

    ticket: int
    kind: TaskKind
    tile: int = -1
    span: tuple[int, int] = (0, 0)
    token: int = -1
    slot: int = -1
    streams: tuple[tuple[str, int], ...] = ()
    waits: tuple[Wait, ...] = ()
    raises: tuple[Raise, ...] = ()

    @property
    def weights(self) -> dict[str, int]:
        return dict(self.streams)

    @property
    def weight_bytes(self) -> int:
        return sum(n for _, n in self.streams)

    def row(self) -> "TaskRow":
        """The fields the int table encodes (what ``decode_int_tensor`` gives back)."""
        raised = self.raises[0] if self.raises else None
        return TaskRow(
            kind=self.kind,
            tile=self.tile,
            span=self.span,
            token=self.token,
            slot=self.slot,
            waits=tuple((w.flag, w.index, w.count, w.before_loads, w.in_task) for w in self.waits),
            raised=(raised.flag, raised.index) if raised else None,
            weight_bytes=self.weight_bytes,
        )


class TaskRow(NamedTuple):
    kind: TaskKind
    tile: int
    span: tuple[int, int]
    token: int
    slot: int
    waits: tuple  # ((flag, index, count, before_loads, in_task), ...)
    raised: tuple | None  # (flag, index)
    weight_bytes: int


class Write(NamedTuple):
    """Elements a task writes: ``index`` (slices) of ``region``, on every rank's
    copy of it (a push into peer regions) or on the own rank's only."""

    region: str
    every_rank: bool
    index: tuple


# -- int table columns ---------------------------------------------------------

TABLE_COLUMNS = (
    "kind",  # TaskKind code
    "tile",  # tile number of the kind's tiled axis (-1: per-token kind)
    "start",  # first row / column of the tile
    "stop",  # one past its last
    "token",  # -1 where the kind is not per token
    "slot",  # routed slot 0..K-1 (EXPERT_GU), the part of K (a split ROUTER / LATENT_DOWN tile), else -1
    "num_waits",
    "addr_waits",  # the first addr_waits waits gate the weight addresses: poll, load, poll the rest
    *(f"wait{i}_{part}" for i in range(MAX_WAITS) for part in ("word", "count")),
    "raise_word",  # -1: raises nothing
    "raise_peer",  # 1: raise on every rank (after the push), 0: own rank
    "weight_bytes",  # bytes of weights the task streams from HBM (accounting / tracing)
    "late_waits",  # the last late_waits waits are the task's own: polled after its first part (MonoOptions.final_split)
)
"""Columns of ``TaskTable.as_int_tensor()`` (int32, one row a ticket). A wait is
(flag word, count): poll word until it reaches epoch * count. Flag words index
the rank's flag array (``TaskTable.flag_base``); absent waits are (-1, 0)."""

COL = {name: i for i, name in enumerate(TABLE_COLUMNS)}
NO_WORD = -1


class PlanSummary(NamedTuple):
    tasks: int
    ctas: int
    tasks_per_kind: dict
    weight_bytes: int
    weights_by_tensor: dict
    waits: int


class TaskGroup(NamedTuple):
    """A maximal run of consecutive tickets of one kind."""

    kind: TaskKind
    tasks: tuple


@dataclass(frozen=True)
class TaskTable:
    cfg: K3Config
    tp: int
    tokens: int
    sms: int
    options: MonoOptions
    geometry: StageGeometry
    reduce1_cols: int
    reduce3_cols: int
    tasks: tuple[Task, ...]
    ctas: int
    flag_slots: tuple[tuple[Flag, int], ...]  # flag array layout, in Flag order

    # -- flag array ------------------------------------------------------------
    def flag_base(self, flag: Flag) -> int:
        base = 0
        for f, slots in self.flag_slots:
            if f == flag:
                return base
            base += slots
        raise KeyError(flag)

    @property
    def num_flag_words(self) -> int:
        return sum(slots for _, slots in self.flag_slots)

    def flag_word(self, flag: Flag, index: int) -> int:
        slots = dict(self.flag_slots)[flag]
        if not 0 <= index < slots:
            raise IndexError(f"{flag.name}[{index}]: {slots} slots")
        return self.flag_base(flag) + index

    def flag_of_word(self, word: int) -> tuple[Flag, int]:
        base = 0
        for f, slots in self.flag_slots:
            if word < base + slots:
                return f, word - base
            base += slots
        raise IndexError(f"flag word {word}: the array has {base}")

    # -- views -----------------------------------------------------------------
    def summary(self) -> PlanSummary:
        per_kind, by_tensor = {}, {}
        for task in self.tasks:
            per_kind[task.kind] = per_kind.get(task.kind, 0) + 1
            for name, nbytes in task.streams:
                by_tensor[name] = by_tensor.get(name, 0) + nbytes
        return PlanSummary(
            tasks=len(self.tasks),
            ctas=self.ctas,
            tasks_per_kind=per_kind,
            weight_bytes=sum(by_tensor.values()),
            weights_by_tensor=by_tensor,
            waits=sum(len(t.waits) for t in self.tasks),
        )

    def groups(self) -> list[TaskGroup]:
        out: list[TaskGroup] = []
        run: list[Task] = []
        for task in self.tasks:
            if run and task.kind != run[-1].kind:
                out.append(TaskGroup(run[-1].kind, tuple(run)))
                run = []
            run.append(task)
        if run:
            out.append(TaskGroup(run[-1].kind, tuple(run)))
        return out

    # -- the kernel's encoding -------------------------------------------------
    def as_int_tensor(self) -> torch.Tensor:
        """int32 [num_tasks, len(TABLE_COLUMNS)], row i = ticket i (see TABLE_COLUMNS)."""
        rows = [self._encode(task) for task in self.tasks]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), len(TABLE_COLUMNS))

    def _encode(self, task: Task) -> list[int]:
        if len(task.raises) > 1:
            raise AssertionError(f"ticket {task.ticket}: the int table holds one raise a task")
        row = [0] * len(TABLE_COLUMNS)
        row[COL["kind"]] = int(task.kind)
        row[COL["tile"]] = task.tile
        row[COL["start"]], row[COL["stop"]] = task.span
        row[COL["token"]] = task.token
        row[COL["slot"]] = task.slot
        row[COL["num_waits"]] = len(task.waits)
        row[COL["addr_waits"]] = sum(w.before_loads for w in task.waits)
        for i in range(MAX_WAITS):
            word, count = (NO_WORD, 0)
            if i < len(task.waits):
                wait = task.waits[i]
                word, count = self.flag_word(wait.flag, wait.index), wait.count
            row[COL[f"wait{i}_word"]], row[COL[f"wait{i}_count"]] = word, count
        raised = task.raises[0] if task.raises else None
        row[COL["raise_word"]] = self.flag_word(raised.flag, raised.index) if raised else NO_WORD
        row[COL["raise_peer"]] = int(bool(raised and raised.every_rank))
        row[COL["weight_bytes"]] = task.weight_bytes
        row[COL["late_waits"]] = sum(w.in_task for w in task.waits)
        return row

    def decode_int_tensor(self, table: torch.Tensor) -> list[TaskRow]:
        """The rows of ``as_int_tensor()`` back as TaskRows (its inverse)."""
        rows = []
        for values in table.tolist():
            v = dict(zip(TABLE_COLUMNS, values))
            waits = []
            for i in range(v["num_waits"]):
                flag, index = self.flag_of_word(v[f"wait{i}_word"])
                waits.append((flag, index, v[f"wait{i}_count"], i < v["addr_waits"],
                              i >= v["num_waits"] - v["late_waits"]))
            raised = self.flag_of_word(v["raise_word"]) if v["raise_word"] != NO_WORD else None
            rows.append(
                TaskRow(
                    kind=TaskKind(v["kind"]),
                    tile=v["tile"],
                    span=(v["start"], v["stop"]),
                    token=v["token"],
                    slot=v["slot"],
                    waits=tuple(waits),
                    raised=raised,
                    weight_bytes=v["weight_bytes"],
                )
            )
        return rows

    # -- what each task writes ---------------------------------------------------
    def writes(self, task: Task, rank: int) -> list[Write]:
        """Elements ``task`` writes when rank ``rank`` runs it. Regions are the
        names of layout.py (peer: ar1 logits z ar2 ar3; scratch: x route_ids
        route_w expert_act latent shared_act) and the launch's ``prefix`` / ``out``."""
        return _WRITES[task.kind](self, task, rank)


def _all_rows(lo: int, hi: int) -> tuple:
    return (slice(None), slice(lo, hi))


def _latent_part_writes(table: TaskTable, task: Task, rank: int) -> list[Write]:
    """A latent part's sum of squares, and its columns among the rank's L/T of the weighted latent."""
    rank_cols = table.cfg.routed_expert_hidden_size // table.tp
    lo, hi = (max(c - rank * rank_cols, 0) for c in task.span)
    own = slice(min(lo, rank_cols), min(hi, rank_cols))
    writes = [Write("latent_sq", False, (task.token, task.tile))]
    return writes + ([Write("latent", False, (task.token, own))] if own.start < own.stop else [])


def _split_writes(table: TaskTable, task: Task) -> list[Write]:
    """An M1C task's heads of one (split, token) in the launch's split outputs."""
    split = task.tile // table.geometry.m1c.head_blocks
    heads = slice(*task.span)
    return [Write("split_o", False, (split, task.token, heads)), Write("split_lse", False, (split, task.token, heads))]


def _rank_cols(table: TaskTable, task: Task, rank: int, full: int) -> slice:
    """Columns of an all-gathered [S, full] region that rank ``rank``'s rows land in."""
    base = rank * (full // table.tp)
    return slice(base + task.span[0], base + task.span[1])


def _group_tokens(table: TaskTable, task: Task) -> slice:
    """Tokens a ROUTER / LATENT_DOWN task stores: its group's (geometry.x_group), or all."""
    if task.token < 0:
        return slice(None)
    return slice(task.token, min(task.token + table.geometry.x_group, table.tokens))


def _x_gemv_writes(table: TaskTable, task: Task, rank: int, region: str, full: int) -> list[Write]:
    """A ROUTER / LATENT_DOWN task's push of its rows into every rank's ``region``;
    a split tile's earlier parts (X_K_PARTS) their partial in ``region``_parts."""
    parts = table.geometry.x_parts
    if parts > 1 and task.slot < parts - 1:
        return [Write(f"{region}_parts", False, (task.slot, slice(None), slice(*task.span)))]
    return [Write(region, True, (_group_tokens(table, task), _rank_cols(table, task, rank, full)))]


_WRITES = {
    TaskKind.M1C: lambda tb, t, r: _split_writes(tb, t),
    TaskKind.M1B: lambda tb, t, r: [Write("core", False, (t.token, slice(*t.span)))],
    TaskKind.NOP: lambda tb, t, r: [],
    TaskKind.OPROJ: lambda tb, t, r: [Write("ar1", True, (r, slice(None), slice(*t.span)))],
    TaskKind.REDUCE1: lambda tb, t, r: [Write("prefix", False, (t.token, slice(*t.span))),
                                        Write("seam_part", False, (t.token, t.tile))],
    TaskKind.SEAM_MIX: lambda tb, t, r: [
        Write("seam_h", False, (t.token, slice(*t.span))), Write("seam_hsq", False, (t.token, t.tile))
    ],
    TaskKind.SEAM_NORM: lambda tb, t, r: [Write("x", False, (t.token, slice(*t.span)))],
    TaskKind.ROUTER: lambda tb, t, r: _x_gemv_writes(tb, t, r, "logits", tb.cfg.num_experts),
    TaskKind.LATENT_DOWN: lambda tb, t, r: _x_gemv_writes(tb, t, r, "z", tb.cfg.routed_expert_hidden_size),
    TaskKind.SHARED_GU: lambda tb, t, r: [Write("shared_act", False, _all_rows(*t.span))],
    TaskKind.ROUTE_PART: lambda tb, t, r: [Write("route_keys", False, (t.token, t.tile))],
    TaskKind.ROUTE: lambda tb, t, r: [Write("route_ids", False, (t.token,)), Write("route_w", False, (t.token,))],
    TaskKind.EXPERT_GU: lambda tb, t, r: [Write("expert_act", False, (t.token, t.slot, slice(*t.span)))],
    TaskKind.EXPERT_DOWN: lambda tb, t, r: [Write("ar2", True, (r, t.token, slice(*t.span)))],
    TaskKind.PREFETCH_FINAL: lambda tb, t, r: [],
    TaskKind.PREFETCH_SHARED: lambda tb, t, r: [],
    TaskKind.LATENT_PART: lambda tb, t, r: _latent_part_writes(tb, t, r),
    TaskKind.FINAL: lambda tb, t, r: [Write("ar3", True, (r, slice(None), slice(*t.span)))],
    TaskKind.REDUCE3: lambda tb, t, r: [Write("out", False, (t.token, slice(*t.span)))],
}


# -- planning --------------------------------------------------------------------


def tiles(extent: int, rows: int) -> list[tuple[int, int, int]]:
    """(tile, start, stop) covering [0, extent) in steps of ``rows`` (the last may be short)."""
    return [(i, lo, min(lo + rows, extent)) for i, lo in enumerate(range(0, extent, rows))]


def reduce_tile_cols(producer_rows: int) -> int:
    """A reduce tile holds whole producer tiles, so each producer raises one flag."""
    return math.ceil(REDUCE_TILE_COLS / producer_rows) * producer_rows


class _WaitSpec(NamedTuple):
    flag: Flag
    index: int
    count: int
    before_loads: bool = False
    in_task: bool = False


class _TaskSpec(NamedTuple):
    kind: TaskKind
    tile: int
    span: tuple[int, int]
    token: int
    slot: int
    streams: tuple
    waits: tuple
    raises: tuple


SHARED_GU_WEIGHTS = ("shared_gate", "shared_up")  # a SHARED_GU task's rows (or its PREFETCH_SHARED task's)


class _Planner:
    """Appends the kinds' tasks in table order (see the order above)."""

    def __init__(self, cfg: K3Config, tp: int, tokens: int, geometry: StageGeometry, options: MonoOptions):
        self.cfg, self.tp, self.S, self.g, self.options = cfg, tp, tokens, geometry, options
        self.K = cfg.num_experts_per_token
        self.shapes = shard_shapes(cfg, tp)
        self.reduce1_cols = reduce_tile_cols(geometry.oproj.rows)
        self.reduce3_cols = reduce_tile_cols(geometry.final.rows)
        self.specs: list[_TaskSpec] = []
        self._streams: dict = {}
        H = cfg.hidden_size
        self.oproj_tiles = tiles(H, geometry.oproj.rows)
        self.reduce1_tiles = tiles(H, self.reduce1_cols)
        self.seam_chunks = tiles(H, geometry.seam_cols)
        self.route_parts = tiles(cfg.num_experts, geometry.route_chunk)
        self.latent_parts = tiles(cfg.routed_expert_hidden_size, geometry.latent_part)
        self.router_tiles = tiles(cfg.num_experts // tp, geometry.router.rows)
        self.latent_tiles = tiles(cfg.routed_expert_hidden_size // tp, geometry.latent_down.rows)
        self.shared_tiles = tiles(cfg.shared_intermediate // tp, geometry.shared_gate_up.rows)
        self.gate_up_tiles = tiles(cfg.moe_intermediate_size // tp, geometry.expert_gate_up.rows)
        self.down_tiles = tiles(cfg.routed_expert_hidden_size, geometry.expert_down.rows)
        self.final_tiles = tiles(H, geometry.final.rows)
        self.reduce3_tiles = tiles(H, self.reduce3_cols)
        # M1B tiles of a token: the rank's core columns, head-major (tile = head * blocks_per_head + block)
        m1b = geometry.m1b
        self.m1b_tiles = tiles(m1b.heads * m1b.value, m1b.block_dv) if m1b is not None else []
        m1c = geometry.m1c  # M1C head blocks of one (token, split): tile = split * head_blocks + block
        self.m1c_blocks = tiles(m1c.heads, m1c.block_h) if m1c is not None else []

    # -- weight bytes --------------------------------------------------------------
    def _row_bytes(self, name: str) -> int:
        """Bytes of one output row of a row-tiled weight ([rows, in] or [E, rows, in])."""
        shape, dtype = self.shapes[name]
        return shape[-1] * dtype.itemsize

    def _whole_bytes(self, name: str) -> int:
        shape, dtype = self.shapes[name]
        return math.prod(shape) * dtype.itemsize

    def _rows(self, names, lo: int, hi: int, experts: int = 1) -> tuple:
        key = (tuple(names), hi - lo, experts)
        if key not in self._streams:  # thousands of tasks share a handful of tile shapes
            self._streams[key] = tuple((name, experts * (hi - lo) * self._row_bytes(name)) for name in names)
        return self._streams[key]

    def _vectors_once(self, token: int, names) -> tuple:
        """Small whole vectors every task of a per-token kind reads: token 0's task
        streams them from HBM, the others find them in L2."""
        return tuple((name, self._whole_bytes(name)) for name in names) if token == 0 else ()

    def _vector_slices_once(self, token: int, names, lo: int, hi: int) -> tuple:
        """Elements lo .. hi of small vectors, as _vectors_once for a chunk."""
        return tuple((name, (hi - lo) * self.shapes[name][1].itemsize) for name in names) if token == 0 else ()

    def add(self, kind, *, tile=-1, span=(0, 0), token=-1, slot=-1, streams=(), waits=(), raises=()):
        self.specs.append(_TaskSpec(kind, tile, span, token, slot, tuple(streams), tuple(waits), tuple(raises)))

    # -- the kinds, in table order -------------------------------------------------
    def m1c(self):
        # the cache is an activation whose size the request layout sets at run
        # time: the tasks stream no weights, floor.py counts the cache bytes
        m1c = self.g.m1c
        if m1c is None:
            return
        for token in range(self.S):
            for split in range(m1c.splits):
                for block, lo, hi in self.m1c_blocks:
                    self.add(TaskKind.M1C, tile=split * m1c.head_blocks + block, span=(lo, hi), token=token,
                             raises=[(Flag.SPLITS, 0)])

    def m1b(self):
        m1b = self.g.m1b
        if m1b is None:
            return
        row_bytes = m1b.latent * (1 if m1b.w_v_fp8 else 2)
        # each task combines every split of its head for one token: one wait on every M1C task
        m1c = self.g.m1c
        waits = [_WaitSpec(Flag.SPLITS, 0, m1c.tasks)] if m1c is not None else []
        for token in range(self.S):
            for tile, lo, hi in self.m1b_tiles:  # token 0's tasks stream w_v, the others find it in L2
                streams = (("w_v", (hi - lo) * row_bytes),) if token == 0 else ()
                self.add(TaskKind.M1B, tile=tile, span=(lo, hi), token=token, streams=streams, waits=waits,
                         raises=[(Flag.CORE, 0)])

    def oproj(self):
        # o_proj reads all of the rank's core: one wait on every M1B task
        waits = [_WaitSpec(Flag.CORE, 0, self.S * len(self.m1b_tiles))] if self.m1b_tiles else []
        for tile, lo, hi in self.oproj_tiles:
            self.add(TaskKind.OPROJ, tile=tile, span=(lo, hi), streams=self._rows(["o_proj"], lo, hi),
                     waits=waits, raises=[(Flag.AR1, lo // self.reduce1_cols)])

    def reduce1(self):
        if self.reduce1_cols != self.g.score_cols:
            raise K3InputError(f"o_proj rows {self.g.oproj.rows}: a REDUCE1 tile of {self.reduce1_cols} columns is not "
                               f"a seam score chunk ({self.g.score_cols})")
        for tile, lo, hi in self.reduce1_tiles:
            producers = math.ceil((hi - lo) / self.g.oproj.rows)
            for token in range(self.S):
                self.add(TaskKind.REDUCE1, tile=tile, span=(lo, hi), token=token,
                         streams=self._vector_slices_once(token, ["ares_norm", "ares_proj"], lo, hi),
                         waits=[_WaitSpec(Flag.AR1, tile, self.tp * producers)], raises=[(Flag.P_READY, token)])

    def seam_mix(self):
        for token in range(self.S):
            for chunk, lo, hi in self.seam_chunks:
                self.add(TaskKind.SEAM_MIX, tile=chunk, span=(lo, hi), token=token,
                         waits=[_WaitSpec(Flag.P_READY, token, len(self.reduce1_tiles))],
                         raises=[(Flag.MIXED, token)])

    def seam_norm(self):
        for token in range(self.S):
            for chunk, lo, hi in self.seam_chunks:
                self.add(TaskKind.SEAM_NORM, tile=chunk, span=(lo, hi), token=token,
                         streams=self._vector_slices_once(token, ["post_norm"], lo, hi),
                         waits=[_WaitSpec(Flag.MIXED, token, len(self.seam_chunks))], raises=[(Flag.X_READY, 0)])

    def _x_gemv(self, kind, tile_list, names, flag, group_tokens=None, stream_weights=True, x_written=None):
        """A task per row tile and group of ``group_tokens`` tokens (all S when
        None), tile-major: a tile's groups run side by side, the first reading
        its rows from HBM (where ``stream_weights``: else a prefetch task did),
        the others from L2. ``token`` is the group's first. They wait for x
        (``x_written``, by default every seam norm task's)."""
        x_written = x_written or _WaitSpec(Flag.X_READY, 0, self.S * len(self.seam_chunks))
        if kind in X_PART_FLAGS and self.g.x_parts > 1:
            self._x_gemv_parts(kind, tile_list, names, flag, x_written)
            return
        firsts = range(0, self.S, group_tokens or self.S)
        for tile, lo, hi in tile_list:
            for first in firsts:
                streams = self._rows(names, lo, hi) if first == 0 and stream_weights else ()
                self.add(kind, tile=tile, span=(lo, hi), token=first if group_tokens else -1, streams=streams,
                         waits=[x_written], raises=[(flag, 0)])

    def _x_gemv_parts(self, kind, tile_list, names, flag, x_written):
        """X_K_PARTS: a task per (row tile, part of K), part-major within a tile
        (``slot`` = the part), each streaming its part of the rows. The parts
        before the last raise the tile's X_PART_FLAGS word; the last polls it in
        the task, after its own part, and raises ``flag`` for the tile."""
        parts = self.g.x_parts
        parts_flag = X_PART_FLAGS[kind]
        for tile, lo, hi in tile_list:
            streams = tuple((name, n // parts) for name, n in self._rows(names, lo, hi))
            for part in range(parts - 1):
                self.add(kind, tile=tile, span=(lo, hi), slot=part, streams=streams, waits=[x_written],
                         raises=[(parts_flag, tile)])
            self.add(kind, tile=tile, span=(lo, hi), slot=parts - 1, streams=streams,
                     waits=[x_written, _WaitSpec(parts_flag, tile, parts - 1, in_task=True)], raises=[(flag, 0)])

    def _x_group(self) -> int | None:
        return self.g.x_group if self.g.x_group < self.S else None

    def router(self):
        # StageGeometry.router_rms: the tasks form x from h themselves, after the mix
        mixed = _WaitSpec(Flag.MIXED, 0, len(self.seam_chunks)) if self.g.router_rms else None
        self._x_gemv(TaskKind.ROUTER, self.router_tiles, ["router"], Flag.LOGITS, self._x_group(), x_written=mixed)

    def latent_down(self):
        self._x_gemv(TaskKind.LATENT_DOWN, self.latent_tiles, ["latent_down"], Flag.Z, self._x_group())

    def prefetch_shared(self):
        if not self.options.prefetch_shared:
            return
        for tile, lo, hi in self.shared_tiles:
            self.add(TaskKind.PREFETCH_SHARED, tile=tile, span=(lo, hi), streams=self._rows(SHARED_GU_WEIGHTS, lo, hi))

    def shared_gate_up(self):
        self._x_gemv(TaskKind.SHARED_GU, self.shared_tiles, SHARED_GU_WEIGHTS, Flag.SHARED_READY,
                     stream_weights=not self.options.prefetch_shared)  # else PREFETCH_SHARED streamed them

    def route_part(self):
        for token in range(self.S):
            for part, lo, hi in self.route_parts:
                self.add(TaskKind.ROUTE_PART, tile=part, span=(lo, hi), token=token,
                         streams=self._vector_slices_once(token, ["router_bias"], lo, hi),
                         waits=[_WaitSpec(Flag.LOGITS, 0, self.tp * len(self.router_tiles) * self.g.x_groups)],
                         raises=[(Flag.RANKED, token)])

    def route(self):
        for token in range(self.S):
            self.add(TaskKind.ROUTE, token=token, waits=[_WaitSpec(Flag.RANKED, token, len(self.route_parts))],
                     raises=[(Flag.ROUTED, token)])

    def expert_gate_up(self):
        names = ["w1_packed", "w1_scale", "w3_packed", "w3_scale"]
        z_arrived = _WaitSpec(Flag.Z, 0, self.tp * len(self.latent_tiles) * self.g.x_groups)
        for token in range(self.S):
            waits = (_WaitSpec(Flag.ROUTED, token, 1, before_loads=True), z_arrived)  # shared by the token's tasks
            raises = ((Flag.ACT, token),)
            for slot in range(self.K):
                for tile, lo, hi in self.gate_up_tiles:
                    self.add(TaskKind.EXPERT_GU, tile=tile, span=(lo, hi), token=token, slot=slot,
                             streams=self._rows(names, lo, hi), waits=waits, raises=raises)

    def expert_down(self):
        act_count = self.K * len(self.gate_up_tiles)
        for token in range(self.S):
            waits = (_WaitSpec(Flag.ROUTED, token, 1, before_loads=True), _WaitSpec(Flag.ACT, token, act_count))
            raises = ((Flag.AR2, token),)
            for tile, lo, hi in self.down_tiles:
                self.add(TaskKind.EXPERT_DOWN, tile=tile, span=(lo, hi), token=token,
                         streams=self._rows(["w2_packed", "w2_scale"], lo, hi, experts=self.K),
                         waits=waits, raises=raises)

    def prefetch_final(self):
        if not self.options.prefetch_final:
            return
        for tile, lo, hi in self.final_tiles:
            self.add(TaskKind.PREFETCH_FINAL, tile=tile, span=(lo, hi),
                     streams=self._rows(["latent_up", "shared_down"], lo, hi))

    def latent_part(self):
        # each rank reads the norm vector in its own L/T columns, spread over
        # the parts that hold them: counted on the first part (a table is every rank's)
        rank_cols = self.cfg.routed_expert_hidden_size // self.tp
        for token in range(self.S):
            for part, lo, hi in self.latent_parts:
                streams = self._vector_slices_once(token, ["latent_norm"], 0, rank_cols) if part == 0 else ()
                self.add(TaskKind.LATENT_PART, tile=part, span=(lo, hi), token=token, streams=streams,
                         waits=[_WaitSpec(Flag.AR2, token, self.tp * len(self.down_tiles))],
                         raises=[(Flag.LATENT_READY, 0)])

    def final(self):
        for tile, lo, hi in self.final_tiles:
            streams = () if self.options.prefetch_final else self._rows(["latent_up", "shared_down"], lo, hi)
            # SHARED_READY first: it completes long before LATENT_READY (with
            # final_split the task's own wait, after the shared down-projection)
            self.add(TaskKind.FINAL, tile=tile, span=(lo, hi), streams=streams,
                     waits=[_WaitSpec(Flag.SHARED_READY, 0, len(self.shared_tiles)),
                            _WaitSpec(Flag.LATENT_READY, 0, self.S * len(self.latent_parts),
                                      in_task=self.options.final_split)],
                     raises=[(Flag.AR3, lo // self.reduce3_cols)])

    def reduce3(self):
        for tile, lo, hi in self.reduce3_tiles:
            producers = math.ceil((hi - lo) / self.g.final.rows)
            for token in range(self.S):
                self.add(TaskKind.REDUCE3, tile=tile, span=(lo, hi), token=token,
                         waits=[_WaitSpec(Flag.AR3, tile, self.tp * producers)])

    def _route_shared_and_gate_up(self) -> tuple:
        """SHARED_GU, the route's kinds, EXPERT_GU; or the route first (MonoOptions.route_early);
        or the route, EXPERT_GU, then SHARED_GU (MonoOptions.shared_late)."""
        route = (self.route_part, self.route)
        if self.options.shared_late:
            return (*route, self.expert_gate_up, self.shared_gate_up)
        if self.options.route_early:
            return (*route, self.shared_gate_up, self.expert_gate_up)
        return (self.shared_gate_up, *route, self.expert_gate_up)

    def in_table_order(self) -> list[_TaskSpec]:
        early = (self.prefetch_final,) if self.options.prefetch_final_early else ()
        late = () if early else (self.prefetch_final,)
        for step in (self.m1c, self.m1b, self.oproj, self.reduce1, self.seam_mix, self.seam_norm,
                     self.router, self.latent_down, *early, self.prefetch_shared, *self._route_shared_and_gate_up(),
                     self.expert_down, *late, self.latent_part, self.final, self.reduce3):
            step()
        return self.specs

    def flag_slots(self) -> tuple[tuple[Flag, int], ...]:
        per_token = self.S
        slots = {
            Flag.AR1: len(self.reduce1_tiles),
            Flag.P_READY: per_token,
            Flag.X_READY: 1,
            Flag.LOGITS: 1,
            Flag.Z: 1,
            Flag.SHARED_READY: 1,
            Flag.ROUTED: per_token,
            Flag.ACT: per_token,
            Flag.AR2: per_token,
            Flag.LATENT_READY: 1,
            Flag.AR3: len(self.reduce3_tiles),
            Flag.CORE: 1 if self.m1b_tiles else 0,
            Flag.SPLITS: 1 if self.m1c_blocks else 0,
            Flag.MIXED: per_token,
            Flag.RANKED: per_token,
            Flag.DISCARD: 1,
            Flag.LOGIT_PARTS: len(self.router_tiles) if self.g.x_parts > 1 else 0,
            Flag.Z_PARTS: len(self.latent_tiles) if self.g.x_parts > 1 else 0,
        }
        return tuple((flag, slots[flag]) for flag in Flag)


def _ticketed(specs: list[_TaskSpec]) -> tuple[Task, ...]:
    """Tickets in list order; each wait's sources are the tickets raising its flag."""
    raisers: dict[tuple[Flag, int], list[int]] = {}
    for ticket, spec in enumerate(specs):
        for flag, index in spec.raises:
            raisers.setdefault((flag, index), []).append(ticket)
    sources = {key: tuple(tickets) for key, tickets in raisers.items()}  # shared, not copied per wait
    waits_of: dict = {}  # the tasks of one token share their waits and raises
    raises_of: dict = {}
    tasks = []
    for ticket, spec in enumerate(specs):
        if spec.waits not in waits_of:
            waits_of[spec.waits] = tuple(
                Wait(w.flag, w.index, w.count, sources.get((w.flag, w.index), ()), w.before_loads, w.in_task)
                for w in spec.waits
            )
        if spec.raises not in raises_of:
            raises_of[spec.raises] = tuple(Raise(flag, index) for flag, index in spec.raises)
        tasks.append(
            Task(ticket, spec.kind, spec.tile, spec.span, spec.token, spec.slot, spec.streams,
                 waits_of[spec.waits], raises_of[spec.raises])
        )
    return tuple(tasks)


IN_TASK_WAIT_KINDS = frozenset({TaskKind.FINAL, TaskKind.ROUTER, TaskKind.LATENT_DOWN})
"""Kinds whose task function polls its in-task waits itself (kernels/mono.py)."""


def _check_invariant(tasks: tuple[Task, ...]) -> None:
    """Every wait's raisers precede it: the table cannot deadlock (a planner bug otherwise)."""
    last_source = {}  # the sources tuples are shared: one max each
    for task in tasks:
        for wait in task.waits:
            key = id(wait.sources)
            if key not in last_source:
                last_source[key] = max(wait.sources, default=len(tasks))
            if last_source[key] >= task.ticket:
                raise AssertionError(
                    f"planner: ticket {task.ticket} ({task.kind.name}) waits {wait.flag.name}[{wait.index}] "
                    f"raised by tickets {wait.sources[:8]}: not all lower"
                )
        if len(task.waits) > MAX_WAITS:
            raise AssertionError(f"planner: ticket {task.ticket} has {len(task.waits)} waits, at most {MAX_WAITS}")
        in_task = [w.in_task for w in task.waits]
        part_flag = X_PART_FLAGS.get(task.kind)  # a split tile's last part polls only its parts' flag
        if (in_task != sorted(in_task) or (any(in_task) and task.kind not in IN_TASK_WAIT_KINDS)
                or any(w.in_task and part_flag not in (None, w.flag) for w in task.waits)):
            raise AssertionError(f"planner: ticket {task.ticket} ({task.kind.name}) has in-task waits {in_task}: "
                                 f"only the last waits of {[k.name for k in IN_TASK_WAIT_KINDS]} may be")


MONO_WARPS = 4
"""Warps of a mono CTA: every task kind's tile is laid out for 4 (the dense and
MXFP4 loops' rows a warp, the seam's and the route's reductions)."""

SM_REGISTERS = 65536
"""32-bit registers of a Hopper SM (the H100 and H200 alike), shared by its resident CTAs."""

REGISTER_ALLOCATION_UNIT = 8
"""ptxas gives a thread registers in multiples of 8."""

COMPILER_MAX_REGISTERS = 255
"""The most registers ptxas gives a thread, capped or not."""


def resident_register_cap(ctas_per_sm: int, warps: int = MONO_WARPS) -> int | None:
    """The maxnreg that lets ``ctas_per_sm`` CTAs of ``warps`` warps stay on one
    SM at once, None where the compiler's own choice (at most 255) already does
    (2 CTAs of 4 warps). Without it a planned third or fourth CTA would wait for a
    slot, the grid larger than what runs. 3 CTAs: 168, 4: 128; the f16 expert
    loops (TileChoice.expert_f16) fit 168 with no spill inside a step loop, 128 with
    one to five loads and stores a step (offline sm_90a builds, docs/PERF.md)."""
    fit = SM_REGISTERS // (ctas_per_sm * warps * 32)
    if fit >= COMPILER_MAX_REGISTERS:
        return None
    return fit - fit % REGISTER_ALLOCATION_UNIT


def cta_count(num_tasks: int, sms: int, ctas_per_sm: int = 1) -> int:
    """``ctas_per_sm`` CTAs an SM (persistent: each walks tickets until none is
    left), never more CTAs than tickets: an extra CTA would find none."""
    return min(num_tasks, sms * ctas_per_sm)


def _validate(cfg: K3Config, tp: int, tokens: int, sms: int, options) -> None:
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(tokens) or not 1 <= tokens <= MAX_TOKENS:
        raise K3InputError(f"tokens: expected an integer in 1..{MAX_TOKENS}, got {tokens!r}")
    if not is_int(tp):
        raise K3InputError(f"tp: expected an integer, got {tp!r}")
    cfg.validate_tp(tp)
    if not is_int(sms) or sms < 1:
        raise K3InputError(f"sms: expected a positive integer (SMs or CUs of the device), got {sms!r}")
    if not isinstance(options, MonoOptions):
        raise K3InputError(f"options: expected MonoOptions, got {type(options).__name__}")
    if not is_int(options.ctas_per_sm) or options.ctas_per_sm < 1:
        raise K3InputError(f"options.ctas_per_sm: expected a positive integer, got {options.ctas_per_sm!r}")
    if not isinstance(options.tiles, TileChoice):
        raise K3InputError(f"options.tiles: expected TileChoice, got {type(options.tiles).__name__}")
    options.tiles.check()
    if options.prefetch_final_early and not options.prefetch_final:
        raise K3InputError("options.prefetch_final_early: it moves the PREFETCH_FINAL tasks: it needs prefetch_final")
    if options.m1b is not None:
        _validate_m1b(cfg, options.m1b)
    if options.m1c is not None:
        _validate_m1c(options.m1b, options.m1c, tokens)


def _validate_m1b(cfg: K3Config, m1b) -> None:
    """M1b's widths are tl.arange / tl.dot extents: powers of two, at least 16."""
    if not isinstance(m1b, M1bShape):
        raise K3InputError(f"options.m1b: expected M1bShape, got {type(m1b).__name__}")
    if not isinstance(m1b.splits, int) or isinstance(m1b.splits, bool) or m1b.splits < 1:
        raise K3InputError(f"options.m1b.splits: expected a positive integer, got {m1b.splits!r}")
    for name, width in (("options.m1b.latent", m1b.latent), ("v_head_dim", cfg.v_head_dim)):
        if not isinstance(width, int) or width < DOT_MIN_TOKENS or width & (width - 1):
            raise K3InputError(f"{name}: M1b expects a power of two >= {DOT_MIN_TOKENS}, got {width!r}")


def _validate_m1c(m1b, m1c, tokens: int) -> None:
    """M1c feeds M1b; its positional width is a tl.arange / tl.dot extent."""
    if not isinstance(m1c, M1cShape):
        raise K3InputError(f"options.m1c: expected M1cShape, got {type(m1c).__name__}")
    if m1b is None:
        raise K3InputError("options.m1c: M1c writes M1b's split outputs: it needs options.m1b too")

    def positive(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if not positive(m1c.page_size):
        raise K3InputError(f"options.m1c.page_size: expected a positive integer, got {m1c.page_size!r}")
    if not positive(m1c.requests) or m1c.requests > tokens:
        raise K3InputError(f"options.m1c.requests: expected an integer in 1..{tokens} (S), got {m1c.requests!r}")
    if not positive(m1c.rope) or m1c.rope < DOT_MIN_TOKENS or m1c.rope & (m1c.rope - 1):
        raise K3InputError(f"options.m1c.rope: M1c expects a power of two >= {DOT_MIN_TOKENS}, got {m1c.rope!r}")


def plan(cfg: K3Config, tp: int, tokens: int, sms: int, options: MonoOptions | None = None) -> TaskTable:
    """The task table of one rank's mono launch (every rank runs the same one)."""
    options = MonoOptions() if options is None else options
    _validate(cfg, tp, tokens, sms, options)
    geometry = stage_geometry(cfg, tp, tokens, options.m1b, options.m1c, options.tiles)
    planner = _Planner(cfg, tp, tokens, geometry, options)
    tasks = _ticketed(planner.in_table_order())
    _check_invariant(tasks)
    return TaskTable(
        cfg=cfg,
        tp=tp,
        tokens=tokens,
        sms=sms,
        options=options,
        geometry=geometry,
        reduce1_cols=planner.reduce1_cols,
        reduce3_cols=planner.reduce3_cols,
        tasks=tasks,
        ctas=cta_count(len(tasks), sms, options.ctas_per_sm),
        flag_slots=planner.flag_slots(),
    )


VARIANTS = ("skip", "double")


def timing_variant(table: TaskTable, how: str, kind: TaskKind) -> TaskTable:
    """A table for timing only, to say what ``kind`` costs inside the launch.

    ``skip``: every task of ``kind`` becomes a NOP that keeps its waits and its
    raise (what it would write stays what the buffers held: run the plain
    table on them first). ``double``: every task of ``kind`` runs twice, the
    copy right after it raising only the DISCARD word (the kernel raises a
    task's word unconditionally; no wait reads DISCARD). The flags and their counts are the
    plain table's in both, so a varied launch can share a plain launch's
    buffers, flags and epochs; half the launch time of double minus skip is
    the kind's cost in the launch."""
    if how not in VARIANTS:
        raise K3InputError(f"variant: expected one of {list(VARIANTS)}, got {how!r}")
    kind = TaskKind(kind)
    if kind == TaskKind.NOP or kind not in {t.kind for t in table.tasks}:
        raise K3InputError(f"variant: the table has no {kind.name} tasks to {how}")
    varied, ticket_of = [], {}
    for task in table.tasks:
        ticket_of[task.ticket] = len(varied)
        if task.kind != kind:
            varied.append(task)
        elif how == "skip":  # a NOP polls every wait before its raise
            waits = tuple(replace(w, in_task=False) for w in task.waits)
            varied.append(replace(task, kind=TaskKind.NOP, streams=(), waits=waits))
        else:
            varied += [task, replace(task, raises=(Raise(Flag.DISCARD, 0),))]
    sources = {}  # remapped once per shared sources tuple

    def remap(wait: Wait) -> Wait:
        if id(wait.sources) not in sources:
            sources[id(wait.sources)] = tuple(ticket_of[s] for s in wait.sources)
        return replace(wait, sources=sources[id(wait.sources)])

    tasks = tuple(replace(t, ticket=i, waits=tuple(remap(w) for w in t.waits)) for i, t in enumerate(varied))
    _check_invariant(tasks)
    return replace(table, tasks=tasks, ctas=cta_count(len(tasks), table.sms, table.options.ctas_per_sm))
