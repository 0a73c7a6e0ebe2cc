"""The toy family's model: loom's Llama shell (embedding, blocks keyed by index, norm, head) around parallel blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loom.models.common.layers import Attention, FeedForward, RMSNorm
from loom.models.llama import Llama, LlamaArgs


@dataclass(frozen=True)
class ToyArgs(LlamaArgs):
    parallel_residual: bool = True  # the family's own field: one residual add for attention and feed-forward


FLAVORS = {"toy_debug": ToyArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, rope_theta=10000.0)}


class ParallelBlock(nn.Module):
    """x + attention(norm(x)) + feed_forward(norm(x)): one norm, both branches from the block's input."""

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, fused=args.fused_norm)
        self.attention = Attention(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            fused_rope=args.fused_rope,
            backend=args.attention,
            norm_eps=args.norm_eps,
            fused_norm=args.fused_norm,
        )
        self.feed_forward = FeedForward(args.dim, args.ffn_dim, fused=args.fused_swiglu)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        h = self.attention_norm(x)  # (B, S, E)
        return x + self.attention(h, rope, positions) + self.feed_forward(h)  # (B, S, E)


class Toy(Llama):
    def __init__(self, args: ToyArgs):
        super().__init__(args)
        self.layers = nn.ModuleDict({str(i): ParallelBlock(args) for i in range(args.n_layers)})
