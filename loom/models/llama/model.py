"""Decoder-only Llama as plain single-device PyTorch. Parallelism is applied afterwards."""

from __future__ import annotations

import torch
from torch import nn

from loom.kernels.linear_ce import linear_cross_entropy
from loom.models.common.layers import Attention, FeedForward, RMSNorm
from loom.models.common.mla import LatentAttention, YarnScaling, yarn_rope_table
from loom.models.common.moe import MoE
from loom.models.common.rope import rope_table
from loom.models.llama.flavors import LlamaArgs
from loom.numerics import cross_entropy_sum


def model_rope_table(args: LlamaArgs, max_len: int, device=None) -> torch.Tensor:
    """The RoPE table (2, max_len, rope_dim) of a model with these args: Llama 3 or YaRN scaling, over the whole head
    or MLA's decoupled part."""
    if isinstance(args.rope_scaling, YarnScaling):
        return yarn_rope_table(args.rope_dim, max_len, args.rope_theta, args.rope_scaling, device=device)
    return rope_table(args.rope_dim, max_len, args.rope_theta, args.rope_scaling, device=device)


class Block(nn.Module):
    """One transformer block; ``index``: its place in the model (whether it has experts: ``args.moe_layer``)."""

    def __init__(self, args: LlamaArgs, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, fused=args.fused_norm)
        if args.mla:
            self.attention = LatentAttention(
                args.dim,
                args.n_heads,
                args.q_lora_rank,
                args.kv_lora_rank,
                args.qk_nope_head_dim,
                args.qk_rope_head_dim,
                args.v_head_dim,
                fused_rope=args.fused_rope,
                backend=args.attention,
                fused_norm=args.fused_norm,
                rope_interleave=args.rope_interleave,
                scaling=args.rope_scaling,
            )
        else:
            self.attention = Attention(
                args.dim,
                args.n_heads,
                args.n_kv_heads,
                args.head_dim,
                fused_rope=args.fused_rope,
                backend=args.attention,
                bias=args.attention_bias,
                qk_norm=args.qk_norm,
                norm_eps=args.norm_eps,
                fused_norm=args.fused_norm,
                window=args.sliding_window,
            )
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, fused=args.fused_norm)
        if args.moe_layer(index):
            self.feed_forward = MoE(
                args.dim,
                args.expert_ffn_dim,
                args.moe_experts,
                args.moe_top_k,
                aux_loss=args.moe_aux_loss,
                fused=args.fused_swiglu,
                **args.moe_routing(),
            )
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim, fused=args.fused_swiglu)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, positions)  # (B, S, E)
        return x + self.feed_forward(self.ffn_norm(x))  # (B, S, E)


class Llama(nn.Module):
    """Layers live in a ModuleDict keyed by index so names survive pipeline splitting."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        assert args.vocab_size > 0, "resolve the vocabulary size before building the model"
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps, fused=args.fused_norm)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", self._rope_table(), persistent=False)

    def _rope_table(self, device=None) -> torch.Tensor:
        return model_rope_table(self.args, self.args.max_seq_len, device)

    def init_buffers(self, device) -> None:
        """Recompute non-persistent buffers after materializing from the meta device."""
        self.rope = self._rope_table(device)

    def param_std(self, name: str) -> float | None:
        """Init std for a parameter by name; None = ones (norm weights), 0 = zeros (biases)."""
        if name.endswith("norm.weight"):
            return None
        if name.endswith(".bias"):
            return 0.0
        # residual
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")) and self.args.residual_init == "depth":
            return 0.02 / (2 * self.args.n_layers) ** 0.5
        if name == "output.weight":  # an untied head: initial logits' std at most 1 (dim**-0.5 past dim 2500)
            return min(0.02, self.args.dim**-0.5)
        return 0.02

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens: (B, S) int64; positions: (B, S) per-document positions or None. Returns logits (B, S, V),
        or with ``labels`` ((B, S) int64, IGNORE = no loss) the summed token loss (fp32 scalar): through
        ``linear_cross_entropy`` (no full logits) when ``args.fused_loss``, else ``cross_entropy_sum`` of
        the logits. The loss is taken here because under FSDP2 the output weight is unsharded only
        inside forward. A pipeline stage without ``output`` ignores ``labels``.

        A pipeline stage is this model with parts removed (set to None, layers deleted): it embeds
        integer input (token ids) and passes floating input (the previous stage's hidden states, (B, S, E))
        straight to its layers. A last stage with tied embeddings keeps ``tok_embeddings`` only to hold
        the shared weight of ``output``."""
        h = tokens if tokens.is_floating_point() else self.tok_embeddings(tokens)  # (B, S, E)
        for layer in self.layers.values():
            h = layer(h, self.rope, positions)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h  # (B, S, E)
        if labels is None:
            return self.output(h)  # (B, S, V)
        if self.args.fused_loss:
            return linear_cross_entropy(h, self.output.weight, labels)  # h (B, S, E), labels (B, S)
        return cross_entropy_sum(self.output(h), labels)
