"""DeepSeek-V3 as plain single-device PyTorch: loom's Llama blocks (MLA, dense or DeepSeekMoE per
``DeepSeekV3Args.moe_layer``) and multi-token prediction. Parallelism is applied afterwards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels.linear_ce import linear_cross_entropy
from loom.models.common.layers import RMSNorm
from loom.models.deepseek_v3.args import DeepSeekV3Args
from loom.models.llama.model import Block, Llama
from loom.numerics import IGNORE, cross_entropy_sum


class MTP(nn.Module):
    """One multi-token prediction module (DeepSeek-V3, section 2.2): the previous depth's hidden states and the
    embeddings of the tokens one further ahead, each normalized (``hnorm``, ``enorm``), concatenated (embeddings
    first, as DeepSeek's checkpoint expects) and projected (``eh_proj``), then one transformer block; ``norm`` is its
    head's norm before the model's shared output head. Names follow DeepSeek's checkpoint (its extra layer)."""

    def __init__(self, args: DeepSeekV3Args, index: int):
        super().__init__()
        self.enorm = RMSNorm(args.dim, args.norm_eps, fused=args.fused_norm)
        self.hnorm = RMSNorm(args.dim, args.norm_eps, fused=args.fused_norm)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = Block(args, index)
        self.norm = RMSNorm(args.dim, args.norm_eps, fused=args.fused_norm)

    def forward(
        self, h: torch.Tensor, emb: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """h, emb (B, S, E) -> the next depth's hidden states (B, S, E)."""
        return self.block(self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)), rope, positions)


def shifted(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """(B, S) -> (B, S) with t[:, i + k] at i, ``fill`` past the end."""
    return F.pad(t[:, k:], (0, k), value=fill)


class DeepSeekV3(Llama):
    """Llama's embedding, blocks, norm and head, plus ``mtp`` (a ModuleDict keyed by the MTP block's layer index,
    as DeepSeek numbers it: n_layers, n_layers + 1, ...; None without MTP). In training with labels, the k-th
    module predicts the token k + 1 ahead (not across packed documents) and the loss adds
    ``mtp_weight / mtp_depth`` x their summed token losses; in eval, generation and export it is not run.

    ``context``: where the tokens k ahead come from, its ``shifted(t, k, fill)`` as ``shifted``'s; None: this
    process holds whole sequences (context parallelism installs its own: loom.parallel.context_parallel)."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        self.context = None
        self.mtp = (
            nn.ModuleDict(
                {str(args.n_layers + k): MTP(args, args.n_layers + k) for k in range(args.mtp_depth)}
            )
            if args.mtp_depth
            else None
        )

    def token_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed token loss of normalized hidden states h (B, S, E) through the output head."""
        if self.args.fused_loss:
            return linear_cross_entropy(h, self.output.weight, labels)
        return cross_entropy_sum(self.output(h), labels)

    def ahead(self, t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
        """(B, S) -> (B, S): each token's value k tokens further in the whole sequence, ``fill`` past its end."""
        return shifted(t, k, fill) if self.context is None else self.context.shifted(t, k, fill)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``Llama.forward``, plus the MTP losses in training with labels. A pipeline's last stage (hidden
        states in; its schedule's loss function takes the main loss from the logits) is given the micro-batch's
        token ids and labels as ``mtp_tokens`` / ``mtp_labels`` (B, S) and returns (logits (B, S, V), the weighted
        MTP loss); the other stages ignore them (loom.parallel.pipeline.last_stage_inputs)."""
        if (
            self.mtp is not None
            and self.training
            and tokens.is_floating_point()
            and mtp_labels is not None
            and self.output is not None
        ):
            h = tokens  # (B, S, E) from the previous stage
            for layer in self.layers.values():
                h = layer(h, self.rope, positions)
            return self.output(self.norm(h)), self.mtp_loss(h, mtp_tokens, mtp_labels, positions)
        if (
            self.mtp is None
            or labels is None
            or not self.training
            or tokens.is_floating_point()
            or self.output is None
            or self.tok_embeddings is None
        ):
            return super().forward(tokens, positions, labels)
        h = self.tok_embeddings(tokens)  # (B, S, E)
        for layer in self.layers.values():
            h = layer(h, self.rope, positions)
        loss = self.token_loss(self.norm(h), labels)
        return loss + self.mtp_loss(h, tokens, labels, positions)

    def mtp_loss(
        self, h: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """``mtp_weight / mtp_depth`` x the modules' summed token losses, from the last block's hidden states h
        (B, S, E) and the (B, S) token ids and labels (a DTensor under tensor parallelism, as the main loss)."""
        extra = None
        for k, module in enumerate(self.mtp.values(), start=1):
            target = self.ahead(labels, k, IGNORE)  # (B, S) the token k + 1 ahead
            if positions is not None:  # the same document k tokens on
                target = target.masked_fill(self.ahead(positions, k, -1) != positions + k, IGNORE)
            h = module(h, self.tok_embeddings(self.ahead(tokens, k, 0)), self.rope, positions)
            depth_loss = self.token_loss(module.norm(h), target)
            extra = depth_loss if extra is None else extra + depth_loss
        return self.args.mtp_weight / len(self.mtp) * extra
