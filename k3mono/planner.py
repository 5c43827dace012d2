"""Geometry of the stage kernels: how each stage's work is cut into tasks.

Every block size the kernels use is chosen here, from the shapes alone, so a
kernel file holds no magic numbers. Why these values:

* GEMV stages read each weight byte once; a task streams ``rows`` weight rows
  of ``block_k`` columns at a time. 16-byte loads per thread want block_k a
  multiple of 8 bf16 (or 32 MXFP4 nibbles, one scale group); enough tasks to
  cover every SM several times want ``rows`` small (the o_proj at T = 8 has
  7168 rows: 448 tasks of 16 rows).
* Tokens are padded to ``tokens_pad`` (a power of two); from 16 tokens on the
  GEMVs use the tensor cores (tl.dot needs 16 rows), below it CUDA-core FMAs.
* Vector stages (reduces, norms, routing) work on one token per program and
  loop over the hidden size in ``vector_block`` columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import MAX_TOKENS, MXFP4_GROUP, K3Config

DOT_MIN_TOKENS = 16
"""tl.dot needs at least 16 rows in its first operand."""


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class GemvTile:
    rows: int  # weight rows (outputs) a task produces
    block_k: int  # weight columns loaded per step
    warps: int


@dataclass(frozen=True)
class StageGeometry:
    tokens: int  # S
    tokens_pad: int  # S rounded up to a power of two (16 when use_dot)
    use_dot: bool
    oproj: GemvTile
    router: GemvTile
    latent_down: GemvTile
    shared_gate_up: GemvTile
    final: GemvTile  # latent up + shared down
    expert_gate_up: GemvTile  # MXFP4, block_k a multiple of MXFP4_GROUP
    expert_down: GemvTile  # MXFP4
    vector_block: int  # columns a vector stage handles per step
    vector_warps: int


def _gemv(rows: int, out_dim: int, in_dim: int, block_k: int, warps: int = 4) -> GemvTile:
    """A tile no larger than the output and the input it covers."""
    return GemvTile(rows=min(rows, next_pow2(out_dim)), block_k=min(block_k, next_pow2(in_dim)), warps=warps)


def stage_geometry(cfg: K3Config, tp: int, tokens: int) -> StageGeometry:
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"stage_geometry: tokens must be 1..{MAX_TOKENS}, got {tokens}")
    H, C, E, L = cfg.hidden_size, cfg.core_width, cfg.num_experts, cfg.routed_expert_hidden_size
    I, SI = cfg.moe_intermediate_size, cfg.shared_intermediate
    use_dot = tokens >= DOT_MIN_TOKENS
    return StageGeometry(
        tokens=tokens,
        tokens_pad=max(next_pow2(tokens), DOT_MIN_TOKENS) if use_dot else next_pow2(tokens),
        use_dot=use_dot,
        oproj=_gemv(16, H, C // tp, 256),
        router=_gemv(16, E // tp, H, 256),
        latent_down=_gemv(16, L // tp, H, 256),
        shared_gate_up=_gemv(16, SI // tp, H, 256),
        final=_gemv(16, H, max(L, SI) // tp, 256),
        expert_gate_up=_gemv(16, I // tp, L, 8 * MXFP4_GROUP),
        expert_down=_gemv(16, L, I // tp, 4 * MXFP4_GROUP),
        vector_block=min(1024, next_pow2(H)),
        vector_warps=4,
    )
