"""Plain single-device building blocks: RMSNorm, grouped-query attention, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels.attention.flex import flex_attend
from loom.kernels.attention.op import flash_attention
from loom.kernels.attention.reference import doc_ids_from_positions, document_bounds, document_starts, visible
from loom.kernels.rmsnorm.op import rms_norm
from loom.kernels.rmsnorm.reference import rms_norm as rms_norm_reference
from loom.kernels.rope.op import apply_rope as fused_apply_rope
from loom.kernels.rope.reference import apply_rope
from loom.kernels.swiglu.op import swiglu
from loom.kernels.swiglu.reference import swiglu as swiglu_reference


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics (``loom.kernels.rmsnorm.reference``); ``fused``: the same math as one
    ``loom::rms_norm`` op (Triton on CUDA)."""

    def __init__(self, dim: int, eps: float, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm if self.fused else rms_norm_reference)(x, self.weight, self.eps)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str,
           positions: torch.Tensor | None) -> torch.Tensor:
    """Causal attention over q (B, Hq, S, D), k/v (B, Hkv, S, D). With per-document ``positions`` (B, S),
    packed documents never attend to each other (a document starts where its position is 0)."""
    if backend == "flex":
        return flex_attend(q, k, v, None if positions is None else document_starts(doc_ids_from_positions(positions)))
    bounds = None if positions is None else document_bounds(doc_ids_from_positions(positions))  # (2, B, S)
    if backend == "flash":
        return flash_attention(q, k, v, causal=True, bounds=bounds)
    gqa = q.shape[1] != k.shape[1]
    mask = None if bounds is None else visible(q.shape[2], True, bounds, 0, q.device)  # (B, 1, S, S), slower
    # SDPA picks its own backend; no sdpa_kernel(..., set_priority=True) context: it changes other SDPA calls'
    # choice in the process (docs/kernels.md)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


class LocalContext:
    """``Attention.context`` by default: this rank holds whole sequences. Context parallelism installs its own
    (``loom.parallel.context_parallel.ContextParallel``): this rank's share of each sequence, attended across ranks."""

    def rope_positions(self, positions: torch.Tensor | None, bsz: int, seq: int, device) -> torch.Tensor | None:
        """RoPE positions of this rank's (B, S) tokens: the per-document ``positions`` of packed documents, or None
        for 0..S-1."""
        return positions

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None,
               backend: str) -> torch.Tensor:
        """Causal attention of q (B, Hq, S, D) over k/v (B, Hkv, S, D) (``attend``)."""
        return attend(q, k, v, backend, positions)


LOCAL_CONTEXT = LocalContext()  # stateless: shared by every attention module until loom.parallel replaces it


class Attention(nn.Module):
    """Causal grouped-query attention; head counts are read from weight shapes so TP can shard them.

    ``context``, the module's one extension point: the sequences x's tokens belong to, which give their RoPE
    positions and what they attend to (``LocalContext``; context parallelism installs its own)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, fused_rope: bool = False,
                 backend: str = "sdpa"):
        super().__init__()
        self.head_dim = head_dim
        self.backend = backend  # "sdpa" (PyTorch), "flash" (loom's Triton FlashAttention-2), "flex" (FlexAttention)
        self.apply_rope = fused_apply_rope if fused_rope else apply_rope  # fused: one loom::apply_rope op
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.context = LOCAL_CONTEXT

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """x (B, S, E): this rank's tokens; ``positions`` (B, S): their per-document positions (packed
        documents), or None."""
        bsz, seq, _ = x.shape
        rope_at = self.context.rope_positions(positions, bsz, seq, x.device)  # (B, S), or None: 0..S-1
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)  # (B, S, Hq, D)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)  # (B, S, Hkv, D)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)  # (B, S, Hkv, D)
        q, k = self.apply_rope(q, rope, rope_at), self.apply_rope(k, rope, rope_at)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        out = self.context.attend(q, k, v, positions, self.backend)  # (B, Hq, S, D)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))  # (B, S, E)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), the gate from ``loom.kernels.swiglu.reference``; ``fused``: the gate as one
    ``loom::swiglu`` op (Triton on CUDA)."""

    def __init__(self, dim: int, hidden: int, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2((swiglu if self.fused else swiglu_reference)(self.w1(x), self.w3(x)))
