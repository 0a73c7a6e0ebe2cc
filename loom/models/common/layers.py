"""Plain single-device building blocks: RMSNorm, grouped-query attention, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.common.rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # statistics in fp32 whatever the compute dtype
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention; head counts are read from weight shapes so TP can shard them."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        bsz, seq, _ = x.shape  # (B, S, E)
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)  # (B, S, Hq, D)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)  # (B, S, Hkv, D)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)  # (B, S, Hkv, D)
        q, k = apply_rope(q, rope, positions), apply_rope(k, rope, positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, Hq, S, D)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))  # (B, S, E)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
