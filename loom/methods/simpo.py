"""Simple preference optimization (``training.objective simpo``): a length-normalised reward margin with a target
gamma, no reference model (TRL's CPOTrainer with loss_type 'simpo', its cpo_alpha NLL term); preference pairs
(loom.data.dpo); its rules; its run (the loop)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.config.sections import APPLIED, Config, opt
from loom.methods.base import Method
from loom.methods.policy_pairs import PolicyPairs, reference_free_rules


@dataclass
class SimpoConfig:
    """SimPO (training.objective simpo; docs/finetuning.md): TRL's CPOTrainer with loss_type 'simpo'."""

    beta: float = opt(
        2.0,
        "the scale of the length-normalised reward: rewards are beta x a completion's mean "
        "token log-probability",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, "the loss and rewards from the next step"),
    )
    gamma: float = opt(
        0.5,
        "the target reward margin (TRL's simpo_gamma): the loss is -log sigmoid(beta x margin - gamma)",
        min=0.0,
        resume=(APPLIED, "the loss from the next step"),
    )
    cpo_alpha: float = opt(
        0.0,
        "the weight of the chosen completions' NLL added to the loss (TRL's cpo_alpha; 0 = SimPO "
        "as published, TRL's CPOConfig defaults to 1.0)",
        min=0.0,
        resume=(APPLIED, "the loss from the next step"),
    )


# the config sections this method declares (its line in loom.config.methods.METHODS names them)
SECTIONS = {"simpo": SimpoConfig}


def simpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    """Per pair (B,), from mean log-probabilities: -log sigmoid(beta x (chosen - rejected) - gamma), as TRL's
    cpo_loss with loss_type 'simpo' (no label smoothing)."""
    return -F.logsigmoid(beta * ((chosen - rejected) - gamma / beta))


class SimplePreference(PolicyPairs):
    """SimPO: per pair -log sigmoid(beta x margin of mean log-probabilities - gamma), plus ``cpo_alpha`` x the
    chosen completions' NLL token-averaged over the global batch (TRL's CPO behaviour-cloning term; 0 = SimPO as
    published). Rewards are beta x mean log-probabilities, as TRL logs them."""

    def __init__(self, beta: float, gamma: float, cpo_alpha: float):
        super().__init__(beta, cpo_alpha)
        self.gamma = gamma

    def pair_losses(self, chosen, rejected):
        return simpo_losses(chosen, rejected, self.beta, self.gamma), {}


def objective(cfg: Config) -> SimplePreference:
    return SimplePreference(cfg.simpo.beta, cfg.simpo.gamma, cfg.simpo.cpo_alpha)


def rules(cfg: Config) -> None:
    reference_free_rules(cfg, "simpo")


METHOD = Method("simpo", SimplePreference, objective, rules=rules)
