"""Objectives: what a training step minimizes over a micro-batch and which of its tokens count. A step's loss is
the sum of the objective's token losses over the global batch divided by the global count, so it is the same
whatever the layout and accumulation. The step strategies (loom.train.steps) run any objective unchanged; each
method's own objective lives with the method (loom.methods)."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import FSDPModule

from loom.data.loader import MicroBatch
from loom.numerics import cross_entropy_sum, valid_tokens


class Objective:
    """The loss of one micro-batch, summed over the units it counts (an fp32 scalar), and every hook the engine and
    the loop call on it, each with its default here (a method overrides what it needs: loom.methods)."""

    loss_in_forward: bool = (
        True  # forward() already returns the summed loss (the model computes it: no logits kept)
    )
    data: str = "lm"  # the prepared data the engine's loader reads (loom.data's kinds: lm, sft, dpo)
    rejected: str = (
        "docstring"  # the embedded preference pairs' rejected answers (data.embedded_rejected auto)
    )
    console: tuple = ()  # the console line's own fields (loom.metrics.logger.ConsoleField): none beyond the loss
    panels: tuple = ()  # `loom report`'s panels of this method (loom.metrics.report.PANELS' form): the common ones
    # every rank's micro-batches have one shape (a rollout method pads each rank's rows to its own longest): what the
    # embedding split by rows needs (parallel.fsdp_embedding)
    equal_widths: bool = True
    rows_per_example: int = 1  # rows a micro-batch holds per example (pair data: chosen and rejected, 2)

    def count(self, mb: MicroBatch) -> torch.Tensor:
        """How many units of ``mb`` the loss is summed over (a step divides by the global count)."""
        raise NotImplementedError

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        """``model`` on ``mb`` (under the step's autocast); ``positions``: per-document positions or None."""
        raise NotImplementedError

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed loss from the model's outputs (a pipeline's last stage calls only this)."""
        raise NotImplementedError(
            f"{type(self).__name__} computes its loss in forward (pipelines are refused)"
        )

    def configure(self, model_args) -> None:
        """The model's resolved arguments, before the step strategy is built (e.g. whether its forward computes
        the loss)."""

    def build_loader(self, engine):
        """The objective's own data (GRPO's and PPO's rollouts), or None: the engine builds the configured data."""
        return None

    def replace_head(self, model: torch.nn.Module) -> None:
        """A head in place of the LM head (a reward model's score head), put on the plain model (meta device) before
        it is parallelized; the parameter figures (banner, MFU, checkpoint size) count it."""

    def attach(self, model: torch.nn.Module) -> None:
        """Heads trained beside the plain model (PPO's value function), put on after ``replace_head``; the
        parameter figures leave them out."""

    def heads_hidden(self, parts: list[torch.nn.Module]) -> contextlib.AbstractContextManager:
        """The parts without this objective's extra heads for a while (model.init_from loads the base's names)."""
        return contextlib.nullcontext()

    def prepare(self, engine) -> None:
        """Once the engine is built, before the first step: work the objective needs from the model and data
        (DPO's cached reference pass, or its frozen reference copy)."""

    def begin(self, mbs: list[MicroBatch], data_sum) -> None:
        """Before a step's (or a validation pass's) micro-batches run, with all of this rank's: work over the whole
        global batch (``data_sum(t)``: ``t`` summed over the data-parallel ranks), e.g. KTO's KL estimate or ORPO's
        count of chosen tokens, so that the loss is the same whatever the layout and accumulation."""

    def step_stats(self) -> dict[str, torch.Tensor]:
        """Statistics summed over the micro-batches run since the last call (then reset), e.g. DPO's rewards: the
        engine sums them over the data-parallel ranks and divides by the global count. {} for none."""
        return {}

    def record(self) -> dict[str, float]:
        """Fields of a logged record beyond the step's statistics (e.g. GRPO's rewards and time split)."""
        return {}


class LanguageModeling(Objective):
    """Next-token cross-entropy over every labelled token (labels equal to IGNORE take none). With
    ``fused_loss`` the model computes it inside its forward, never materializing the logits. ``data``: 'lm'
    (packed text) or 'sft' (conversations whose tokens outside the assistant's turns are labelled IGNORE)."""

    def __init__(self, fused_loss: bool = False, data: str = "lm"):
        self.loss_in_forward, self.data = fused_loss, data

    def configure(self, model_args) -> None:
        # the loss inside the model's forward: fused (no full logits), or with multi-token prediction's own losses
        self.loss_in_forward = model_args.fused_loss or getattr(model_args, "mtp_depth", 0) > 0

    def count(self, mb: MicroBatch) -> torch.Tensor:
        return valid_tokens(mb.labels)

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        if self.loss_in_forward:
            return model(mb.inputs, positions, labels=mb.labels)
        return model(mb.inputs, positions)  # (B, S, V), or a vocab-sharded DTensor (B, S, V/tp)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(outputs, labels)


def release_gathered(model: torch.nn.Module) -> None:
    """Free the parameters FSDP2 keeps gathered after a forward (the root's, and every block's under
    parallel.reshard_after_forward false): they wait for a backward that a frozen model never runs."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
