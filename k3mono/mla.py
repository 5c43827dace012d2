"""The MLA decode stages of one rank, staged: M1c (kernels/mla_attn.py) then M1b
(kernels/mla_back.py), one launch each. The spec is reference/mla.py.

Shapes: S query tokens, B requests, heads (96 / T), splits, DQK = 576
(512 latent + 64 positional), DL = 512, DV = 128:

    q [S, heads, DQK] bf16, kv [pages, page_size, DQK] bf16 or fp8 e4m3 (kv_scale),
    qsl [B + 1], seq_lens [B], pages [num_slots], indptr [B + 1] int32, scale
    -> o [splits, S, heads, DL] fp32, lse [splits, S, heads] fp32          (M1c)
    w_v [heads, DV, DL] bf16 or fp8 e4m3 (w_v_scale), gate [S, heads * DV] bf16
    -> core [S, heads * DV] bf16                                            (M1b)

The request layout's values are not read here (that would sync with the
device): each request has 1 <= n_b <= seq_lens[b] query tokens and
ceil(seq_lens[b] / page_size) valid page ids from indptr[b] on
(reference.mla.check_requests checks them).

Geometry, and why:

* ``DEFAULT_SPLITS`` = 16: M1c runs S x splits x ceil(heads / BLOCK_H)
  programs, so at TP8 (12 heads, one head block) and 8 tokens it fills the
  132 SMs of an H100/H200 once, while the split outputs M1b reads back
  (splits x heads x DL x 4 bytes = 384 KB a token) stay small next to a
  long context's cache read (576 bytes a position in fp8, 1152 in bf16).
* ``ATTN_BLOCK_H``, ``attn_steps`` and ``ATTN_WARPS``: M1c's tile (16 heads; 64 positions a step
  at 3 pipeline stages over an fp8 cache, 32 at 3 over a bf16 one; in the mono launch's M1C
  tasks 32 at TileChoice.m1c_stages, folded_attn_tile; 4 warps); ``BACK_BLOCK_DV``,
  ``BACK_SHORT_SPLITS``, ``BACK_CHUNK``, ``BACK_PAIRS`` and ``BACK_STAGES``: M1b's
  (``attn_tile``, ``BACK_TILE``; the M1B tasks' ``folded_back_tile``); shared with the mono launch's
  M1C and M1B tasks, so the planner holds them (and why).

``staged_mla_layer_post`` is an MLA layer's post-attention half staged: M1b
per rank, then the staged layer (the mono launch runs both in one:
mono.MonoRunner with MonoOptions(m1b=...)).
"""

from __future__ import annotations

import torch

from .errors import K3InputError
from .kernels.mla_attn import FP8, check_mla_attn_args, check_q, launch_mla_attn, shape_text
from .kernels.mla_back import check_mla_back_args, check_w_v, launch_mla_back
from .planner import (ATTN_BLOCK_H, ATTN_WARPS, BACK_BLOCK_DV, BACK_CHUNK, BACK_PAIRS, BACK_SHORT_SPLITS, BACK_STAGES,
                      attn_steps)
from .reference.mla import LATENT_DIM

DEFAULT_SPLITS = 16


def attn_tile(kv) -> dict:
    """launch_mla_attn's tile arguments for the cache kv, the planner's (planner.attn_steps)."""
    block_n, stages = attn_steps(isinstance(kv, torch.Tensor) and kv.dtype == FP8)
    return dict(block_h=ATTN_BLOCK_H, block_n=block_n, stages=stages, warps=ATTN_WARPS)


def folded_attn_tile(geometry) -> dict:
    """launch_mla_attn's tile arguments of the mono launch's M1C tasks (a planner.M1cGeometry),
    so a launch alone gives their bits."""
    return dict(block_h=geometry.block_h, block_n=geometry.block_n, stages=geometry.stages, warps=ATTN_WARPS)


BACK_TILE = dict(short_splits=BACK_SHORT_SPLITS, chunk=BACK_CHUNK, pairs=BACK_PAIRS, stages=BACK_STAGES,
                 block_dv=BACK_BLOCK_DV)
"""launch_mla_back's tile arguments, the planner's (M1bGeometry holds the same)."""


def folded_back_tile(geometry) -> dict:
    """launch_mla_back's tile arguments of the mono launch's M1B tasks (a planner.M1bGeometry),
    so a launch alone runs as they do."""
    return dict(short_splits=geometry.short_splits, chunk=geometry.chunk, pairs=geometry.pairs,
                stages=geometry.stages, block_dv=geometry.block_dv)


M1B_INPUTS = ("o", "lse", "w_v", "w_v_scale", "gate")
"""The keys of one rank's M1b input dict (mla_back's arguments)."""

M1B_WEIGHTS = ("w_v", "w_v_scale", "gate")
"""The keys of one rank's M1b input dict when M1c runs in the same launch (its
split outputs are the launch's own)."""

M1C_INPUTS = ("q", "kv", "kv_scale", "qsl", "seq_lens", "pages", "indptr", "scale")
"""The keys of one rank's M1c input dict (mla_attn's arguments)."""


def split_outputs(q, splits: int, latent_dim: int):
    """Uninitialised (o [splits, S, heads, DL] fp32, lse [splits, S, heads] fp32) for q."""
    tokens, heads, _ = check_q(q)
    if not isinstance(splits, int) or splits < 1:
        raise K3InputError(f"splits: expected a positive int, got {splits!r}")
    o = torch.empty(splits, tokens, heads, latent_dim, dtype=torch.float32, device=q.device)
    return o, torch.empty(splits, tokens, heads, dtype=torch.float32, device=q.device)


def mla_attn(q, kv, qsl, seq_lens, pages, indptr, scale, *, kv_scale=1.0, splits=DEFAULT_SPLITS,
             latent_dim=LATENT_DIM, tile=None):
    """M1c alone: (o [splits, S, heads, DL] fp32, lse [splits, S, heads] fp32) at ``tile``
    (launch_mla_attn's tile arguments; None: attn_tile(kv); folded_attn_tile's: the bits
    an M1c folded into the mono launch writes)."""
    o, lse = split_outputs(q, splits, latent_dim)
    launch_mla_attn(q, kv, qsl, seq_lens, pages, indptr, scale, o, lse, kv_scale=kv_scale,
                    **(attn_tile(kv) if tile is None else tile))
    return o, lse


def core_like(gate) -> torch.Tensor:
    """An uninitialised bf16 core of gate's shape [S, heads * DV]."""
    if not isinstance(gate, torch.Tensor) or gate.dim() != 2:
        raise K3InputError(f"gate: expected shape [S, heads * DV], got {shape_text(gate)}")
    return torch.empty(gate.shape, dtype=torch.bfloat16, device=gate.device)


def mla_back(o, lse, w_v, gate, *, w_v_scale=1.0) -> torch.Tensor:
    """M1b alone: core [S, heads * DV] bf16 from M1c's o and lse."""
    core = core_like(gate)
    launch_mla_back(o, lse, w_v, gate, core, w_v_scale=w_v_scale, **BACK_TILE)
    return core


def mla_decode(q, kv, qsl, seq_lens, pages, indptr, scale, w_v, gate, *, kv_scale=1.0, w_v_scale=1.0,
               splits=DEFAULT_SPLITS) -> torch.Tensor:
    """M1c then M1b, two launches: core [S, heads * DV] bf16. Both stages' inputs
    are checked before the first launch."""
    _, _, latent = check_w_v(w_v)
    o, lse = split_outputs(q, splits, latent)
    core = core_like(gate)
    check_mla_attn_args(q, kv, qsl, seq_lens, pages, indptr, o, lse, kv_scale)
    check_mla_back_args(o, lse, w_v, gate, core, w_v_scale)
    launch_mla_attn(q, kv, qsl, seq_lens, pages, indptr, scale, o, lse, kv_scale=kv_scale, **attn_tile(kv))
    launch_mla_back(o, lse, w_v, gate, core, w_v_scale=w_v_scale, **BACK_TILE)
    return core


def check_m1b_keys(name: str, m1b_in, keys=M1B_INPUTS) -> None:
    """m1b_in is a dict of exactly ``keys`` (M1B_INPUTS, M1B_WEIGHTS or M1C_INPUTS)."""
    if not isinstance(m1b_in, dict) or set(m1b_in) != set(keys):
        got = sorted(m1b_in) if isinstance(m1b_in, dict) else type(m1b_in).__name__
        raise K3InputError(f"{name}: expected a dict of {list(keys)}, got {got}")


def rank_cores(m1b_in_per_rank) -> torch.Tensor:
    """The whole core [S, heads * DV] bf16: each rank's M1b (one launch a rank) on its
    own heads' inputs (a dict o, lse, w_v, w_v_scale, gate, as mla_back takes them),
    side by side in rank order. Every rank's inputs are checked before the first launch."""
    for rank, m in enumerate(m1b_in_per_rank):
        check_m1b_keys(f"m1b_in[{rank}]", m)
    cores = [core_like(m["gate"]) for m in m1b_in_per_rank]
    for m, core in zip(m1b_in_per_rank, cores):
        check_mla_back_args(m["o"], m["lse"], m["w_v"], m["gate"], core, m["w_v_scale"])
    for m, core in zip(m1b_in_per_rank, cores):
        launch_mla_back(m["o"], m["lse"], m["w_v"], m["gate"], core, w_v_scale=m["w_v_scale"],
                        **BACK_TILE)
    return torch.cat(cores, dim=1)


def with_split_outputs(m1c_in_per_rank, m1b_weights_per_rank, splits: int, tile: dict) -> list[dict]:
    """Each rank's M1b inputs (M1B_INPUTS) from its M1c inputs (a dict of M1C_INPUTS)
    and its M1b weights (a dict of M1B_WEIGHTS): its M1c, one launch a rank, at the
    mono launch's M1C tile (``tile``: folded_attn_tile's): the split outputs a launch with
    M1c folded in writes, bit for bit. (At M1c's own tile, 64 positions a step over
    fp8, a longer split sums its softmax in other steps: the loopback pre-writes
    of MonoRunner.load_mla_inputs differed from the launches they stand for.)"""
    out = []
    for rank, (attn_in, weights) in enumerate(zip(m1c_in_per_rank, m1b_weights_per_rank)):
        check_m1b_keys(f"m1c_in[{rank}]", attn_in, M1C_INPUTS)
        check_m1b_keys(f"m1b_in[{rank}]", weights, M1B_WEIGHTS)
        _, _, latent = check_w_v(weights["w_v"])
        o, lse = mla_attn(attn_in["q"], attn_in["kv"], attn_in["qsl"], attn_in["seq_lens"], attn_in["pages"],
                          attn_in["indptr"], attn_in["scale"], kv_scale=attn_in["kv_scale"], splits=splits,
                          latent_dim=latent, tile=tile)
        out.append({**weights, "o": o, "lse": lse})
    return out


def staged_mla_layer_post(staged, m1b_in_per_rank, prefix, blocks):
    """An MLA layer staged: M1b of every rank (its own launch each), then
    ``staged`` (a staged.StagedLayer) on the core they wrote: rank 0's outputs."""
    if len(m1b_in_per_rank) != staged.tp:
        raise K3InputError(f"m1b_in: expected one dict a rank ({staged.tp}), got {len(m1b_in_per_rank)}")
    return staged(rank_cores(m1b_in_per_rank), prefix, blocks)
