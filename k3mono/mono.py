"""The mono driver: layer_post as ONE persistent launch per rank (kernels/mono.py).

Build key and cache
    ``MonoBuild`` (frozen): the config, tokens, T, option bits, the AttnRes
    candidate pad, loopback, the SM count the grid is planned for, the
    prefetch mode and the flag scope. ``build(key)`` plans the task table
    (planner.plan) and derives every constexpr and region offset; the result
    is cached per key (the table tensor per device).

Buffers of a rank (flat uint8, every region REGION_ALIGN-aligned)
    peer     [parity 0 | parity 1 | flags]: each parity is layout.peer_layout
             (ar1, logits, z, ar2, ar3), epoch e uses parity e & 1; flags are
             the planner's int32 flag words (never cleared; epoch e waits for
             e * count).
    scratch  layout.scratch_layout (x, route_ids, route_w, expert_act, latent,
             shared_act), then ``ctl``: the ticket counter and the CTAs-done
             counter (the last CTA of a launch resets both: no host work
             between launches, so the launch can be captured and replayed).
    epoch    int32 [1] on the device: read by the launch, advanced by its last
             CTA (a replay finds the next epoch there).
    health   int32 [sync.HEALTH_WORDS]: the alarm word and the record of the
             first wait that timed out.

k2_launch argument names (the seed's) -> LayerWeights fields
    w_o o_proj, ares_nw ares_norm, ares_qk ares_proj, in_nw post_norm,
    w_gate router, bias router_bias, w_ld latent_down, w_sgu (shared_gate,
    shared_up) (the seed fuses them; here a pair), w_sd shared_down,
    w13 (w1_packed, w3_packed), w13s (w1_scale, w3_scale) (pairs likewise),
    w2 w2_packed, w2s w2_scale, ln_w latent_norm, w_up latent_up.
    ``alarm`` is the wait bound: polls a wait may spin before it gives up.

Ranks in one process
    loopback (the default for T > 1): each rank's launch runs alone; the
    other ranks' pushes of this input are pre-written into both parities of
    its peer buffer by the host (from a staged run of the same input), its
    own slots / columns are poisoned, and the table's peer-wait counts are
    divided by T (only its own raises arrive). Every rank is run this way,
    one after another, and every rank's outputs are returned.
    full (loopback=False): every launch pushes into all T peer buffers. It
    needs the T launches running concurrently (blocking cross-rank waits): on
    the CPU interpreter that is impossible; ``launch(rank)`` of a single rank
    then times out cleanly (tested). T = 1 is the same in both modes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import MAX_TOKENS, K3Config
from .errors import K3InputError
from .layout import REGION_ALIGN, layout_bytes, peer_layout, region_views, scratch_layout
from .planner import COL, PEER_FLAGS, MonoOptions, next_pow2, plan
from .staged import SLOT_EXCHANGES, StagedResult, _check_shards
from .validate import check_layer_inputs
from .weights import LayerWeights

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


DEFAULT_PREFETCH = 0
DEFAULT_CTAS_PER_SM = 2
"""Measured on the H200 at one rank of TP8 (benchmarks/mono_sweep.py, docs/PERF.md):
two CTAs a SM took S = 1 from 182 to 148 us and S = 8 from 415 to 341 us (four
gave nothing more); the L2 prefetch before a blocking wait (mode 1) cost 20 to
40 us, since it reads each weight tile twice through the SM and keeps nothing
in registers across the wait."""


@dataclass(frozen=True)
class MonoBuild:
    cfg: K3Config
    tokens: int
    tp: int
    opt: int = 0  # planner option bits (MonoOptions.bits)
    cands: int = 2  # AttnRes candidates, padded to a power of two
    loopback: bool = False
    sms: int = 1  # the grid is planned for this many SMs (1: the interpreter's one program)
    ctas_per_sm: int = 1
    prefetch: int = DEFAULT_PREFETCH  # 0 never, 1 when a wait would block, 2 always
    scope: str = "gpu"

    def __post_init__(self):
        if not isinstance(self.tokens, int) or not 1 <= self.tokens <= MAX_TOKENS:
            raise K3InputError(f"tokens: expected an integer in 1..{MAX_TOKENS}, got {self.tokens!r}")
        if self.prefetch not in (0, 1, 2):
            raise K3InputError(f"prefetch: expected 0, 1 or 2, got {self.prefetch!r}")
        if self.scope not in ("gpu", "sys"):
            raise K3InputError(f"scope: expected 'gpu' or 'sys', got {self.scope!r}")

    @property
    def options(self) -> MonoOptions:
        return MonoOptions.from_bits(self.opt, self.ctas_per_sm)


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
    lay = scratch_layout(key.cfg, key.tp, key.tokens)
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
    from .kernels import common
    from .kernels.experts import _block_groups
    from .kernels.gemv import even_k

    cfg, T, S = key.cfg, key.tp, key.tokens
    table = plan(cfg, T, S, key.sms, key.options)
    g = table.geometry
    H, C, E, L = cfg.hidden_size, cfg.core_width, cfg.num_experts, cfg.routed_expert_hidden_size
    I, SI = cfg.moe_intermediate_size, cfg.shared_intermediate
    data = data_layout(key)
    peer = peer_regions(key, table.num_flag_words)
    scratch = scratch_regions(key)
    half = peer["parity1"][0]
    grid = 1 if _interpreting() else table.ctas

    def elems(offset: int, itemsize: int) -> int:
        assert offset % itemsize == 0
        return offset // itemsize

    consts = dict(
        NUM_TASKS=len(table.tasks), NCOL=len(COL), GRID=grid,
        NP=1 if key.loopback else T, T=T, S=S, SP=g.tokens_pad, H=H, C_R=C // T, E=E, E_R=E // T,
        E_PAD=next_pow2(E), KTOP=cfg.num_experts_per_token, L=L, L_R=L // T, I_R=I // T, SI_R=SI // T,
        USE_DOT=g.use_dot, UPCAST=common.UPCAST_DOT,
        O_ROWS=g.oproj.rows, O_BK=g.oproj.block_k, O_EVEN=even_k(C // T, g.oproj.block_k),
        R_ROWS=g.router.rows, R_BK=g.router.block_k, R_EVEN=even_k(H, g.router.block_k),
        LD_ROWS=g.latent_down.rows, LD_BK=g.latent_down.block_k, LD_EVEN=even_k(H, g.latent_down.block_k),
        SG_ROWS=g.shared_gate_up.rows, SG_BK=g.shared_gate_up.block_k, SG_EVEN=even_k(H, g.shared_gate_up.block_k),
        F_ROWS=g.final.rows, F_BK=g.final.block_k, F_EVEN_L=even_k(L // T, g.final.block_k),
        F_EVEN_S=even_k(SI // T, g.final.block_k),
        GU_ROWS=g.expert_gate_up.rows, GU_BG=_block_groups(g.expert_gate_up),
        DN_ROWS=g.expert_down.rows, DN_BG=_block_groups(g.expert_down),
        VB=g.vector_block, CANDS=key.cands, RC1=next_pow2(table.reduce1_cols), RC3=next_pow2(table.reduce3_cols),
        BETA=float(cfg.situ_beta), LINEAR_BETA=float(cfg.situ_linear_beta),
        AR1_F=elems(data["ar1"][0], 4), LOG_F=elems(data["logits"][0], 4), Z_B=elems(data["z"][0], 2),
        AR2_F=elems(data["ar2"][0], 4), AR3_F=elems(data["ar3"][0], 4),
        PAR_F=elems(half, 4), PAR_B=elems(half, 2), FLAG_I=elems(peer["flags"][0], 4),
        X_B=elems(scratch["x"][0], 2), IDS_I=elems(scratch["route_ids"][0], 4), RW_F=elems(scratch["route_w"][0], 4),
        ACT_B=elems(scratch["expert_act"][0], 2), LAT_B=elems(scratch["latent"][0], 2),
        SACT_B=elems(scratch["shared_act"][0], 2), CTL_I=elems(scratch["ctl"][0], 4),
        PREFETCH=key.prefetch, SCOPE=key.scope,
    )
    compiled = Compiled(key, table, _table_rows(table, key.loopback), grid, consts, peer, scratch, data)
    _CACHE[key] = compiled
    return compiled


# -- the launcher ----------------------------------------------------------------------------


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
    rank,
    epoch,
    layer,
    health,
    alarm,
    own=None,
) -> None:
    """One rank's layer_post in one launch (on the current stream).

    core [S, C/T] bf16 (the rank's o_proj input; a column view of the whole
    core is fine), prefix [S, H] bf16 updated in place, blocks [S, nb_max, H]
    bf16, out [S, H] bf16; weights as the module docstring maps them.
    scratch: the rank's flat uint8 scratch; peers: the T ranks' flat uint8
    peer buffers (loopback: the rank's own only); own: the rank's own peer
    buffer (default peers[rank], loopback peers[0]); epoch: int32 [1] device
    word (the launch's epoch; advanced by the launch); health: int32
    [HEALTH_WORDS]; alarm: the wait bound in polls."""
    from .kernels.mono import _mono_kernel

    c = build(key)
    peers = list(peers)
    if len(peers) != c.consts["NP"]:
        raise K3InputError(f"peers: expected {c.consts['NP']} buffers, got {len(peers)}")
    if own is None:
        own = peers[0] if key.loopback else peers[rank]
    for name, buf, need in [("scratch", scratch, buffer_bytes(c.scratch)), ("own", own, buffer_bytes(c.peer))] + [
        (f"peers[{i}]", p, buffer_bytes(c.peer)) for i, p in enumerate(peers)
    ]:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < need:
            raise K3InputError(f"{name}: expected a flat uint8 buffer of at least {need} bytes")
    w_sg, w_su = _pair("w_sgu", w_sgu)
    w1, w3 = _pair("w13", w13)
    w1s, w3s = _pair("w13s", w13s)
    nb = key.cfg.num_blocks(layer)
    views = lambda b, dt: b.view(dt)  # noqa: E731
    _mono_kernel[(c.grid,)](
        c.rows_on(core.device), core, core.stride(0), w_o, prefix, prefix.stride(0), blocks, blocks.stride(0),
        blocks.stride(1), nb, ares_nw, ares_qk, in_nw, float(key.cfg.rms_norm_eps), w_gate, bias,
        float(key.cfg.routed_scaling_factor), w_ld, w_sg, w_su, w_sd, w1, w1s, w3, w3s, w2, w2s, ln_w, w_up,
        out, out.stride(0),
        views(scratch, torch.bfloat16), views(scratch, torch.int32), views(scratch, torch.float32),
        views(own, torch.float32), views(own, torch.bfloat16), views(own, torch.int32),
        tuple(views(p, torch.float32) for p in peers), tuple(views(p, torch.bfloat16) for p in peers),
        tuple(views(p, torch.int32) for p in peers),
        rank, epoch, layer, health, int(alarm),
        **c.consts, num_warps=4,
    )


def launch_args(w: LayerWeights) -> dict:
    """The seed's weight argument names for a rank's shard."""
    return dict(
        w_o=w.o_proj, ares_nw=w.ares_norm, ares_qk=w.ares_proj, in_nw=w.post_norm, w_gate=w.router,
        bias=w.router_bias, w_ld=w.latent_down, w_sgu=(w.shared_gate, w.shared_up), w_sd=w.shared_down,
        w13=(w.w1_packed, w.w3_packed), w13s=(w.w1_scale, w.w3_scale), w2=w.w2_packed, w2s=w.w2_scale,
        ln_w=w.latent_norm, w_up=w.latent_up,
    )


# -- the runner -------------------------------------------------------------------------------


class MonoTimeout(RuntimeError):
    """A wait of the mono launch ran out of polls (the health record says which)."""


class MonoRunner:
    """layer_post through the mono launch, T = len(shards) ranks on one device.

    Owns every rank's peer buffer, scratch, prefix / out copies, device epoch
    word and health buffer. ``layer_post(core, prefix, blocks)`` returns rank
    0's outputs (staged.StagedResult); ``rank_results()`` every rank's.
    After a timeout the runner is broken (flags and epoch words no longer
    agree): ``reset()`` zeroes them."""

    def __init__(self, cfg: K3Config, shards, tokens: int, layer: int, *, device=None, loopback=None,
                 options: MonoOptions | None = None, prefetch: int = DEFAULT_PREFETCH,
                 spin_limit: int | None = None):
        from .kernels.attnres import num_candidates_pad

        cfg.validate_layer(layer)
        if not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
            raise K3InputError(f"tokens: expected an integer in 1..{MAX_TOKENS}, got {tokens!r}")
        self.tp = _check_shards(cfg, shards)
        self.cfg, self.shards, self.tokens, self.layer = cfg, list(shards), tokens, layer
        self.device = torch.device(device) if device is not None else shards[0].o_proj.device
        if self.device != shards[0].o_proj.device:
            raise K3InputError(f"device: the shards live on {shards[0].o_proj.device}, not {self.device}")
        self.loopback = self.tp > 1 if loopback is None else bool(loopback)
        options = options or MonoOptions(ctas_per_sm=DEFAULT_CTAS_PER_SM)
        sms = 1 if _interpreting() else torch.cuda.get_device_properties(self.device).multi_processor_count
        self.key = MonoBuild(cfg=cfg, tokens=tokens, tp=self.tp, opt=options.bits(),
                             cands=num_candidates_pad(cfg.num_blocks(layer)), loopback=self.loopback, sms=sms,
                             ctas_per_sm=options.ctas_per_sm, prefetch=prefetch)
        self.compiled = build(self.key)
        self.spin_limit = spin_limit if spin_limit is not None else (INTERPRET_SPIN if _interpreting() else DEFAULT_SPIN)
        S, H, dev = tokens, cfg.hidden_size, self.device
        from .kernels.sync import HEALTH_WORDS

        c = self.compiled
        self.peer_buffers = [torch.zeros(buffer_bytes(c.peer), dtype=torch.uint8, device=dev) for _ in self.ranks]
        self.scratch_buffers = [torch.zeros(buffer_bytes(c.scratch), dtype=torch.uint8, device=dev) for _ in self.ranks]
        self.epochs = [torch.ones(1, dtype=torch.int32, device=dev) for _ in self.ranks]
        self.health = [torch.zeros(HEALTH_WORDS, dtype=torch.int32, device=dev) for _ in self.ranks]
        self.prefix = [torch.empty((S, H), dtype=torch.bfloat16, device=dev) for _ in self.ranks]
        self.out = [torch.empty((S, H), dtype=torch.bfloat16, device=dev) for _ in self.ranks]
        self.core = torch.empty((S, cfg.core_width), dtype=torch.bfloat16, device=dev)
        self.blocks = None
        self.broken = None
        self._staged = None
        self._args = [launch_args(w) for w in self.shards]

    @property
    def ranks(self) -> range:
        return range(self.tp)

    # -- views -------------------------------------------------------------------------------
    def parity_views(self, rank: int, parity: int) -> dict:
        off, n = self.compiled.peer[f"parity{parity}"]
        return region_views(self.peer_buffers[rank][off : off + n], self.compiled.data)

    def flags(self, rank: int) -> torch.Tensor:
        off, n = self.compiled.peer["flags"]
        return self.peer_buffers[rank][off : off + n].view(torch.int32)[: self.compiled.table.num_flag_words]

    def scratch(self, rank: int) -> dict:
        lay = scratch_layout(self.cfg, self.tp, self.tokens)
        return region_views(self.scratch_buffers[rank], lay)

    def ctl(self, rank: int) -> torch.Tensor:
        off, _ = self.compiled.scratch["ctl"]
        return self.scratch_buffers[rank][off : off + 4 * CTL_WORDS].view(torch.int32)

    def epoch(self, rank: int = 0) -> int:
        return int(self.epochs[rank].item())

    # -- a run -------------------------------------------------------------------------------
    def load_inputs(self, core, prefix, blocks) -> None:
        tokens = check_layer_inputs(self.cfg, self.layer, core, prefix, blocks)
        if tokens != self.tokens:
            raise K3InputError(f"core: expected {self.tokens} tokens (this MonoRunner's build), got {tokens}")
        for name, t in (("core", core), ("prefix", prefix), ("blocks", blocks)):
            if t.device != self.device:
                raise K3InputError(f"{name}: expected device {self.device}, got {t.device}")
        if blocks.stride(-1) != 1:
            blocks = blocks.contiguous()
        self.core.copy_(core)
        for r in self.ranks:
            self.prefix[r].copy_(prefix)
        self.blocks = blocks
        if self.loopback and self.tp > 1:
            self._prewrite(core, prefix, blocks)

    def _prewrite(self, core, prefix, blocks) -> None:
        """Every rank's buffer gets the other ranks' pushes of this input (a staged
        run), in both parities; its own slots / columns are poisoned (NaN)."""
        from .staged import StagedLayer

        if self._staged is None:
            self._staged = StagedLayer(self.cfg, self.shards, self.tokens, self.layer)
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
        """NaN / -1 into the scratch data regions and the outputs (not ctl)."""
        for r in self.ranks:
            for t in self.scratch(r).values():
                t.fill_(float("nan") if t.dtype.is_floating_point else -1)
            self.out[r].fill_(float("nan"))
            if not self.loopback:
                for parity in (0, 1):
                    for t in self.parity_views(r, parity).values():
                        t.fill_(float("nan"))

    def launch(self, rank: int) -> None:
        """Rank ``rank``'s launch (no sync, no health check)."""
        if self.broken:
            raise RuntimeError(f"MonoRunner: broken by an earlier timeout ({self.broken}); call reset()")
        peers = [self.peer_buffers[rank]] if self.loopback else self.peer_buffers
        k2_launch(
            self.key, core=self.core[:, rank * (self.cfg.core_width // self.tp) : (rank + 1) * (self.cfg.core_width // self.tp)],
            prefix=self.prefix[rank], blocks=self.blocks, **self._args[rank], out=self.out[rank],
            scratch=self.scratch_buffers[rank], peers=peers, rank=rank, epoch=self.epochs[rank], layer=self.layer,
            health=self.health[rank], alarm=self.spin_limit, own=self.peer_buffers[rank],
        )

    def check_health(self) -> None:
        """Raise MonoTimeout naming rank, task, flag, expected and seen on a failed wait."""
        from .kernels import sync

        for r in self.ranks:
            h = self.health[r].tolist()
            if h[sync.H_ALARM]:
                table = self.compiled.table
                ticket, word = h[sync.H_TICKET], h[sync.H_WORD]
                task = table.tasks[ticket] if 0 <= ticket < len(table.tasks) else None
                try:
                    flag, index = table.flag_of_word(word)
                    flag_name = f"{flag.name}[{index}]"
                except IndexError:
                    flag_name = "?"
                what = f"{task.kind.name} tile {task.tile} token {task.token}" if task else "?"
                self.broken = (
                    f"rank {h[sync.H_RANK]} layer {h[sync.H_LAYER]} epoch {h[sync.H_EPOCH]}: ticket {ticket} ({what}) "
                    f"timed out waiting for flag {flag_name} (word {word}): expected {h[sync.H_EXPECTED]}, "
                    f"seen {h[sync.H_SEEN]} ({h[sync.H_ALARM]} failed wait(s) on rank {r})"
                )
                raise MonoTimeout(f"mono launch: {self.broken}")

    def reset(self) -> None:
        """Zero flags, control words and health; epoch 1 (after a timeout)."""
        for r in self.ranks:
            self.flags(r).zero_()
            self.ctl(r).zero_()
            self.health[r].zero_()
            self.epochs[r].fill_(1)
        self.broken = None

    def run(self) -> None:
        if not self.loopback and self.tp > 1:
            raise K3InputError(
                "MonoRunner: T > 1 without loopback needs the T launches running at once (blocking cross-rank "
                "waits); one process runs ranks one after another: use loopback"
            )
        for r in self.ranks:
            self.launch(r)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.check_health()

    def result(self, rank: int = 0) -> StagedResult:
        sc = self.scratch(rank)
        return StagedResult(
            moe_out=self.out[rank].clone(),
            prefix=self.prefix[rank].clone(),
            route_ids=sc["route_ids"].to(torch.int64),
            route_weights=sc["route_w"].clone(),
            router_logits=self.parity_views(rank, (self.epoch(rank) - 1) & 1)["logits"].clone(),
        )

    def rank_results(self) -> list[StagedResult]:
        return [self.result(r) for r in self.ranks]

    def layer_post(self, core, prefix, blocks) -> StagedResult:
        """One layer_post: rank 0's outputs; ``prefix`` itself is not modified."""
        self.load_inputs(core, prefix, blocks)
        self.poison()
        self.run()
        return self.result(0)

    __call__ = layer_post
