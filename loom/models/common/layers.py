"""Plain single-device building blocks: RMSNorm, grouped-query attention, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels.attention.flex import flex_attend
from loom.kernels.attention.op import flash_attention
from loom.kernels.attention.reference import doc_ids_from_positions, document_bounds, document_starts, visible
from loom.kernels.rmsnorm.op import rms_norm
from loom.kernels.rope.op import apply_rope as fused_apply_rope
from loom.kernels.swiglu.op import swiglu
from loom.models.common.rope import apply_rope


class RMSNorm(nn.Module):
    """``fused``: one ``loom::rms_norm`` op (Triton on CUDA), the same math as below."""

    def __init__(self, dim: int, eps: float, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, self.weight, self.eps)
        xf = x.float()  # statistics in fp32 whatever the compute dtype
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight.type_as(x)


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
    # PyTorch's own backend choice: on Hopper/Blackwell with cuDNN > 9.15 (torch 2.11's wheels) that is cuDNN first,
    # measured fastest for causal attention on H100 (bench/results/kernels_*_h100.md). No ``sdpa_kernel(...,
    # set_priority=True)`` here: it stopped PyTorch from switching its process-wide order to cuDNN first, so after
    # it every other SDPA call in the process (transformers' compiled model: memory-efficient attention, 24% slower
    # steps) got FlashAttention-2's order (bench/NOTES.md v22).
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


class Attention(nn.Module):
    """Causal grouped-query attention; head counts are read from weight shapes so TP can shard them."""

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
        # set by loom.parallel.context_parallel.apply_context_parallel: x is then this rank's share of the
        # sequence, and the ContextParallel object knows its positions and attends across ranks
        self.context_parallel = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        bsz, seq, _ = x.shape  # (B, S, E); S = this rank's tokens under context parallelism
        cp = self.context_parallel
        documents = positions  # per-document positions of packed documents (this rank's tokens), or None
        if cp is not None and positions is None:  # RoPE positions: where this rank's tokens sit in the sequence
            positions = cp.positions(seq, x.device).expand(bsz, seq)  # (B, S)
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)  # (B, S, Hq, D)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)  # (B, S, Hkv, D)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)  # (B, S, Hkv, D)
        q, k = self.apply_rope(q, rope, positions), self.apply_rope(k, rope, positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        if cp is not None:
            out = cp.attend(q, k, v, documents)  # (B, Hq, S, D)
        else:
            out = attend(q, k, v, self.backend, documents)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))  # (B, S, E)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); ``fused``: the gate as one ``loom::swiglu`` op (Triton on CUDA)."""

    def __init__(self, dim: int, hidden: int, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.w2(swiglu(self.w1(x), self.w3(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
