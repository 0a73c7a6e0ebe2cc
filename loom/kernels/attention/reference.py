"""Attention in pure PyTorch: the definition the Triton kernels are tested against, and the CPU path.

Layout: q (B, Hq, S, D), k and v (B, Hkv, S, D), Hq a multiple of Hkv (grouped-query attention).
Which keys a query sees:
- ``causal``: key j <= query i;
- documents (packed sequences): ``bounds`` (2, B, S) int32 holds, per token, the first and last index of
  its document; query i sees key j only if start_i <= j <= end_i. Padding tokens (negative document id)
  have an empty range (start = S, end = -1): they see nothing and nobody sees them. When queries and keys
  are different pieces of a sequence (context parallelism's chunk pairs), ``bounds`` holds each query's
  range of keys in the keys' coordinates and ``key_bounds`` each key's range of queries in the queries'
  coordinates (exactly the queries that see it: the kernels' backward walks them); the mask is defined by
  ``bounds`` alone, so this reference ignores ``key_bounds``;
- ``window`` > 0 (sliding window): |i - j| < window.
A query that sees no key (a padding token) gets output 0 and log-sum-exp -inf, never NaN.
"""

from __future__ import annotations

import math

import torch


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, S) int: a document is a run of equal ids; negative ids are padding.
    Returns (B, S) int32: first index of each token's document (S for padding): ``document_bounds(...)[0]``
    without the ends, as one scan (no concatenation: FlexAttention's mask function reads it, and Inductor
    fails to lower a mask function whose tensor is a slice of a concatenation under op-level checkpointing)."""
    bsz, seq = doc_ids.shape
    idx = torch.arange(seq, device=doc_ids.device).expand(bsz, seq)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(first, idx, 0).cummax(dim=1).values  # (B, S)
    return torch.where(doc_ids < 0, seq, start).to(torch.int32)


def document_bounds(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, S) int: a document is a run of equal ids; negative ids are padding.
    Returns (2, B, S) int32: first and last index of each token's document ((S, -1) for padding)."""
    bsz, seq = doc_ids.shape
    idx = torch.arange(seq, device=doc_ids.device).expand(bsz, seq)
    last = torch.ones_like(doc_ids, dtype=torch.bool)
    last[:, :-1] = doc_ids[:, :-1] != doc_ids[:, 1:]
    end = torch.where(last, idx, seq - 1).flip(1).cummin(dim=1).values.flip(1)  # (B, S)
    end = torch.where(doc_ids < 0, -1, end).to(torch.int32)
    return torch.stack([document_starts(doc_ids), end])


def shift_bounds(bounds: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """Document bounds (2, B, n) int in a sequence's coordinates -> the same ranges seen from a piece
    [offset, offset + length) of it: shifted, clipped to the piece, and (length, -1) where nothing of the
    range lies inside (the padding convention: an empty range)."""
    start, end = (bounds[0] - offset).clamp_min(0), (bounds[1] - offset).clamp_max(length - 1)
    empty = start > end
    return torch.stack([torch.where(empty, length, start), torch.where(empty, -1, end)]).to(torch.int32)


def doc_ids_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Per-document positions (B, S), restarting at 0 with every document -> document ids (B, S)."""
    return (positions == 0).cumsum(dim=1)


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Varlen layout: documents concatenated into one row of ``total`` tokens, boundaries in
    ``cu_seqlens`` (n_docs + 1,) = [0, len0, len0 + len1, ...]. Tokens past the last boundary are padding."""
    idx = torch.arange(total, device=cu_seqlens.device)
    ids = torch.searchsorted(cu_seqlens[1:].to(idx.dtype), idx, right=True)  # (total,)
    return torch.where(idx < cu_seqlens[-1], ids, -1)[None]  # (1, total)


def visible(seq: int, causal: bool, bounds: torch.Tensor | None, window: int, device) -> torch.Tensor:
    """Boolean (B or 1, 1, S, S): query i (rows) may attend to key j (columns)."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    ok = torch.ones(seq, seq, dtype=torch.bool, device=device)
    if causal:
        ok = ok & (j <= i)
    if window > 0:
        ok = ok & ((i - j).abs() < window)
    ok = ok[None, None]  # (1, 1, S, S)
    if bounds is not None:
        start, end = bounds[0][:, None, :, None], bounds[1][:, None, :, None]  # (B, 1, S, 1)
        ok = ok & (j >= start) & (j <= end)
    return ok


def _expand_kv(t: torch.Tensor, group: int) -> torch.Tensor:
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Compute dtype: float32 for 16-bit inputs, float64 stays float64 (gradcheck)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _scores(q, k, v, causal, bounds, window, scale, row_lse=None):
    """(P, lse, K and V expanded to Hq heads); ``row_lse``: normalize P by it instead of the block's own lse."""
    group = q.shape[1] // k.shape[1]
    kf, vf = _expand_kv(_acc(k), group), _expand_kv(_acc(v), group)  # (B, Hq, S, D)
    s = (_acc(q) @ kf.transpose(-1, -2)) * scale  # (B, Hq, S, S)
    s = s.masked_fill(~visible(q.shape[2], causal, bounds, window, q.device), float("-inf"))
    # (B, Hq, S); -inf: sees nothing
    lse = torch.logsumexp(s, dim=-1) if row_lse is None else row_lse.to(s.dtype)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # (B, Hq, S, S); 0 where masked
    return p, lse, kf, vf


def attention_forward(q, k, v, causal: bool, bounds, window: int, scale: float, key_bounds=None):
    """Returns (out (B, Hq, S, D) in q's dtype, lse (B, Hq, S) float32, natural log)."""
    p, lse, _, vf = _scores(q, k, v, causal, bounds, window, scale)
    return (p @ vf).to(q.dtype), lse.float()


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    causal: bool,
    bounds,
    window: int,
    scale: float,
    key_bounds=None,
    lse_normalizes: bool = False,
):
    """Gradients (dq, dk, dv) of out and lse, by the flash-attention formulas:
    dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − δ) with δ = rowsum(dO ∘ O) − dLSE, dQ = s·dS K, dK = s·dSᵀ Q.
    P is recomputed with the block's own log-sum-exp (exact in float64), or with ``lse_normalizes`` by the
    given ``lse``, as the kernels always do: then k, v may be one block of the keys and out, lse the whole
    row's (ring attention's backward, block by block)."""
    group = q.shape[1] // k.shape[1]
    p, _, kf, vf = _scores(q, k, v, causal, bounds, window, scale, lse if lse_normalizes else None)
    do = _acc(dout)
    delta = (do * _acc(out)).sum(-1)  # (B, Hq, S)
    if dlse is not None:
        delta = delta - dlse.to(do.dtype)
    dv = p.transpose(-1, -2) @ do  # (B, Hq, S, D)
    ds = p * (do @ vf.transpose(-1, -2) - delta[..., None])  # (B, Hq, S, S)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ _acc(q)) * scale
    if group > 1:
        bsz, hkv, seq, dim = k.shape
        dk = dk.view(bsz, hkv, group, seq, dim).sum(2)
        dv = dv.view(bsz, hkv, group, seq, dim).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def as_promised(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in the layout the fake implementations promise, ``torch.empty_like(like)`` (the Triton launchers
    allocate exactly that; the reference may not: e.g. for a query chunk cut out of a transposed tensor,
    as context parallelism passes, where a mismatch fails torch.compile)."""
    if t.stride() == torch.empty_like(like, device="meta").stride():  # no allocation to compare
        return t
    return torch.empty_like(like).copy_(t)
