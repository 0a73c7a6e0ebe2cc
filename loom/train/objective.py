"""Objectives: what a training step minimizes over a micro-batch and which of its tokens count. A step's loss is
the sum of the objective's token losses over the global batch divided by the global count, so it is the same
whatever the layout and accumulation. The step strategies (loom.train.steps) run any objective unchanged."""

from __future__ import annotations

from typing import Protocol

import torch

from loom.data.loader import MicroBatch
from loom.numerics import cross_entropy_sum, valid_tokens


class Objective(Protocol):
    """The loss of one micro-batch, summed over the units it counts (an fp32 scalar)."""

    loss_in_forward: bool  # forward() already returns the summed loss (the model computes it: no logits kept)

    def count(self, mb: MicroBatch) -> torch.Tensor:
        """How many units of ``mb`` the loss is summed over (a step divides by the global count)."""

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        """``model`` on ``mb`` (under the step's autocast); ``positions``: per-document positions or None."""

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed loss from the model's outputs (a pipeline's last stage calls only this)."""


class LanguageModeling:
    """Next-token cross-entropy over every labelled token (labels equal to IGNORE take none). With
    ``fused_loss`` the model computes it inside its forward, never materializing the logits."""

    def __init__(self, fused_loss: bool):
        self.loss_in_forward = fused_loss

    def count(self, mb: MicroBatch) -> torch.Tensor:
        return valid_tokens(mb.labels)

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        if self.loss_in_forward:
            return model(mb.inputs, positions, labels=mb.labels)
        return model(mb.inputs, positions)  # (B, S, V), or a vocab-sharded DTensor (B, S, V/tp)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(outputs, labels)


def build_objective(name: str, fused_loss: bool) -> Objective:
    """The objective ``training.objective`` names. 'sft' is language modeling as well: its loader labels every
    token outside the assistant's turns IGNORE, and the count of labelled tokens is already the count of assistant
    targets, so the step's loss is their summed loss over the global count of them, whatever the layout."""
    objectives = {"lm": LanguageModeling, "sft": LanguageModeling}
    return objectives[name](fused_loss)
