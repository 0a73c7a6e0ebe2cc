"""Simple preference optimization (``training.objective simpo``): a length-normalised reward margin with a target
gamma, no reference model (TRL's CPOTrainer with loss_type 'simpo', its cpo_alpha NLL term); preference pairs
(loom.data.dpo); its rules; its run (the loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.config.sections import Config
from loom.methods.base import Method
from loom.methods.policy_pairs import PolicyPairs, reference_free_rules


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
