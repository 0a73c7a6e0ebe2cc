"""Odds-ratio preference optimization (``training.objective orpo``): the SFT loss on the chosen completions plus an
odds-ratio term, no reference model (TRL's ORPOTrainer); preference pairs (loom.data.dpo); its rules; its run (the
loop)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.config.sections import APPLIED, Config, opt
from loom.methods.base import Method
from loom.methods.policy_pairs import PolicyPairs, reference_free_rules


@dataclass
class OrpoConfig:
    """Odds-ratio preference optimization (training.objective orpo; docs/finetuning.md): TRL's ORPOTrainer."""

    beta: float = opt(
        0.1,
        "the odds-ratio term's weight beside the chosen completions' NLL (the paper's lambda, TRL's beta)",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, "the loss from the next step"),
    )


# the config sections this method declares (its line in loom.config.methods.METHODS names them)
SECTIONS = {"orpo": OrpoConfig}


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair (B,), from mean log-probabilities of the chosen and rejected completions: (the loss -beta x log
    sigmoid(log odds ratio), log sigmoid(log odds ratio), the log odds ratio), as TRL's odds_ratio_loss."""
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    return -beta * ratio, ratio, log_odds


class OddsRatioPreference(PolicyPairs):
    """ORPO: per pair -beta x log sigmoid(log odds(chosen) - log odds(rejected)) on mean log-probabilities, plus
    the chosen rows' NLL over prompt and completion tokens (TRL computes it so), token-averaged over the global
    batch. Rewards are beta x mean log-probabilities, as TRL logs them."""

    STATS = PolicyPairs.STATS + ("log_odds_ratio", "log_odds_chosen")
    nll_prompt = True

    def pair_losses(self, chosen, rejected):
        losses, ratio, log_odds = orpo_losses(chosen, rejected, self.beta)
        return losses, {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}


def objective(cfg: Config) -> OddsRatioPreference:
    return OddsRatioPreference(cfg.orpo.beta, 1.0)


def rules(cfg: Config) -> None:
    reference_free_rules(cfg, "orpo")


METHOD = Method("orpo", OddsRatioPreference, objective, rules=rules)
