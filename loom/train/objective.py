"""Objectives: what a training step minimizes over a micro-batch and which of its tokens count. A step's loss is
the sum of the objective's token losses over the global batch divided by the global count, so it is the same
whatever the layout and accumulation. The step strategies (loom.train.steps) run any objective unchanged."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from loom.checkpoint.manager import content_fingerprint
from loom.config.errors import UserError
from loom.data.loader import MicroBatch
from loom.models.common.lora import adapters_disabled
from loom.numerics import IGNORE, cross_entropy_sum, valid_tokens
from loom.parallel.tensor_parallel import loss_parallel_context, to_local_loss


class Objective(Protocol):
    """The loss of one micro-batch, summed over the units it counts (an fp32 scalar)."""

    loss_in_forward: bool  # forward() already returns the summed loss (the model computes it: no logits kept)

    def count(self, mb: MicroBatch) -> torch.Tensor:
        """How many units of ``mb`` the loss is summed over (a step divides by the global count)."""

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        """``model`` on ``mb`` (under the step's autocast); ``positions``: per-document positions or None."""

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed loss from the model's outputs (a pipeline's last stage calls only this)."""

    def step_stats(self) -> dict[str, torch.Tensor]:
        """Statistics summed over the micro-batches run since the last call (then reset), e.g. DPO's rewards: the
        trainer sums them over the data-parallel ranks and divides by the global count. {} for none."""

    def prepare(self, trainer) -> None:
        """Called once the trainer is built, before the first step: work the objective needs from the model and data
        (DPO's cached reference pass, or its frozen reference copy). Optional."""


class LanguageModeling:
    """Next-token cross-entropy over every labelled token (labels equal to IGNORE take none). With
    ``fused_loss`` the model computes it inside its forward, never materializing the logits."""

    console: tuple = ()  # the console line's own fields (loom.metrics.logger.ConsoleField): none beyond the loss
    panels: tuple = ()  # `loom report`'s panels of this method (loom.metrics.report.PANELS' form): the common ones

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

    def step_stats(self) -> dict[str, torch.Tensor]:
        return {}

    def prepare(self, trainer) -> None:
        pass


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its labelled tokens, fp32 (N,), and their count (N,). logits: (N, S, V)
    (or vocab-sharded under loss parallel); labels: (N, S), IGNORE where a token is not the completion's."""
    n, s = labels.shape
    nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none")
    return -to_local_loss(nll).view(n, s).sum(dim=1), (labels != IGNORE).sum(dim=1)


class DirectPreference:
    """DPO over micro-batches of pairs (loom.data.dpo: rows chosen 0..B-1, then rejected 0..B-1). Per pair, the
    policy's and the reference's summed log-probabilities of the chosen (pc, rc) and rejected (pr, rr) completions
    give the loss, as TRL's DPOTrainer computes it: 'sigmoid' -log sigmoid(beta ((pc - rc) - (pr - rr))); 'ipo'
    (((pc - rc) / |chosen| - (pr - rr) / |rejected|) - 1 / (2 beta))^2, log-ratios averaged over each completion's
    tokens. The count is pairs, so a step's loss is the mean over the global batch's pairs whatever the layout.

    ``reference``: 'cached' = the micro-batch's ``ref_logps`` (the initial model's, computed before the first step);
    'adapters_off' = the policy itself with its LoRA adapters off, under no_grad; 'copy' = a frozen copy of the
    initial policy (``reference_model``, built by ``prepare`` in the policy's layout), under no_grad."""

    loss_in_forward = True  # the loss needs the reference beside the logits: forward returns it
    STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy")

    # the console line's fields (loom.metrics.logger.ConsoleField) and `loom report`'s panels of this method
    console = (("val acc", "val_rewards/accuracy", ".3f"), ("acc", "rewards/accuracy", ".3f"),
               ("margin", "rewards/margins", ".3f"))
    panels = (("preference accuracy", ("rewards/accuracy", "val_rewards/accuracy"), "chosen above rejected"),
              ("implicit rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins"), "beta x log-ratio"))

    def __init__(self, beta: float, loss: str = "sigmoid", reference: str = "cached"):
        self.beta, self.kind, self.reference = beta, loss, reference
        self._stats: dict[str, torch.Tensor] = {}
        self.reference_model: torch.nn.Module | None = None  # dpo.reference copy: set by prepare

    def count(self, mb: MicroBatch) -> torch.Tensor:
        return torch.tensor(mb.inputs.shape[0] // 2, device=mb.inputs.device)

    def prepare(self, trainer) -> None:
        """dpo.reference cached: the initial model's log-probabilities of every pair (training and validation), from
        one no-grad pass before the first step (the model before any checkpoint is loaded), kept in the run dir and
        read back by later runs in it (a resume); the loader hands them out with each micro-batch. Each pair is
        computed on one data-parallel rank, and a sum over the ranks gives every rank all of them. dpo.reference
        copy: the frozen copy of the initial policy (``frozen_copy``)."""
        cfg, loader = trainer.cfg, trainer.loader
        if self.reference == "copy":
            self.reference_model = frozen_copy(trainer)
            return
        if self.reference != "cached" or not hasattr(loader, "reference"):
            return
        src, device = loader.source, trainer.device
        # keyed by the initial weights' content, not their path: another model exported to the same folder (the
        # usual workflow) is another reference
        weights = trainer.env.share_from_main(
            [content_fingerprint(p) if p and os.path.exists(p) else "" for p in (cfg.model.init_from,
                                                                             cfg.lora.init_from)]
            if trainer.env.is_main else None)
        key = hashlib.blake2b(repr((os.path.abspath(src.tokens.path), src.seq_len, cfg.run.seed, cfg.model.flavor,
                                    cfg.model.init_from, cfg.model.n_layers, cfg.model.vocab_size, cfg.lora.rank,
                                    cfg.lora.init_from, weights)).encode(), digest_size=8).hexdigest()
        path = os.path.join(trainer.run_dir, "dpo_reference", f"reference-{key}.pt")
        ref = torch.load(path) if os.path.isfile(path) else None
        if ref is not None and ref.shape == (len(src.kept), 2) and trainer.env.is_main:
            print(f"dpo.reference cached: reusing {path} (computed for the same initial weights, by content, and "
                  "the same pairs)", flush=True)
        if ref is None or ref.shape != (len(src.kept), 2):
            ref = torch.zeros(len(src.kept), 2, device=device)
            steps = trainer.steps
            for part in trainer.parts:
                part.eval()
            with torch.no_grad(), loss_parallel_context(steps.ctx.loss_parallel):
                for mb, ids in loader.reference_batches():
                    mb = trainer._local_tokens(mb)
                    with trainer._autocast():
                        logps = self.logps(steps.module, mb, steps.ctx.positions(mb))[0]
                    mine = ids >= 0
                    ref[ids[mine].to(device)] = logps.view(2, -1).T[mine.to(device)].float()
            for part in trainer.parts:
                part.train()
            ref = trainer.dims.data_sum(ref).cpu()  # every pair computed on exactly one data-parallel rank
            if trainer.env.is_main:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                try:
                    torch.save(ref, path + ".tmp")
                    os.replace(path + ".tmp", path)
                except (OSError, RuntimeError) as err:  # torch.save wraps a full disk in a RuntimeError
                    if os.path.exists(path + ".tmp"):
                        os.remove(path + ".tmp")
                    raise UserError(f"dpo.reference cached: writing {path} failed ({err}): it needs about "
                                    f"{ref.numel() * ref.element_size():,} bytes; nothing partial was kept") from None
            trainer.env.barrier()
        loader.reference = ref

    def logps(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probability sums (2B,), completion token counts (2B,)) of the micro-batch's rows under ``model``."""
        return sequence_logps(model(mb.inputs, positions), mb.labels)

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        if self.reference == "adapters_off":
            with torch.no_grad(), adapters_disabled(model):
                ref = self.logps(model, mb, positions)[0]
        elif self.reference == "copy":
            assert self.reference_model is not None, "dpo.reference copy: prepare(trainer) builds the reference model"
            with torch.no_grad():
                ref = self.logps(self.reference_model, mb, positions)[0]
            release_gathered(self.reference_model)
        else:
            ref = mb.ref_logps
            assert ref is not None, "dpo.reference cached: the loader hands out no reference log-probabilities"
        policy, counts = self.logps(model, mb, positions)
        return self.pair_loss(policy, ref.to(policy.dtype), counts)

    def pair_loss(self, policy: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The summed loss of the pairs from rows' log-probabilities (2B,) of the policy and the reference and their
        completion token counts; accumulates the reward statistics."""
        chosen, rejected = (policy - ref).chunk(2)  # log-ratios (B,) each
        if self.kind == "ipo":
            n_chosen, n_rejected = counts.to(policy.dtype).clamp(min=1).chunk(2)
            losses = (chosen / n_chosen - rejected / n_rejected - 1 / (2 * self.beta)) ** 2
        else:
            losses = -F.logsigmoid(self.beta * (chosen - rejected))
        with torch.no_grad():
            r_chosen, r_rejected = self.beta * chosen.detach(), self.beta * rejected.detach()
            for name, value in zip(self.STATS, (r_chosen, r_rejected, r_chosen - r_rejected,
                                                (r_chosen > r_rejected).to(policy.dtype))):
                self._stats[name] = self._stats.get(name, 0) + value.sum()
        return losses.sum()

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("DPO computes its loss in forward (a pipeline stage cannot: refused by the config)")

    def step_stats(self) -> dict[str, torch.Tensor]:
        stats, self._stats = self._stats, {}
        return stats


def frozen_copy(trainer) -> torch.nn.Module:
    """A frozen copy of the trainer's model as it is now (the initial policy: called before any checkpoint is loaded
    or step taken), parallelized in the policy's layout (TP and FSDP2 shard it as the policy's parameters are, so the
    copy's shards are the policy's), with no gradients and no optimizer state. Built as the policy is, then its
    parameters and buffers copied from the policy's; no activation checkpointing (nothing runs backward through it)
    and no DDP wrapper (nothing to reduce: every data-parallel rank holds the same weights)."""
    from loom.models.common.init import canonical_name
    from loom.models.registry import build_model
    from loom.parallel.parallelize import parallelize_llama

    cfg, (policy,) = trainer.cfg, trainer.parts  # one part: pipeline parallelism is refused under dpo
    with torch.device("meta"):
        model = build_model(trainer.model_args)
    training = replace(cfg.training, activation_checkpointing="none")
    (ref,) = parallelize_llama(model, trainer.dims, training, cfg.parallel, trainer.device, cfg.run.seed).parts
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    with torch.no_grad():
        for named in ("named_parameters", "named_buffers"):
            mine = {canonical_name(n): t for n, t in getattr(policy, named)()}
            theirs = {canonical_name(n): t for n, t in getattr(ref, named)()}
            assert mine.keys() == theirs.keys(), sorted(mine.keys() ^ theirs.keys())
            for name, t in theirs.items():
                local(t).copy_(local(mine[name]))
    ref.requires_grad_(False)
    return ref.eval()


def release_gathered(model: torch.nn.Module) -> None:
    """Free the parameters FSDP2 keeps gathered after a forward (the root's, and every block's under
    parallel.reshard_after_forward false): they wait for a backward that a frozen model never runs."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def build_objective(name: str, fused_loss: bool, dpo=None, reward=None) -> Objective:
    """The objective ``training.objective`` names. 'sft' is language modeling as well: its loader labels every
    token outside the assistant's turns IGNORE, and the count of labelled tokens is already the count of assistant
    targets, so the step's loss is their summed loss over the global count of them, whatever the layout. 'dpo'
    takes the [dpo] section (``dpo``; its defaults when None); 'reward' the [reward] section (loom.train.reward)."""
    if name == "dpo":
        return DirectPreference(dpo.beta, dpo.loss, dpo.reference) if dpo is not None else DirectPreference(0.1)
    if name == "reward":
        from loom.train.reward import RewardModeling

        return RewardModeling(reward.center_coefficient if reward is not None else 0.0)
    objectives = {"lm": LanguageModeling, "sft": LanguageModeling}
    return objectives[name](fused_loss)
