"""Where one rank's exchanges and scratch live (byte regions of flat buffers).

Peer buffer of a rank (what other ranks write into; one parity of it):

    ar1     [T, S, H]    fp32   slot t: rank t's o_proj partial            (AR1)
    logits  [S, E]       fp32   columns t*E/T ..: rank t's router rows    (AG1)
    z       [S, L]       bf16   columns t*L/T ..: rank t's latent rows    (AG1)
    ar2     [T, S, L]    fp32   slot t: rank t's routed-expert partial    (AR2)
    ar3     [T, S, H]    fp32   slot t: rank t's up + shared-down partial (AR3)

Scratch of a rank (only that rank reads and writes it):

    x          [S, H]        bf16   the MoE input rms(h)
    route_ids  [S, K]        int32  ascending per token
    route_w    [S, K]        fp32   renormalised sigmoid scores, route_ids order
    route_keys [S, P, 2, K_PAD] int64  each route part's top-K keys, then their experts' scores (kernels/route.py)
    expert_act [S, K, I/T]   bf16   situ(gate, up) of each chosen expert, this rank's slice
    latent_sq  [S, PL]       fp32   each latent part's sum of bf16(sum of AR2)^2 (kernels/latent_norm.py)
    latent     [S, L/T]      bf16   the rank's columns of bf16(routed_expert_norm * bf16(sum of AR2)): the
                                    norm's scale, from latent_sq, is FINAL's
    shared_act [S, SI/T]     bf16   situ of the shared experts, this rank's slice
    seam_part  [S, PCH, 2, CP] fp32 the AttnRes seam's per-score-chunk sums of V^2 and V . q
    seam_h     [S, H]        bf16   the seam's mix h, before its norm
    seam_hsq   [S, CH]       fp32   the seam's per-chunk sums of h^2
    split_o    [splits, S, heads_r, DL] fp32   M1c's split outputs (only with M1C tasks)
    split_lse  [splits, S, heads_r]     fp32   their log-sum-exps   (only with M1C tasks)
    logits_parts [X - 1, S, E/T] fp32   a split router tile's earlier parts' partial logits (only when X > 1)
    z_parts      [X - 1, S, L/T] fp32   a split latent down tile's earlier parts' partial z (only when X > 1)

P = ceil(E / planner.route_chunk) route parts, K_PAD = K rounded up to a power
of two; PL = ceil(L / planner.latent_part_cols) latent parts; CH = ceil(H /
planner.seam_cols(H)) seam chunks, PCH = ceil(H / planner.SEAM_SCORE_COLS)
score chunks; CP = planner.seam_candidates_max (the model's widest seam), so
one layout serves every layer. X = planner.StageGeometry.x_parts, the parts of K
a router or latent down row tile is cut into (planner.X_K_PARTS).

The split outputs are the launch's own: written by its M1C tasks, read by its
M1B tasks a few microseconds later (an L2 round trip), so the host neither
allocates nor passes them and a captured launch replays with no extra buffer.

Every region starts on a ``REGION_ALIGN`` boundary, so any dtype view of it is
aligned for 16-byte vector access.
"""

from __future__ import annotations

import torch

from .config import K3Config
from .planner import SEAM_SCORE_COLS, latent_part_cols, next_pow2, route_chunk, seam_candidates_max, seam_cols

REGION_ALIGN = 256
"""Bytes: a region boundary is aligned for every vector width and keeps two
regions out of one 128-byte cache line, so a writer of one never invalidates
a reader of the other."""

ROUTE_PART_ROWS = 2
"""Rows of a route part in route_keys: its top-K keys, then their experts'
sigmoid scores, which the merge reads with the keys instead of loading the
logits again after its sort (kernels/route.py)."""

PEER_REGIONS = ("ar1", "logits", "z", "ar2", "ar3")
SCRATCH_REGIONS = ("x", "route_ids", "route_w", "route_keys", "expert_act", "latent_sq", "latent", "shared_act",
                   "seam_part", "seam_h", "seam_hsq")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // REGION_ALIGN) * REGION_ALIGN


def _pack(regions: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict:
    """name -> (byte offset, shape, dtype), in order, each region aligned."""
    out, offset = {}, 0
    for name, (shape, dtype) in regions.items():
        out[name] = (offset, shape, dtype)
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        offset += _aligned(nbytes)
    out["__end__"] = (offset, (), torch.uint8)
    return out


def peer_layout(cfg: K3Config, tp: int, tokens: int) -> dict:
    """One parity of a rank's peer buffer: name -> (byte offset, shape, dtype)."""
    H, E, L, S = cfg.hidden_size, cfg.num_experts, cfg.routed_expert_hidden_size, tokens
    return _pack(
        {
            "ar1": ((tp, S, H), torch.float32),
            "logits": ((S, E), torch.float32),
            "z": ((S, L), torch.bfloat16),
            "ar2": ((tp, S, L), torch.float32),
            "ar3": ((tp, S, H), torch.float32),
        }
    )


def scratch_layout(cfg: K3Config, tp: int, tokens: int, m1c=None, x_parts: int = 1) -> dict:
    """A rank's scratch buffer: name -> (byte offset, shape, dtype). ``m1c``: the
    launch's M1C tasks (planner.M1cGeometry: splits, heads, latent), or None;
    ``x_parts``: the parts of K of a router / latent down tile (StageGeometry.x_parts)."""
    H, K, L, S = cfg.hidden_size, cfg.num_experts_per_token, cfg.routed_expert_hidden_size, tokens
    E, chunks = cfg.num_experts, -(-H // seam_cols(H))
    regions = {
        "x": ((S, H), torch.bfloat16),
        "route_ids": ((S, K), torch.int32),
        "route_w": ((S, K), torch.float32),
        "route_keys": ((S, -(-E // route_chunk(E, K)), ROUTE_PART_ROWS, next_pow2(K)), torch.int64),
        "expert_act": ((S, K, cfg.moe_intermediate_size // tp), torch.bfloat16),
        "latent_sq": ((S, -(-L // latent_part_cols(L))), torch.float32),
        "latent": ((S, L // tp), torch.bfloat16),
        "shared_act": ((S, cfg.shared_intermediate // tp), torch.bfloat16),
        "seam_part": ((S, -(-H // SEAM_SCORE_COLS), 2, seam_candidates_max(cfg)), torch.float32),
        "seam_h": ((S, H), torch.bfloat16),
        "seam_hsq": ((S, chunks), torch.float32),
    }
    if m1c is not None:
        regions["split_o"] = ((m1c.splits, S, m1c.heads, m1c.latent), torch.float32)
        regions["split_lse"] = ((m1c.splits, S, m1c.heads), torch.float32)
    if x_parts > 1:
        regions["logits_parts"] = ((x_parts - 1, S, E // tp), torch.float32)
        regions["z_parts"] = ((x_parts - 1, S, L // tp), torch.float32)
    return _pack(regions)


def layout_bytes(layout: dict) -> int:
    return layout["__end__"][0]


def region_views(buffer: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    """Typed views of a flat uint8 ``buffer`` (no copies): name -> tensor."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < layout_bytes(layout):
        raise ValueError(f"region_views: expected a flat uint8 buffer of at least {layout_bytes(layout)} bytes")
    views = {}
    for name, (offset, shape, dtype) in layout.items():
        if name == "__end__":
            continue
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        views[name] = buffer[offset : offset + nbytes].view(dtype).view(shape)
    return views
