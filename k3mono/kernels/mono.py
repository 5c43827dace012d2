"""The mono launch: one persistent kernel per rank walks the planner's task table.

Every CTA takes tickets from a counter in scratch (``ctl[0]``) in table order
and grabs its NEXT ticket once the current one's waits are met, before it runs
it (the atomic's latency hides behind the task). Not before the waits: a CTA
blocked on a flag would then hold a second ticket no other CTA can take, and
at S = 1 gate/up tickets queued two deep behind one CTA (the trace: 35 us for
192 gate/up tasks of 17 us each). A ticket's row (planner.TABLE_COLUMNS, int32) names
its kind, tile / span, token, slot, up to MAX_WAITS flag waits and one raise.
Every wait names flags raised by lower tickets (planner invariant), so any
grid completes, and the interpreter's single program walks the table in order.

Per task:

1. poll the ``addr_waits`` first waits (the expert ids: they gate the weight
   addresses of EXPERT_GU / EXPERT_DOWN);
2. weights before waits (PREFETCH): if one of the remaining waits is not met
   at its first poll (PREFETCH = 1; always with PREFETCH = 2), one thread asks
   the SM's copy engine to pull the task's weight rows into L2 (prefetch_l2:
   cp.async.bulk.prefetch, one instruction a range, nothing held or waited
   for; ROUTER, LATENT_DOWN, SHARED_GU, FINAL; the chosen experts' rows and
   scales for EXPERT_GU / EXPERT_DOWN; the kinds in PREFETCH_KINDS always,
   before their other waits: the experts', and OPROJ's w_o rows before its wait
   for M1B's core)
   while the awaited flag settles; the stage function then reads them from
   L2. (PREFETCH_FINAL and PREFETCH_SHARED tasks, options of the table, do
   only that, for FINAL's and SHARED_GU's rows.)
   OPROJ waits only where M1B runs first (then its w_o rows are asked for while
   the core settles; otherwise its weights stream at once); M1C has no wait; M1B
   has none either, or, where M1C runs first, one for every M1C task (its w_v
   tile is not asked for before it: a few KB, next to the cache M1C streams);
   REDUCE*, SEAM_*, ROUTE* and LATENT_* read activations (and norm vectors) only;
3. poll the other waits, in table order, but for the task's own (``late_waits``:
   FINAL with MonoOptions.final_split polls LATENT_READY after its shared
   down-projection, before its latent up-projection; the last part of a
   split ROUTER / LATENT_DOWN tile, planner.X_K_PARTS, polls its tile's
   parts flag after its own part, before it sums them);
4. run the kind's task function, which stores its own results: the GEMV kinds
   (``*_push_task`` below: the stage task function unchanged, then its tile
   into each of the NP peer buffers: o_proj / final partials to ar slot
   ``rank``, router logits and z into the rank's columns) raise the task's
   flag on each peer (barrier + one release atomic); expert_down_push_task
   stores into the own ar2 slot, then (NP > 1) copies the rows to every peer
   before raising. mla_back_task (M1B, an MLA layer's first tasks) stores its
   columns of one token's row of the rank's core; the own CORE flag then counts
   them for OPROJ.
   mla_attn_task (M1C, before M1B) stores one (token, split, head block) of
   the split outputs into the launch's scratch (layout.scratch_layout:
   split_o, split_lse); the own SPLITS flag counts them for M1B.

A failed (timed out) wait records itself in the health buffer (sync.py) and
stops the CTA. A TRACE build records every ticket's SM and global-timer
readings (taken, ready, done) for k3mono/trace.py. On exit every CTA bumps
``ctl[1]``; the last one resets both control words and advances the rank's
device ``epoch`` word, so the next launch (a CUDA-graph replay included)
needs no host work.

Peer buffer of a rank (the kernel reads the NP peers' base addresses from a
device table in a loop that is not unrolled: NP buffers as kernel arguments,
unrolled, kept their bases live in registers across the persistent loop and
cost the full-peer build some 90 registers a thread), viewed as fp32 / bf16 / int32:

    [parity 0: layout.peer_layout][parity 1: the same][flags: int32 words]

Epoch e uses parity e & 1; flags hold e * count.
LOOPBACK (NP = 1, peers = (own,)): the other ranks' pushes are pre-written
by the host into both parities and the peer waits' counts in the table are
divided by T (only this rank's own raises arrive).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attnres import block_rows, score_partials, seam_mix_task, seam_norm_task, seam_query, seam_scale
from .common import as_f32, prefetch_l2, to_bf16
from .experts import GROUP, expert_down_mma_task, expert_down_task, expert_gate_up_mma_task, expert_gate_up_task
from .final import final_sum
from .gemv import gemv_part, gemv_tile, group_window, store_rows, sum_parts
from .latent_down import latent_down_task
from .latent_norm import latent_part_task, latent_scale
from .mla_attn import mla_attn_task
from .mla_back import mla_back_task
from .mxfp4 import ACT_PRESCALE
from .oproj import oproj_task
from .reduce import final_reduce_chunk, reduce_prefix_chunk
from .route import route_merge_task, route_part_task
from .router import router_task
from .shared import shared_gate_up_task
from .sync import poll_once, raise_counter, reached, wait_counter


# kind codes (planner.TaskKind)
K_OPROJ = tl.constexpr(0)
K_REDUCE1 = tl.constexpr(1)
K_ROUTER = tl.constexpr(3)
K_LATENT_DOWN = tl.constexpr(4)
K_SHARED_GU = tl.constexpr(5)
K_ROUTE = tl.constexpr(6)
K_EXPERT_GU = tl.constexpr(7)
K_EXPERT_DOWN = tl.constexpr(8)
K_PREFETCH_FINAL = tl.constexpr(9)
K_FINAL = tl.constexpr(11)
K_REDUCE3 = tl.constexpr(12)
K_M1B = tl.constexpr(13)
K_NOP = tl.constexpr(14)
K_M1C = tl.constexpr(15)
K_SEAM_MIX = tl.constexpr(16)
K_SEAM_NORM = tl.constexpr(17)
K_ROUTE_PART = tl.constexpr(18)
K_PREFETCH_SHARED = tl.constexpr(19)
K_LATENT_PART = tl.constexpr(20)

# int table columns (planner.TABLE_COLUMNS)
C_KIND = tl.constexpr(0)
C_TILE = tl.constexpr(1)
C_START = tl.constexpr(2)
C_STOP = tl.constexpr(3)
C_TOKEN = tl.constexpr(4)
C_SLOT = tl.constexpr(5)
C_NWAITS = tl.constexpr(6)
C_NADDR = tl.constexpr(7)
C_WAIT0 = tl.constexpr(8)  # word, count pairs from here
C_RAISE = tl.constexpr(12)
C_RAISE_PEER = tl.constexpr(13)
C_LATE = tl.constexpr(15)
MAX_WAITS = tl.constexpr(2)
TRACE_WORDS = tl.constexpr(4)  # a traced ticket's row: SM, taken, ready, done


@triton.jit
def _bytes(w_ptr):
    """A packed MXFP4 weight as bytes (its int32 words in mma order, or already bytes)."""
    return w_ptr.to(tl.pointer_type(tl.uint8))


@triton.jit
def _prefetch_rows(
    w_ptr,  # [N, K] (any element type), rows contiguous
    row0,
    row1,  # one past the last row wanted
    N: tl.constexpr,
    K: tl.constexpr,
):
    """Rows row0 .. row1 of w into L2 (prefetch_l2)."""
    prefetch_l2(w_ptr + row0 * K, w_ptr + tl.minimum(row1, N) * K)


@triton.jit
def _peer(
    peer_table_ptr,  # int64 [NP]: the peer buffers' byte addresses
    p,
    DTYPE: tl.constexpr,
):
    """Peer p's buffer as a DTYPE pointer."""
    return tl.load(peer_table_ptr + p).to(tl.pointer_type(DTYPE))


@triton.jit
def _raise_on_peers(
    peer_table_ptr,  # int64 [NP]
    word,  # the flag's int32 index in a peer buffer
    NP: tl.constexpr,
    SCOPE: tl.constexpr,
):
    for p in range(NP):
        raise_counter(_peer(peer_table_ptr, p, tl.int32) + word, SCOPE)


@triton.jit
def _push_rows(
    peer_table_ptr,  # int64 [NP]
    slot,  # elements (of DTYPE) from a peer buffer's start to the slot's row of the tile's first token
    stride,  # the slot's row stride
    tile,  # [SP, ROWS] in DTYPE
    row0,
    first,  # the tile's first token stored (kernels/gemv.py store_rows)
    S: tl.constexpr,
    N: tl.constexpr,
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    NP: tl.constexpr,
    DTYPE: tl.constexpr,
):
    for p in range(NP):
        store_rows(_peer(peer_table_ptr, p, DTYPE) + slot, stride, tile, row0, first, S, N, SP, ROWS)


# The GEMV tasks with their pushes, so that every task kind is one call that
# stores its own results. ``slot`` is the rank's slot in this epoch's region
# (elements of the pushed dtype), ``word`` the raised flag's word.


@triton.jit
def oproj_push_task(
    tile,
    core_ptr,  # bf16 [S, C/T], row stride stride_cs
    stride_cs,
    w_o_ptr,  # bf16 [H, C/T]
    peer_table_ptr,  # int64 [NP]
    slot,  # fp32 AR1 [S, H] of this rank
    word,
    S: tl.constexpr,
    H: tl.constexpr,
    C_R: tl.constexpr,
    SP: tl.constexpr,
    O_ROWS: tl.constexpr,
    O_BK: tl.constexpr,
    USE_DOT: tl.constexpr,
    O_EVEN: tl.constexpr,
    UPCAST: tl.constexpr,
    NP: tl.constexpr,
    SCOPE: tl.constexpr,
):
    acc = oproj_task(tile, core_ptr, stride_cs, w_o_ptr, C_R, S, H, C_R, SP, O_ROWS, O_BK, USE_DOT, O_EVEN, UPCAST)
    _push_rows(peer_table_ptr, slot, H, acc, tile * O_ROWS, 0, S, H, SP, O_ROWS, NP, tl.float32)
    _raise_on_peers(peer_table_ptr, word, NP, SCOPE)


@triton.jit
def router_push_task(
    tile,
    first,  # the task's first token (a group's), -1: all S
    x_ptr,  # bf16 [S, H]
    h_ptr,  # bf16 [S, H]: the seam's h (ROUTER_RMS)
    hsq_ptr,  # fp32 [S, CH]: its chunks' sums of squares (ROUTER_RMS)
    in_nw_ptr,  # bf16 [H]: post_attention_layernorm (ROUTER_RMS)
    eps,
    w_gate_ptr,  # bf16 [E/T, H]
    peer_table_ptr,  # int64 [NP]
    slot,  # fp32 logits [S, E], column E/T * rank
    word,
    S: tl.constexpr,
    H: tl.constexpr,
    E: tl.constexpr,
    E_R: tl.constexpr,
    SC: tl.constexpr,  # columns a seam chunk covers
    XG: tl.constexpr,  # tokens a task (planner.StageGeometry.x_group)
    XGP: tl.constexpr,
    R_ROWS: tl.constexpr,
    R_BK: tl.constexpr,
    XG_DOT: tl.constexpr,
    R_EVEN: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUTER_RMS: tl.constexpr,  # planner.StageGeometry.router_rms: x formed from h here
    NP: tl.constexpr,
    SCOPE: tl.constexpr,
):
    window, skip = group_window(first, S, XG)
    if ROUTER_RMS:
        acc = router_task(tile, 0, h_ptr, H, w_gate_ptr, H, XG, E_R, H, XGP, R_ROWS, R_BK, XG_DOT, R_EVEN, UPCAST,
                          in_nw_ptr, seam_scale(0, hsq_ptr, eps, H, SC), True)
    else:
        acc = router_task(tile, window, x_ptr, H, w_gate_ptr, H, XG, E_R, H, XGP, R_ROWS, R_BK, XG_DOT, R_EVEN, UPCAST)
    _push_logits(acc, tile, window, skip, peer_table_ptr, slot, word, E, XG, E_R, XGP, R_ROWS, NP, SCOPE)


@triton.jit
def _push_logits(
    acc,  # fp32 [XGP, R_ROWS]: a router tile's logits
    tile,
    window,  # its tokens' first x row, and the rows it skips (group_window)
    skip,
    peer_table_ptr,  # int64 [NP]
    slot,  # fp32 logits [S, E], column E/T * rank
    word,
    E: tl.constexpr,
    XG: tl.constexpr,
    E_R: tl.constexpr,
    XGP: tl.constexpr,
    R_ROWS: tl.constexpr,
    NP: tl.constexpr,
    SCOPE: tl.constexpr,
):
    _push_rows(peer_table_ptr, slot + window * E, E, acc, tile * R_ROWS, skip, XG, E_R, XGP, R_ROWS, NP, tl.float32)
    _raise_on_peers(peer_table_ptr, word, NP, SCOPE)


@triton.jit
def _push_z(
    zt,  # bf16 [XGP, LD_ROWS]: a latent down tile's z
    tile,
    window,  # its tokens' first x row, and the rows it skips (group_window)
    skip,
    peer_table_ptr,  # int64 [NP]
    slot,  # bf16 z [S, L], column L/T * rank
    word,
    L: tl.constexpr,
    XG: tl.constexpr,
    L_R: tl.constexpr,
    XGP: tl.constexpr,
    LD_ROWS: tl.constexpr,
    PRESCALE: tl.constexpr,  # push z * 2^63 (exact), as the tensor-core expert tasks take it
    NP: tl.constexpr,
    SCOPE: tl.constexpr,
):
    if PRESCALE:
        zt = to_bf16(as_f32(zt) * ACT_PRESCALE)
    _push_rows(peer_table_ptr, slot + window * L, L, zt, tile * LD_ROWS, skip, XG, L_R, XGP, LD_ROWS, NP,
               tl.bfloat16)
    _raise_on_peers(peer_table_ptr, word, NP, SCOPE)


@triton.jit
def latent_down_push_task(
    tile,
    first,  # the task's first token (a group's), -1: all S
    x_ptr,  # bf16 [S, H]
    w_ld_ptr,  # bf16 [L/T, H]
    peer_table_ptr,  # int64 [NP]
    slot,  # bf16 z [S, L], column L/T * rank
    word,
    S: tl.constexpr,
    H: tl.constexpr,
    L: tl.constexpr,
    L_R: tl.constexpr,
    XG: tl.constexpr,  # tokens a task (planner.StageGeometry.x_group)
    XGP: tl.constexpr,
    LD_ROWS: tl.constexpr,
    LD_BK: tl.constexpr,
    XG_DOT: tl.constexpr,
    LD_EVEN: tl.constexpr,
    UPCAST: tl.constexpr,
    PRESCALE: tl.constexpr,  # push z * 2^63 (exact), as the tensor-core expert tasks take it
    NP: tl.constexpr,
    SCOPE: tl.constexpr,
):
    window, skip = group_window(first, S, XG)
    zt = latent_down_task(tile, window, x_ptr, H, w_ld_ptr, H, XG, L_R, H, XGP, LD_ROWS, LD_BK, XG_DOT, LD_EVEN, UPCAST)
    _push_z(zt, tile, window, skip, peer_table_ptr, slot, word, L, XG, L_R, XGP, LD_ROWS, PRESCALE, NP, SCOPE)


@triton.jit
def _split_tile_sum(
    acc,  # fp32 [SP, ROWS]: this task's part of its tile (gemv_part)
    part,
    row0,  # the tile's first row
    parts_ptr,  # fp32 [X_PARTS - 1, S, N]: the tile's earlier parts (scratch logits_parts / z_parts)
    row_ptr,  # the task's table row
    ok,
    flags_ptr,  # int32: the rank's flag words
    rword,  # the task's raise word
    epoch,
    early,  # the row's waits before its in-task ones
    nwaits,
    limit,
    health_ptr,
    rank,
    layer,
    ticket,
    S: tl.constexpr,
    N: tl.constexpr,
    SP: tl.constexpr,
    ROWS: tl.constexpr,
    X_PARTS: tl.constexpr,
    SCOPE: tl.constexpr,
    SLEEP_NS: tl.constexpr,
):
    """A split ROUTER / LATENT_DOWN task (planner.X_K_PARTS): (acc, ok, last).
    An earlier part stores its partial and raises the tile's parts flag (last
    0); the last part polls that flag (its in-task wait) and returns the parts'
    sum in part order (last 1 once the wait is met), the staged program's bits."""
    last = part * 0
    if part < X_PARTS - 1:
        store_rows(parts_ptr + part * (S * N), N, acc, row0, 0, S, N, SP, ROWS)
        raise_counter(flags_ptr + rword, SCOPE)
    else:
        ok = _poll_waits(early, nwaits, row_ptr, ok, flags_ptr, epoch, limit, health_ptr, rank, layer, ticket, SCOPE,
                         SLEEP_NS)
        if ok != 0:
            acc = sum_parts(parts_ptr, acc, row0, S, N, SP, ROWS, X_PARTS)
            last += 1
    return acc, ok, last


@triton.jit
def final_push_task(
    tile,
    shared,  # fp32 [SP, F_ROWS]: the tile's shared down-projection (final_task's second term), run before
    lat_ptr,  # bf16 [S, L/T]: this rank's columns of the weighted latent
    sq_ptr,  # fp32 [S, PL]: the latent parts' sums of squares
    eps,
    w_up_ptr,  # bf16 [H, L/T]
    peer_table_ptr,  # int64 [NP]
    slot,  # fp32 AR3 [S, H] of this rank
    word,
    S: tl.constexpr,
    H: tl.constexpr,
    L: tl.constexpr,
    L_R: tl.constexpr,
    PL: tl.constexpr,
    SP: tl.constexpr,
    F_ROWS: tl.constexpr,
    F_BK: tl.constexpr,
    USE_DOT: tl.constexpr,
    F_EVEN_L: tl.constexpr,
    UPCAST: tl.constexpr,
    NP: tl.constexpr,
    SCOPE: tl.constexpr,
):
    """The latent up-projection's rows, scaled, plus ``shared``: final_task's sum
    (its two gemv_tile terms, here run apart: MonoOptions.final_split), pushed."""
    acc = gemv_tile(lat_ptr, L_R, w_up_ptr, L_R, tile * F_ROWS, S, H, L_R, SP, F_ROWS, F_BK, USE_DOT, F_EVEN_L, UPCAST)
    partial = final_sum(acc, latent_scale(sq_ptr, eps, S, SP, L, PL), shared)
    _push_rows(peer_table_ptr, slot, H, partial, tile * F_ROWS, 0, S, H, SP, F_ROWS, NP, tl.float32)
    _raise_on_peers(peer_table_ptr, word, NP, SCOPE)


@triton.jit
def expert_down_push_task(
    token,
    tile,
    act_ptr,  # bf16 [S, K, I/T]
    ids_ptr,  # int32 [S, K]
    rw_ptr,  # fp32 [S, K]
    w2_ptr,  # u8 [E, L, I/(2T)], i8 in f16 order, or i32 [E, L, I/(8T)] in mma order
    w2s_ptr,  # u8 [E, L, I/(32T)]
    own_f32,  # fp32 view of the rank's own peer buffer
    peer_table_ptr,  # int64 [NP]
    slot,  # fp32 AR2 [S, L] of this rank
    word,
    KTOP: tl.constexpr,
    L: tl.constexpr,
    I_R: tl.constexpr,
    DN_ROWS: tl.constexpr,
    DN_BG: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    MMA: tl.constexpr,  # expert_down_mma_task (w2 in mma order, act * 2^63)
    UPCAST: tl.constexpr,
    NP: tl.constexpr,
    SCOPE: tl.constexpr,
    DEQUANT: tl.constexpr,  # the FMA loop's placement (kernels/mxfp4.py; DEQUANT_F16: w2 in f16 order)
):
    """expert_down_task stores its tile into the own slot; with NP > 1 the CTA
    then copies those rows to every peer's before raising."""
    if MMA:
        expert_down_mma_task(token * tl.cdiv(L, DN_ROWS) + tile, act_ptr, ids_ptr, rw_ptr, w2_ptr, w2s_ptr,
                             own_f32 + slot, KTOP, L, I_R, DN_ROWS, DN_BG, UPCAST)
    else:
        expert_down_task(token * tl.cdiv(L, DN_ROWS) + tile, act_ptr, ids_ptr, rw_ptr, w2_ptr, w2s_ptr, own_f32 + slot,
                         KTOP, L, I_R, DN_ROWS, DN_BG, DEQUANT=DEQUANT, LOOKAHEAD=LOOKAHEAD, EVICT_FIRST=EVICT_FIRST)
    if NP > 1:
        tl.debug_barrier()
        rows = tile * DN_ROWS + tl.arange(0, DN_ROWS)
        vals = tl.load(own_f32 + slot + token * L + rows, mask=rows < L, other=0.0)
        _push_rows(peer_table_ptr, slot + token * L, L, vals[None, :], tile * DN_ROWS, 0, 1, L, 1, DN_ROWS, NP,
                   tl.float32)
    _raise_on_peers(peer_table_ptr, word, NP, SCOPE)


@triton.jit
def reduce1_task(
    tile,
    token,
    start,
    stop,
    ar1_ptr,  # fp32 [T, S, H]: this epoch's AR1 region of the own buffer
    prefix_ptr,  # bf16 [S, H], updated in place
    stride_ps,
    blocks_ptr,  # bf16 [S, nb_max, H]
    stride_bs,
    stride_bn,
    nb,
    ares_nw_ptr,  # bf16 [H]
    ares_qk_ptr,  # bf16 [H]
    part_ptr,  # fp32 [S, PCH, 2, CP] out: the seam's score partials
    S: tl.constexpr,
    H: tl.constexpr,
    T: tl.constexpr,
    RC1: tl.constexpr,  # power of two >= stop - start
    CANDS: tl.constexpr,
    CP: tl.constexpr,
    SCORE_COLS: tl.constexpr,  # stop - start but for the last tile: the tile is score chunk ``tile``
):
    """AR1 and the prefix update over the tile's columns of one token, then the
    seam's score step there, on the P just summed (no read back)."""
    cols = start + tl.arange(0, RC1)
    m = cols < stop
    q = seam_query(ares_nw_ptr, ares_qk_ptr, cols, m)
    # the block rows before the prefix store (it might alias them)
    rows = block_rows(token, cols, m, blocks_ptr, stride_bs, stride_bn, nb, CANDS)
    p = reduce_prefix_chunk(ar1_ptr, S * H, H, prefix_ptr, stride_ps, token, cols, m, T)
    score_partials(token, tile, as_f32(p), rows, q, nb, part_ptr, H, CANDS, CP, SCORE_COLS)


@triton.jit
def reduce3_task(
    token,
    start,
    stop,
    ar3_ptr,  # fp32 [T, S, H]: this epoch's AR3 region of the own buffer
    out_ptr,  # bf16 [S, H]
    stride_os,
    S: tl.constexpr,
    H: tl.constexpr,
    T: tl.constexpr,
    RC3: tl.constexpr,  # power of two >= stop - start
):
    cols = start + tl.arange(0, RC3)
    final_reduce_chunk(ar3_ptr, S * H, H, out_ptr, stride_os, token, cols, cols < stop, T)


@triton.jit
def _wait_word(
    i: tl.constexpr, row_ptr, flags_ptr, epoch, limit, health_ptr, rank, layer, ticket, SCOPE: tl.constexpr,
    SLEEP_NS: tl.constexpr,
):
    word = tl.load(row_ptr + C_WAIT0 + 2 * i)
    count = tl.load(row_ptr + C_WAIT0 + 2 * i + 1)
    return wait_counter(flags_ptr + word, epoch * count, limit, health_ptr, rank, layer, ticket, word, epoch, SCOPE,
                        SLEEP_NS)


@triton.jit
def _poll_waits(
    lo,  # the first wait of the row to poll
    hi,  # one past the last
    row_ptr, ok, flags_ptr, epoch, limit, health_ptr, rank, layer, ticket, SCOPE: tl.constexpr, SLEEP_NS: tl.constexpr,
):
    """Waits lo .. hi - 1 of the row, in order, while all met so far: the new ok."""
    for i in tl.static_range(MAX_WAITS):
        if (i >= lo) & (i < hi) & (ok != 0):
            ok = ok & _wait_word(i, row_ptr, flags_ptr, epoch, limit, health_ptr, rank, layer, ticket, SCOPE, SLEEP_NS)
    return ok


@triton.jit
def _would_block(i: tl.constexpr, row_ptr, flags_ptr, epoch, SCOPE: tl.constexpr):
    word = tl.load(row_ptr + C_WAIT0 + 2 * i)
    count = tl.load(row_ptr + C_WAIT0 + 2 * i + 1)
    return (1 - reached(poll_once(flags_ptr + word, SCOPE), epoch * count).to(tl.int32))


@triton.jit
def _global_ns():
    """The GPU's global nanosecond timer, the same on every SM (inline PTX:
    compiled TRACE builds only, the interpreter has no timer)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _sm_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _record_task(
    trace_ptr,  # int64 [num_tasks, TRACE_WORDS]
    ticket,
    taken,  # int64 ns: the CTA turned to the ticket
    ready,  # int64 ns: its waits were met
):
    """The ticket's row: SM, taken, ready, done (ns of the global timer)."""
    done = _global_ns()
    row = trace_ptr + ticket * TRACE_WORDS
    tl.store(row, _sm_id().to(tl.int64))
    tl.store(row + 1, taken)
    tl.store(row + 2, ready)
    tl.store(row + 3, done)


@triton.jit(do_not_specialize=["nb", "rank", "layer", "spin_limit", "num_tasks", "eps", "scaling"])
def _mono_kernel(
    table_ptr,  # int32 [num_tasks, NCOL]
    core_ptr,  # bf16 [S, C/T], row stride stride_cs (M1B: written by the launch, unit column stride)
    stride_cs,
    # M1b's inputs (M1B; otherwise placeholders, never read); heads_r = C / (T * D_V)
    o_ptr,  # fp32 [SPLITS, S, heads_r, D_LATENT], unit stride along D_LATENT: M1c's split outputs (M1C: its scratch)
    stride_ok,
    stride_ot,  # per token (stride_os is out's)
    stride_oh,
    lse_ptr,  # fp32 [SPLITS, S, heads_r], unit stride along heads_r
    stride_lk,
    stride_ls,
    w_v_ptr,  # bf16 or fp8 e4m3 (W_V_FP8) [heads_r, D_V, D_LATENT], unit stride along D_LATENT
    stride_wh,
    stride_wd,
    w_v_scale,  # fp32: w_v's fp8 dequantisation scale (1.0 for bf16)
    gate_ptr,  # bf16 [S, C/T] output-gate logits, unit column stride
    stride_gs,
    # M1c's inputs (M1C; otherwise placeholders, never read); DQK = D_LATENT + D_ROPE (576 in Kimi-K3)
    q_ptr,  # bf16 [S, heads_r, DQK], unit stride along DQK
    stride_qs,
    stride_qh,
    kv_ptr,  # bf16 or fp8 e4m3 (KV_FP8) [pages, PAGE_SIZE, DQK], unit stride along DQK: the paged latent cache
    stride_kvp,
    stride_kvr,
    kv_scale,  # fp32: kv's fp8 dequantisation scale (1.0 for bf16)
    qsl_ptr,  # int32 [M1C_B + 1]: each request's first query token
    seq_lens_ptr,  # int32 [M1C_B]: each request's context, its query tokens included
    pages_ptr,  # int32 [num_slots]: page ids, request b's from indptr[b] on
    indptr_ptr,  # int32 [M1C_B + 1]
    attn_scale,  # fp32: the softmax scale
    w_o_ptr,  # bf16 [H, C/T]
    prefix_ptr,  # bf16 [S, H], updated in place
    stride_ps,
    blocks_ptr,  # bf16 [S, nb_max, H]
    stride_bs,
    stride_bn,
    nb,
    ares_nw_ptr,  # bf16 [H]
    ares_qk_ptr,  # bf16 [H]
    in_nw_ptr,  # bf16 [H]
    eps,
    w_gate_ptr,  # bf16 [E/T, H]
    bias_ptr,  # fp32 [E]
    scaling,
    w_ld_ptr,  # bf16 [L/T, H]
    w_sg_ptr,  # bf16 [SI/T, H]
    w_su_ptr,  # bf16 [SI/T, H]
    w_sd_ptr,  # bf16 [H, SI/T]
    w1_ptr,  # u8 [E, I/T, L/2] (i8 in f16 order: EXPERT_DEQUANT), or i32 [E, I/T, L/8] in mma order (EXPERT_MMA)
    w1s_ptr,  # u8 [E, I/T, L/32]
    w3_ptr,
    w3s_ptr,
    w2_ptr,  # u8 [E, L, I/(2T)] (i8 in f16 order), or i32 [E, L, I/(8T)] in mma order (EXPERT_MMA)
    w2s_ptr,  # u8 [E, L, I/(32T)]
    ln_w_ptr,  # bf16 [L]
    w_up_ptr,  # bf16 [H, L/T]
    out_ptr,  # bf16 [S, H]
    stride_os,
    sc_bf16,  # the rank's scratch as bf16 / int32 / fp32
    sc_i32,
    sc_f32,
    own_f32,  # the rank's own peer buffer as fp32 / bf16 / int32
    own_bf16,
    own_i32,
    peer_table_ptr,  # int64 [NP]: the peer buffers' byte addresses (NP = T, or 1 in loopback: own)
    rank,
    epoch_ptr,  # int32 [1]: this launch's epoch; the last CTA advances it
    layer,
    health_ptr,  # int32 [HEALTH_WORDS]
    spin_limit,  # polls a wait may take
    num_tasks,  # rows of the table (not a constexpr: a timing variant's table reuses the build)
    trace_ptr,  # int64 [num_tasks, TRACE_WORDS] out (TRACE; otherwise a placeholder, never written)
    NCOL: tl.constexpr,
    NP: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    H: tl.constexpr,
    C_R: tl.constexpr,
    E: tl.constexpr,
    E_R: tl.constexpr,
    E_PAD: tl.constexpr,
    RC: tl.constexpr,  # experts a route part sorts
    PC: tl.constexpr,  # columns of L a latent part sums (planner.latent_part_cols)
    PL: tl.constexpr,  # latent parts
    KTOP: tl.constexpr,
    L: tl.constexpr,
    L_R: tl.constexpr,
    I_R: tl.constexpr,
    SI_R: tl.constexpr,
    USE_DOT: tl.constexpr,
    XG: tl.constexpr,  # tokens a ROUTER / LATENT_DOWN task (planner.StageGeometry.x_group)
    XGP: tl.constexpr,  # XG padded: their tiles' token extent
    XG_DOT: tl.constexpr,  # their arithmetic: tl.dot, else FMAs
    ROUTER_RMS: tl.constexpr,  # the router tasks form x from the seam's h (planner.StageGeometry.router_rms)
    X_PARTS: tl.constexpr,  # parts of K a router / latent down tile (planner.StageGeometry.x_parts)
    UPCAST: tl.constexpr,
    O_ROWS: tl.constexpr,
    O_BK: tl.constexpr,
    O_EVEN: tl.constexpr,
    R_ROWS: tl.constexpr,
    R_BK: tl.constexpr,
    R_EVEN: tl.constexpr,
    LD_ROWS: tl.constexpr,
    LD_BK: tl.constexpr,
    LD_EVEN: tl.constexpr,
    SG_ROWS: tl.constexpr,
    SG_BK: tl.constexpr,
    SG_EVEN: tl.constexpr,
    F_ROWS: tl.constexpr,
    F_BK: tl.constexpr,
    F_EVEN_L: tl.constexpr,
    F_EVEN_S: tl.constexpr,
    GU_ROWS: tl.constexpr,
    GU_BG: tl.constexpr,
    DN_ROWS: tl.constexpr,
    DN_BG: tl.constexpr,
    EXPERT_LOOKAHEAD: tl.constexpr,
    EXPERT_EVICT_FIRST: tl.constexpr,  # planner.MonoOptions.expert_evict_first
    EXPERT_MMA: tl.constexpr,  # planner.TileChoice.expert_mma: w1/w3/w2 in mma order, z pushed * 2^63
    EXPERT_DEQUANT: tl.constexpr,  # the FMA loops' placement (kernels/mxfp4.py; DEQUANT_F16: tiles.expert_f16)
    CANDS: tl.constexpr,
    CP: tl.constexpr,  # the seam partials' candidate extent (>= CANDS)
    SC: tl.constexpr,  # columns a seam task covers
    SCORE_COLS: tl.constexpr,  # columns a seam score chunk covers: a REDUCE1 tile
    RC1: tl.constexpr,  # power of two >= reduce1 tile columns
    RC3: tl.constexpr,
    BETA: tl.constexpr,
    LINEAR_BETA: tl.constexpr,
    # element offsets: peer regions (parity 0) and the parity stride, per view
    AR1_F: tl.constexpr,
    LOG_F: tl.constexpr,
    Z_B: tl.constexpr,
    AR2_F: tl.constexpr,
    AR3_F: tl.constexpr,
    PAR_F: tl.constexpr,
    PAR_B: tl.constexpr,
    FLAG_I: tl.constexpr,
    # element offsets: scratch regions
    X_B: tl.constexpr,
    IDS_I: tl.constexpr,
    RW_F: tl.constexpr,
    RK_I: tl.constexpr,  # route_keys (int64) as int32 elements
    ACT_B: tl.constexpr,
    LAT_B: tl.constexpr,
    LSQ_F: tl.constexpr,
    SACT_B: tl.constexpr,
    SPART_F: tl.constexpr,
    SH_B: tl.constexpr,
    SHSQ_F: tl.constexpr,
    LPARTS_F: tl.constexpr,  # logits_parts (X_PARTS > 1; else 0, never read)
    ZPARTS_F: tl.constexpr,  # z_parts (X_PARTS > 1; else 0, never read)
    CTL_I: tl.constexpr,
    PREFETCH: tl.constexpr,  # 0 never, 1 when a wait would block, 2 always
    PREFETCH_KINDS: tl.constexpr,  # bit k: kind k prefetches its rows whatever PREFETCH (MonoOptions.always_prefetched)
    SCOPE: tl.constexpr,
    M1B: tl.constexpr,  # the table has M1B tasks (planner.MonoOptions.m1b)
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_V: tl.constexpr,
    M1B_SHORT_SPLITS: tl.constexpr,
    M1B_CHUNK: tl.constexpr,
    M1B_PAIRS: tl.constexpr,
    M1B_STAGES: tl.constexpr,
    M1B_DV: tl.constexpr,
    W_V_FP8: tl.constexpr,
    M1C: tl.constexpr,  # the table has M1C tasks (planner.MonoOptions.m1c)
    M1C_HEADS: tl.constexpr,  # heads_r
    M1C_B: tl.constexpr,  # requests
    M1C_BP: tl.constexpr,  # requests padded to a power of two
    PAGE_SIZE: tl.constexpr,
    D_ROPE: tl.constexpr,
    KV_FP8: tl.constexpr,
    M1C_BH: tl.constexpr,  # heads a task
    M1C_HB: tl.constexpr,  # head blocks of a (token, split)
    M1C_BN: tl.constexpr,  # context positions a step
    M1C_STAGES: tl.constexpr,  # steps in flight
    TRACE: tl.constexpr,  # record every ticket's SM and times (_record_task)
    SLEEP_NS: tl.constexpr,  # a waiting CTA's pause between polls (sync.pause; 0: none)
):
    epoch = tl.load(epoch_ptr)
    parity = epoch & 1
    pf = parity * PAR_F  # this epoch's data regions
    pb = parity * PAR_B
    flags = own_i32 + FLAG_I
    x_ptr = sc_bf16 + X_B
    ids_ptr = sc_i32 + IDS_I
    keys_ptr = (sc_i32 + RK_I).to(tl.pointer_type(tl.int64))
    rw_ptr = sc_f32 + RW_F
    act_ptr = sc_bf16 + ACT_B
    lat_ptr = sc_bf16 + LAT_B
    sact_ptr = sc_bf16 + SACT_B
    ctl = sc_i32 + CTL_I

    ticket = tl.atomic_add(ctl, 1, sem="relaxed", scope=SCOPE)
    while ticket < num_tasks:
        row = table_ptr + ticket * NCOL
        kind = tl.load(row + C_KIND)
        tile = tl.load(row + C_TILE)
        start = tl.load(row + C_START)
        stop = tl.load(row + C_STOP)
        token = tl.load(row + C_TOKEN)
        slot = tl.load(row + C_SLOT)
        nwaits = tl.load(row + C_NWAITS)
        naddr = tl.load(row + C_NADDR)
        rword = tl.load(row + C_RAISE)
        early = nwaits - tl.load(row + C_LATE)  # the waits polled before the task runs
        ok = (nwaits >= 0).to(tl.int32)
        if TRACE:
            taken = _global_ns()

        # (1) the waits that gate weight addresses
        ok = _poll_waits(0, naddr, row, ok, flags, epoch, spin_limit, health_ptr, rank, layer, ticket, SCOPE, SLEEP_NS)

        # (2) weights before waits
        if (PREFETCH > 0) | (PREFETCH_KINDS != 0):
            blocked = (nwaits < 0).to(tl.int32)
            if PREFETCH == 2:
                blocked = (nwaits > naddr).to(tl.int32)
            elif PREFETCH == 1:
                for i in tl.static_range(MAX_WAITS):
                    if (i >= naddr) & (i < nwaits):
                        blocked = blocked | _would_block(i, row, flags, epoch, SCOPE)
            if PREFETCH_KINDS != 0:
                always = (tl.full([], PREFETCH_KINDS, tl.int32) >> kind) & 1
                blocked = blocked | (always & (nwaits > naddr).to(tl.int32))
            if (blocked != 0) & (ok != 0):
                if kind == K_OPROJ:
                    _prefetch_rows(w_o_ptr, start, stop, H, C_R)
                elif (kind == K_ROUTER) & (slot <= 0):  # a split tile's rows whole, by its first part
                    _prefetch_rows(w_gate_ptr, start, stop, E_R, H)
                elif (kind == K_LATENT_DOWN) & (slot <= 0):
                    _prefetch_rows(w_ld_ptr, start, stop, L_R, H)
                elif kind == K_SHARED_GU:
                    _prefetch_rows(w_sg_ptr, start, stop, SI_R, H)
                    _prefetch_rows(w_su_ptr, start, stop, SI_R, H)
                elif kind == K_FINAL:
                    _prefetch_rows(w_up_ptr, start, stop, H, L_R)
                    _prefetch_rows(w_sd_ptr, start, stop, H, SI_R)
                elif kind == K_EXPERT_GU:
                    ex = tl.load(ids_ptr + token * KTOP + slot).to(tl.int64)
                    _prefetch_rows(_bytes(w1_ptr) + ex * (I_R * L // 2), start, stop, I_R, L // 2)
                    _prefetch_rows(_bytes(w3_ptr) + ex * (I_R * L // 2), start, stop, I_R, L // 2)
                    _prefetch_rows(w1s_ptr + ex * (I_R * L // GROUP), start, stop, I_R, L // GROUP)
                    _prefetch_rows(w3s_ptr + ex * (I_R * L // GROUP), start, stop, I_R, L // GROUP)
                elif kind == K_EXPERT_DOWN:
                    for j in tl.static_range(KTOP):
                        ex = tl.load(ids_ptr + token * KTOP + j).to(tl.int64)
                        _prefetch_rows(_bytes(w2_ptr) + ex * (L * I_R // 2), start, stop, L, I_R // 2)
                        _prefetch_rows(w2s_ptr + ex * (L * I_R // GROUP), start, stop, L, I_R // GROUP)

        # (3) the other waits, in table order, but for the task's own (C_LATE: FINAL polls them itself)
        ok = _poll_waits(naddr, early, row, ok, flags, epoch, spin_limit, health_ptr, rank, layer, ticket, SCOPE,
                         SLEEP_NS)

        # (4) the task; the next ticket now, its atomic's latency hidden behind the task
        if TRACE:
            ready = _global_ns()
        nxt = tl.atomic_add(ctl, 1, sem="relaxed", scope=SCOPE)
        if ok != 0:
            if kind == K_M1C:
                if M1C:
                    # tile = split * M1C_HB + head block (planner._Planner.m1c)
                    mla_attn_task(token, tile // M1C_HB, tile % M1C_HB, q_ptr, stride_qs, stride_qh, kv_ptr,
                                  stride_kvp, stride_kvr, kv_scale, qsl_ptr, seq_lens_ptr, pages_ptr, indptr_ptr,
                                  attn_scale, o_ptr, stride_ok, stride_ot, stride_oh, lse_ptr, stride_lk, stride_ls,
                                  M1C_HEADS, M1C_B, M1C_BP, PAGE_SIZE, D_LATENT, D_ROPE, SPLITS, M1C_BH, M1C_BN,
                                  M1C_STAGES, KV_FP8, UPCAST)
                    raise_counter(flags + rword, SCOPE)
            elif kind == K_M1B:
                if M1B:
                    # tile = head * (D_V / M1B_DV) + value-row block (planner._m1b_tiles)
                    mla_back_task(tile // (D_V // M1B_DV), tile % (D_V // M1B_DV), token, o_ptr, stride_ok,
                                  stride_ot, stride_oh, lse_ptr, stride_lk, stride_ls, w_v_ptr, stride_wh, stride_wd,
                                  w_v_scale, gate_ptr, stride_gs, core_ptr, stride_cs, SPLITS, SPLITS_P, D_LATENT,
                                  D_V, M1B_SHORT_SPLITS, M1B_CHUNK, M1B_PAIRS, M1B_STAGES, M1B_DV, W_V_FP8, UPCAST)
                    raise_counter(flags + rword, SCOPE)
            elif kind == K_OPROJ:
                oproj_push_task(tile, core_ptr, stride_cs, w_o_ptr, peer_table_ptr, pf + AR1_F + rank * (S * H),
                                FLAG_I + rword, S, H, C_R, SP, O_ROWS, O_BK, USE_DOT, O_EVEN, UPCAST, NP, SCOPE)
            elif kind == K_REDUCE1:
                reduce1_task(tile, token, start, stop, own_f32 + pf + AR1_F, prefix_ptr, stride_ps, blocks_ptr,
                             stride_bs, stride_bn, nb, ares_nw_ptr, ares_qk_ptr, sc_f32 + SPART_F, S, H, T, RC1, CANDS,
                             CP, SCORE_COLS)
                raise_counter(flags + rword, SCOPE)
            elif kind == K_SEAM_MIX:
                seam_mix_task(token, tile, prefix_ptr, stride_ps, blocks_ptr, stride_bs, stride_bn, nb,
                              sc_f32 + SPART_F, eps, sc_bf16 + SH_B, sc_f32 + SHSQ_F, H, CANDS, CP, SC, SCORE_COLS)
                raise_counter(flags + rword, SCOPE)
            elif kind == K_SEAM_NORM:
                seam_norm_task(token, tile, sc_bf16 + SH_B, sc_f32 + SHSQ_F, in_nw_ptr, eps, x_ptr, H, H, SC)
                raise_counter(flags + rword, SCOPE)
            elif kind == K_ROUTER:
                if X_PARTS > 1:
                    # slot = the part of K (planner._x_gemv_parts); all S tokens (tl.dot)
                    acc = gemv_part(x_ptr, H, w_gate_ptr, H, tile * R_ROWS, slot, S, E_R, H // X_PARTS, SP, R_ROWS,
                                    R_BK, R_EVEN, UPCAST)
                    acc, ok, last = _split_tile_sum(acc, slot, tile * R_ROWS, sc_f32 + LPARTS_F, row, ok, flags,
                                                    rword, epoch, early, nwaits, spin_limit, health_ptr, rank, layer,
                                                    ticket, S, E_R, SP, R_ROWS, X_PARTS, SCOPE, SLEEP_NS)
                    if last != 0:
                        _push_logits(acc, tile, 0, 0, peer_table_ptr, pf + LOG_F + rank * E_R, FLAG_I + rword, E, S,
                                     E_R, SP, R_ROWS, NP, SCOPE)
                else:
                    router_push_task(tile, token, x_ptr, sc_bf16 + SH_B, sc_f32 + SHSQ_F, in_nw_ptr, eps, w_gate_ptr,
                                     peer_table_ptr, pf + LOG_F + rank * E_R, FLAG_I + rword, S, H, E, E_R, SC, XG,
                                     XGP, R_ROWS, R_BK, XG_DOT, R_EVEN, UPCAST, ROUTER_RMS, NP, SCOPE)
            elif kind == K_LATENT_DOWN:
                if X_PARTS > 1:
                    acc = gemv_part(x_ptr, H, w_ld_ptr, H, tile * LD_ROWS, slot, S, L_R, H // X_PARTS, SP, LD_ROWS,
                                    LD_BK, LD_EVEN, UPCAST)
                    acc, ok, last = _split_tile_sum(acc, slot, tile * LD_ROWS, sc_f32 + ZPARTS_F, row, ok, flags,
                                                    rword, epoch, early, nwaits, spin_limit, health_ptr, rank, layer,
                                                    ticket, S, L_R, SP, LD_ROWS, X_PARTS, SCOPE, SLEEP_NS)
                    if last != 0:
                        _push_z(to_bf16(acc), tile, 0, 0, peer_table_ptr, pb + Z_B + rank * L_R, FLAG_I + rword, L,
                                S, L_R, SP, LD_ROWS, EXPERT_MMA, NP, SCOPE)
                else:
                    latent_down_push_task(tile, token, x_ptr, w_ld_ptr, peer_table_ptr, pb + Z_B + rank * L_R,
                                          FLAG_I + rword, S, H, L, L_R, XG, XGP, LD_ROWS, LD_BK, XG_DOT, LD_EVEN,
                                          UPCAST, EXPERT_MMA, NP, SCOPE)
            elif kind == K_SHARED_GU:
                shared_gate_up_task(tile, x_ptr, H, w_sg_ptr, H, w_su_ptr, H, sact_ptr, SI_R, S, SI_R, H, BETA,
                                    LINEAR_BETA, SP, SG_ROWS, SG_BK, USE_DOT, SG_EVEN, UPCAST)
                raise_counter(flags + rword, SCOPE)
            elif kind == K_ROUTE_PART:
                route_part_task(token, tile, own_f32 + pf + LOG_F, bias_ptr, keys_ptr, E, KTOP, E_PAD, RC)
                raise_counter(flags + rword, SCOPE)
            elif kind == K_ROUTE:
                route_merge_task(token, keys_ptr, ids_ptr, rw_ptr, scaling, E, KTOP, E_PAD, RC)
                raise_counter(flags + rword, SCOPE)
            elif kind == K_EXPERT_GU:
                gu_task = (token * KTOP + slot) * tl.cdiv(I_R, GU_ROWS) + tile
                if EXPERT_MMA:
                    expert_gate_up_mma_task(gu_task, own_bf16 + pb + Z_B, ids_ptr, w1_ptr, w1s_ptr, w3_ptr, w3s_ptr,
                                            act_ptr, KTOP, L, I_R, GU_ROWS, GU_BG, BETA, LINEAR_BETA, UPCAST)
                else:
                    expert_gate_up_task(gu_task, own_bf16 + pb + Z_B, ids_ptr, w1_ptr, w1s_ptr, w3_ptr, w3s_ptr,
                                        act_ptr, KTOP, L, I_R, GU_ROWS, GU_BG, BETA, LINEAR_BETA,
                                        DEQUANT=EXPERT_DEQUANT, LOOKAHEAD=EXPERT_LOOKAHEAD,
                                        EVICT_FIRST=EXPERT_EVICT_FIRST)
                raise_counter(flags + rword, SCOPE)
            elif kind == K_EXPERT_DOWN:
                expert_down_push_task(token, tile, act_ptr, ids_ptr, rw_ptr, w2_ptr, w2s_ptr, own_f32, peer_table_ptr,
                                      pf + AR2_F + rank * (S * L), FLAG_I + rword, KTOP, L, I_R, DN_ROWS, DN_BG,
                                      EXPERT_LOOKAHEAD, EXPERT_EVICT_FIRST, EXPERT_MMA, UPCAST, NP, SCOPE,
                                      EXPERT_DEQUANT)
            elif kind == K_PREFETCH_FINAL:
                _prefetch_rows(w_up_ptr, start, stop, H, L_R)
                _prefetch_rows(w_sd_ptr, start, stop, H, SI_R)
            elif kind == K_PREFETCH_SHARED:
                _prefetch_rows(w_sg_ptr, start, stop, SI_R, H)
                _prefetch_rows(w_su_ptr, start, stop, SI_R, H)
            elif kind == K_LATENT_PART:
                latent_part_task(token, tile, rank, own_f32 + pf + AR2_F, S * L, L, ln_w_ptr, sc_f32 + LSQ_F, lat_ptr,
                                 L_R, T, L, L_R, PC, PL)
                raise_counter(flags + rword, SCOPE)
            elif kind == K_FINAL:
                # the shared down-projection first: with final_split the latent's wait is still open
                shared = gemv_tile(sact_ptr, SI_R, w_sd_ptr, SI_R, tile * F_ROWS, S, H, SI_R, SP, F_ROWS, F_BK,
                                   USE_DOT, F_EVEN_S, UPCAST)
                ok = _poll_waits(early, nwaits, row, ok, flags, epoch, spin_limit, health_ptr, rank, layer, ticket,
                                 SCOPE, SLEEP_NS)
                if ok != 0:
                    final_push_task(tile, shared, lat_ptr, sc_f32 + LSQ_F, eps, w_up_ptr, peer_table_ptr,
                                    pf + AR3_F + rank * (S * H), FLAG_I + rword, S, H, L, L_R, PL, SP, F_ROWS, F_BK,
                                    USE_DOT, F_EVEN_L, UPCAST, NP, SCOPE)
            elif kind == K_REDUCE3:
                reduce3_task(token, start, stop, own_f32 + pf + AR3_F, out_ptr, stride_os, S, H, T, RC3)
            elif kind == K_NOP:
                # a timing variant's skipped task (planner.timing_variant): only its raise
                if rword >= 0:
                    if tl.load(row + C_RAISE_PEER) != 0:
                        _raise_on_peers(peer_table_ptr, FLAG_I + rword, NP, SCOPE)
                    else:
                        raise_counter(flags + rword, SCOPE)
        if TRACE:
            _record_task(trace_ptr, ticket, taken, ready)
        # a failed wait stops the CTA (the alarm is up: the launch is lost)
        ticket = tl.where(ok != 0, nxt, num_tasks)

    # the last CTA out resets the ticket counter and advances the epoch
    done = tl.atomic_add(ctl + 1, 1, sem="acq_rel", scope=SCOPE)
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(ctl, 0, sem="relaxed", scope=SCOPE)
        tl.atomic_xchg(ctl + 1, 0, sem="relaxed", scope=SCOPE)
        tl.atomic_xchg(epoch_ptr, epoch + 1, sem="release", scope=SCOPE)
