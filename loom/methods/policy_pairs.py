"""Preference pairs without a reference model (ORPO, SimPO): the policy's per-token mean log-probabilities of the
chosen and rejected completions, plus an NLL term on the chosen rows whose token mean is taken over the whole
global batch (its chosen tokens counted before the step: ``begin``), so a step's loss is the same whatever the
layout. Each method's own loss is a pure function in its module (loom.methods.orpo, loom.methods.simpo)."""

from __future__ import annotations

import torch

from loom.config.errors import ConfigError
from loom.config.sections import Config
from loom.data.loader import MicroBatch
from loom.methods.base import pair_rules
from loom.methods.dpo import sequence_logps
from loom.numerics import IGNORE
from loom.train.objective import Objective


def full_labels(mb: MicroBatch) -> torch.Tensor:
    """Next-token labels over every token of each row, prompt included (TRL's ORPO NLL: labels are the input ids
    wherever the attention mask is 1); IGNORE on padding (loom.data.dpo.pair_batch marks it as document 1)."""
    labels = torch.full_like(mb.inputs, IGNORE)
    labels[:, :-1] = torch.where(mb.document_ids[:, 1:] == 0, mb.inputs[:, 1:], IGNORE)
    return labels


class PolicyPairs(Objective):
    """Pairs (loom.data.dpo: rows chosen 0..B-1, then rejected 0..B-1) scored by the policy alone. A subclass says
    ``pair_losses(chosen, rejected)`` (per pair, from mean log-probabilities) and its NLL term: weight ``nll_weight``,
    over the chosen rows' completion tokens, or prompt and completion with ``nll_prompt``. The count is pairs; the
    NLL's token sum is scaled by global pairs / global chosen tokens (``begin``), so the step's loss is TRL's
    mean(pair losses) + weight x (token-mean NLL) over the global batch."""

    loss_in_forward = True  # the loss needs whole rows' log-probabilities: forward returns it
    data = "dpo"  # preference pairs (loom.data.dpo)
    rows_per_example = 2  # two rows an example (loom.data.dpo: 2 x micro_batch_size)
    nll_prompt = False
    STATS = (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracy",
        "logps/chosen",
        "logps/rejected",
        "nll_loss",
    )
    console = (
        ("val acc", "val_rewards/accuracy", ".3f"),
        ("acc", "rewards/accuracy", ".3f"),
        ("margin", "rewards/margins", ".3f"),
    )
    panels = (
        ("preference accuracy", ("rewards/accuracy", "val_rewards/accuracy"), "chosen above rejected"),
        ("rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins"), "beta x mean log-probability"),
    )

    def __init__(self, beta: float, nll_weight: float):
        self.beta, self.nll_weight = beta, nll_weight
        self._stats: dict[str, torch.Tensor] = {}
        self._per_token = torch.ones(())  # global pairs / global chosen NLL tokens of the step (``begin``)

    def count(self, mb: MicroBatch) -> torch.Tensor:
        return torch.tensor(mb.inputs.shape[0] // 2, device=mb.inputs.device)

    def nll_labels(self, mb: MicroBatch) -> torch.Tensor:
        """The chosen rows' NLL targets (B, S)."""
        b = mb.inputs.shape[0] // 2
        return (full_labels(mb) if self.nll_prompt else mb.labels)[:b]

    def begin(self, mbs: list[MicroBatch], data_sum) -> None:
        """Global pairs / global chosen NLL tokens of the step: the NLL's token mean over the whole global batch."""
        if not mbs:
            return
        device = mbs[0].inputs.device
        local = torch.stack(
            [
                sum(self.count(mb) for mb in mbs).to(torch.float32),
                sum((self.nll_labels(mb) != IGNORE).sum() for mb in mbs).to(torch.float32),
            ]
        ).to(device)
        pairs, tokens = data_sum(local).unbind()
        self._per_token = pairs / tokens.clamp(min=1)

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        logits = model(mb.inputs, positions)
        logps, counts = sequence_logps(logits, mb.labels)
        b = mb.inputs.shape[0] // 2
        if self.nll_weight == 0:
            nll = torch.zeros((), device=logps.device)
        elif self.nll_prompt:
            nll = -sequence_logps(logits[:b], self.nll_labels(mb))[0].sum()
        else:
            nll = -logps[:b].sum()
        return self.pair_loss(logps / counts.clamp(min=1).to(logps.dtype), nll)

    def pair_loss(self, mean_logps: torch.Tensor, nll_sum: torch.Tensor) -> torch.Tensor:
        """The summed loss of the pairs from the rows' mean log-probabilities (2B,) and the chosen rows' summed
        NLL; accumulates the statistics."""
        chosen, rejected = mean_logps.float().chunk(2)
        losses, extra = self.pair_losses(chosen, rejected)
        nll = nll_sum * self._per_token.to(nll_sum.device)  # sums to the token-mean NLL x global pairs
        with torch.no_grad():
            r_chosen, r_rejected = self.beta * chosen.detach(), self.beta * rejected.detach()
            values = {
                "rewards/chosen": r_chosen.sum(),
                "rewards/rejected": r_rejected.sum(),
                "rewards/margins": (r_chosen - r_rejected).sum(),
                "rewards/accuracy": (r_chosen > r_rejected).float().sum(),
                "logps/chosen": chosen.detach().sum(),
                "logps/rejected": rejected.detach().sum(),
                "nll_loss": nll.detach(),
                **{k: v.detach().sum() for k, v in extra.items()},
            }
            for name, value in values.items():
                self._stats[name] = self._stats.get(name, 0) + value
        return losses.sum() + self.nll_weight * nll

    def pair_losses(
        self, chosen: torch.Tensor, rejected: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(per-pair losses (B,), per-pair statistics to log) from mean log-probabilities (B,) each."""
        raise NotImplementedError

    def step_stats(self) -> dict[str, torch.Tensor]:
        stats, self._stats = self._stats, {}
        return stats


def reference_free_rules(cfg: Config, name: str) -> None:
    """Pairs rendered with the chat template; the layouts a pair's loss cannot be split over yet (its
    log-probabilities are summed before the loss: pipeline stages and context-parallel chunks would each hold part);
    the logits are needed (no fused loss)."""
    pair_rules(cfg)
    p = cfg.parallel
    for key, value in (("parallel.pp", p.pp), ("parallel.cp", p.cp)):
        if value > 1:
            raise ConfigError(key, value, f"not supported with training.objective {name} yet: allowed 1")
    if cfg.model.fused_loss == "true":
        raise ConfigError(
            "model.fused_loss",
            True,
            f"training.objective {name} needs the logits (per-token log-probabilities): allowed auto | false",
        )
