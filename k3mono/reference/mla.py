"""The spec of the MLA decode stages of Kimi-K3's 24 MLA layers, for one rank's heads.

Shape legend: S query tokens, B requests, heads (96 / T), splits of each
request's KV range, page_size cache rows a page; widths DQK = DL + DR
(512 latent + 64 positional), DL (the latent, also the value width), DV = 128
(v_head_dim).

M1c, absorbed MLA decode attention over a paged latent cache (``mla_attn``):

    request b owns tokens qsl[b] .. qsl[b+1] - 1 (n_b >= 1 of them: more than
    one for speculative decoding) and context positions 0 .. L_b - 1, where
    L_b = seq_lens[b] includes its query tokens; position t lives in row
    t % page_size of page pages[indptr[b] + t // page_size]
    query token j of request b sees positions 0 .. L_b - n_b + j (causal)
    score[t] = scale * (q[s, h, :] . kv[t, :])        all DQK dims; no rotary (Kimi-K3)
    split k covers positions k*chunk_b .. (k+1)*chunk_b - 1, chunk_b = ceil(L_b / splits)
    lse[k, s, h] = log(sum_{visible t in split k} exp(score[t]))     natural log
    o[k, s, h]   = sum_t exp(score[t] - lse[k, s, h]) * kv[t, :DL]    values = the latent
    a split with no visible position: lse = -inf, o = 0

M1b, the back-end (``mla_back``):

    a[k]       = exp(lse[k] - lse_all),  lse_all = log(sum_k exp(lse[k]))   empty splits weigh 0
    o_c[s, h]  = sum_k a[k] * o[k, s, h]                                    [DL]
    y[s, h]    = w_v[h] @ o_c[s, h]                                         [DV], absorbed V projection
    core[s, h*DV + d] = y[s, h, d] * sigmoid(gate[s, h*DV + d])             the MLA output gate

Split geometry: every request's KV range is cut into ``splits`` chunks of
ceil(L_b / splits) positions, per request. The cut needs nothing but the
request's own length, so a launch has a fixed grid (tokens x splits) that a
CUDA graph can capture, needs no host read of the lengths, and gives every
split of a request the same work; the last chunks of a short request (L_b <
splits) or past a query token's causal end are empty.

fp8 operands (kv, w_v as torch.float8_e4m3fn) carry a per-tensor scale and are
dequantised to x * scale; a bf16 operand takes scale 1.0.

Numerics. The oracle (``mode="oracle"``) is float64 with no intermediate
rounding (fp8 dequantised exactly). The bf16 mode (``mode="bf16"``) rounds
where a fused kernel on bf16 tensor cores must:

* q and bf16 kv are used as they are; fp8 kv and w_v are dequantised to
  bf16(fp32(x) * fp32(scale)), the bf16 operand the dot consumes;
* scores: fp32 dot of all DQK dims, times fp32(scale);
* p = bf16(exp(score - m)): the softmax weights are rounded to bf16 as the
  P @ V dot's operand, and the split's normaliser l sums those rounded p
  (o is then an exact convex combination of value rows up to fp32, and
  combining splits stays consistent with one split). The reference takes m
  as the split's max; a one-pass kernel takes its running max, which changes
  which p round which way but not the size of the error;
* o = (sum_t p_t kv_t[:DL]) / l and lse = m + log(l), fp32, unrounded;
* o_c: the combine in fp32, then rounded to bf16 (the w_v dot's operand);
* y: fp32 dot; core = bf16(y * sigmoid(fp32(gate))), one rounding (the
  fused gate; eager torch would round y, sigmoid and the product: three).
"""

from __future__ import annotations

import torch

from ..errors import K3InputError
from .stages import MODES, Numerics

LATENT_DIM = 512
"""DL, Kimi-K3's kv_lora_rank: the latent width of q, kv and the values."""

ROPE_DIM = 64
"""DR, qk_rope_head_dim: the positional dims after the latent ones (no rotary applied)."""

FP8 = torch.float8_e4m3fn


def _numerics(mode: str) -> Numerics:
    if mode not in MODES:
        raise K3InputError(f"mode: expected one of {list(MODES)}, got {mode!r}")
    return MODES[mode]


def dequantize(num: Numerics, name: str, x: torch.Tensor, scale: float) -> torch.Tensor:
    """x * scale in num.dtype: fp8 rounded to the bf16 dot operand in bf16 mode; bf16 as it is."""
    if x.dtype == FP8:
        return num.round(num.cast(x) * scale)
    if scale != 1.0:
        raise K3InputError(f"{name}_scale: a {x.dtype} {name} takes scale 1.0, got {scale}")
    return num.cast(x)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def split_chunk(seq_len: int, splits: int) -> int:
    """Positions in each split of a request with context seq_len: ceil(seq_len / splits)."""
    return _ceil_div(seq_len, splits)


def check_requests(q, kv, qsl, seq_lens, pages, indptr) -> None:
    """The request layout's values: raise a K3InputError unless they describe q and kv."""
    tokens, num_pages, page_size = q.shape[0], kv.shape[0], kv.shape[1]
    starts, lens, spans = qsl.tolist(), seq_lens.tolist(), indptr.tolist()
    if len(starts) != len(lens) + 1 or len(spans) != len(lens) + 1:
        raise K3InputError(f"qsl, indptr: expected {len(lens) + 1} entries (B + 1), got {len(starts)}, {len(spans)}")
    if starts[0] != 0 or starts[-1] != tokens:
        raise K3InputError(f"qsl: expected to run from 0 to S = {tokens}, got {starts}")
    for b, length in enumerate(lens):
        queries = starts[b + 1] - starts[b]
        if queries < 1 or length < queries:
            raise K3InputError(f"request {b}: expected 1 <= query tokens <= seq_len, got {queries} and {length}")
        if spans[b + 1] - spans[b] < _ceil_div(length, page_size):
            raise K3InputError(f"request {b}: {spans[b + 1] - spans[b]} pages hold fewer than seq_len = {length} rows")
    if spans[0] != 0 or spans[-1] > pages.numel():
        raise K3InputError(f"indptr: expected to run from 0 to at most {pages.numel()}, got {spans}")
    used = pages[: spans[-1]]
    if used.numel() and not (0 <= int(used.min()) and int(used.max()) < num_pages):
        raise K3InputError(f"pages: expected page ids in [0, {num_pages}), got {used.tolist()}")


def context_rows(kv: torch.Tensor, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A request's cache rows in position order: kv [pages, page_size, DQK] -> [seq_len, DQK]."""
    return kv[pages.long()].reshape(-1, kv.shape[-1])[:seq_len]


def split_softmax(num: Numerics, scores: torch.Tensor, values: torch.Tensor):
    """(o [heads, DL], lse [heads]) of scores [heads, n] (n >= 1) over values [n, DL]."""
    top = scores.max(dim=-1, keepdim=True).values
    p = num.round(torch.exp(scores - top))
    total = p.sum(dim=-1, keepdim=True)
    return (p @ values) / total, (top + torch.log(total)).squeeze(-1)


def mla_attn(q, kv, qsl, seq_lens, pages, indptr, scale, splits, *, kv_scale=1.0, latent_dim=LATENT_DIM, mode="bf16"):
    """M1c: (o [splits, S, heads, DL], lse [splits, S, heads]); fp32 in bf16 mode, float64 in the oracle.

    q [S, heads, DQK] bf16; kv [pages, page_size, DQK] bf16 or fp8 (kv_scale);
    qsl [B + 1], seq_lens [B], indptr [B + 1], pages int32 (module docstring).
    """
    num = _numerics(mode)
    check_requests(q, kv, qsl, seq_lens, pages, indptr)
    tokens, heads, _ = q.shape
    kv_values = dequantize(num, "kv", kv, kv_scale)
    o = torch.zeros(splits, tokens, heads, latent_dim, dtype=num.dtype, device=q.device)
    lse = torch.full((splits, tokens, heads), float("-inf"), dtype=num.dtype, device=q.device)
    starts, lens, spans = qsl.tolist(), seq_lens.tolist(), indptr.tolist()
    for b, seq_len in enumerate(lens):
        rows = context_rows(kv_values, pages[spans[b] : spans[b + 1]], seq_len)
        chunk = split_chunk(seq_len, splits)
        queries = starts[b + 1] - starts[b]
        for j in range(queries):
            s = starts[b] + j
            scores = (num.cast(q[s]) @ rows.T) * scale  # [heads, seq_len]
            visible = seq_len - queries + j + 1
            for k in range(splits):
                lo, hi = k * chunk, min((k + 1) * chunk, visible)
                if lo < hi:
                    o[k, s], lse[k, s] = split_softmax(num, scores[:, lo:hi], rows[lo:hi, :latent_dim])
    return o, lse


def combine_splits(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """sum_k softmax_k(lse) * o[k]: [S, heads, DL], unrounded; empty splits (-inf) weigh 0."""
    weights = torch.softmax(lse, dim=0)
    return (weights.unsqueeze(-1) * o).sum(dim=0)


def mla_back(o, lse, w_v, gate, *, w_v_scale=1.0, mode="bf16"):
    """M1b: core [S, heads * DV] (bf16 in bf16 mode, float64 in the oracle).

    o [splits, S, heads, DL] and lse [splits, S, heads] as mla_attn returns
    them; w_v [heads, DV, DL] bf16 or fp8 (w_v_scale); gate [S, heads * DV] bf16.
    """
    num = _numerics(mode)
    combined = num.round(combine_splits(num.cast(o), num.cast(lse)))
    y = torch.einsum("shl,hdl->shd", combined, dequantize(num, "w_v", w_v, w_v_scale))
    core = num.round(y.reshape(gate.shape) * torch.sigmoid(num.cast(gate)))
    return core.to(torch.bfloat16) if num.rounds else core


def mla_decode(q, kv, qsl, seq_lens, pages, indptr, scale, w_v, gate, splits, *,
               kv_scale=1.0, w_v_scale=1.0, mode="bf16"):
    """M1c then M1b: core [S, heads * DV]."""
    o, lse = mla_attn(q, kv, qsl, seq_lens, pages, indptr, scale, splits,
                      kv_scale=kv_scale, latent_dim=w_v.shape[-1], mode=mode)
    return mla_back(o, lse, w_v, gate, w_v_scale=w_v_scale, mode=mode)
