"""PPO's math as plain functions on tensors: per-token rewards (the sequence's score on its last token, less a KL
penalty to the reference per token), generalized advantage estimation, masked whitening, and the clipped policy and
value losses, as TRL's PPOTrainer computes them (its ``kl_coef`` / ``kl_estimator``, ``gamma`` / ``lam``,
``whiten_rewards``, ``cliprange`` / ``cliprange_value`` / ``vf_coef``). tests/unit/test_ppo.py checks them against
TRL's code and GAE against a direct loop.

Every per-token tensor is (B, T) with a mask (B, T) that is 1 on a completion's tokens, which are contiguous in
each row; position t's value is the value head's output at the position that predicts token t (the state before
it is emitted). After a completion's last token the episode ends: the next value is 0. (TRL places the score one
position past the last token and keeps that position's value; here the last token takes the score, the usual
episodic form: the two agree on the same masks, rewards and values.)

The losses return per-token tensors; the objective sums them over a micro-batch and the step divides by the global
count of completion tokens, so a step does not depend on the layout (TRL's ``masked_mean`` over one batch)."""

from __future__ import annotations

import torch

from loom.rl.grpo import kl_k3

KL_ESTIMATORS = ("k1", "k3")
WHITEN_EPS = 1e-8  # added to the variance before the inverse square root, as TRL's masked_whiten


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) on the policy's samples: 'k1' = logp - ref_logp (unbiased,
    signed), 'k3' = exp(ref - logp) - (ref - logp) - 1 (>= 0, lower variance). (B, T) -> (B, T)."""
    if estimator == "k1":
        return logps - ref_logps
    if estimator == "k3":
        return kl_k3(logps, ref_logps)
    raise ValueError(f"kl_estimator {estimator!r}: allowed {KL_ESTIMATORS}")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Each row's last masked position (B,): mask (B, T) with at least one 1 per row."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, -1).max(dim=1).values


def token_rewards(
    scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards (B, T) fp32: -kl_coef x kl on every completion token (none without ``kl``), plus each
    completion's score (B,) on its last token; 0 off the mask."""
    mask = mask.float()
    rewards = torch.zeros_like(mask) if kl is None else -kl_coef * kl.float() * mask
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last_token_index(mask)] += scores.float()
    return rewards * mask


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum()


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the masked entries (var unbiased, as TRL's masked_whiten); with
    ``shift_mean`` false the mean is added back (rewards keep their sign). Entries off the mask are set to 0."""
    mask = mask.float()
    mean = masked_mean(values, mask)
    n = mask.sum()
    var = masked_mean((values - mean) ** 2, mask) * n / (n - 1).clamp(min=1)
    out = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return out * mask


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each row's completion tokens: delta_t = r_t + gamma V_{t+1} - V_t
    (V after the last token is 0), A_t = delta_t + gamma lam A_{t+1}; returns R_t = A_t + V_t. rewards / values /
    mask (B, T) -> (advantages (B, T), returns (B, T)) fp32, 0 off the mask."""
    mask = mask.float()
    rewards, values = rewards.float() * mask, values.float() * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # off the mask (padding after a completion, or its prompt) the recursion restarts: nothing flows across
        last = (delta + gamma * lam * last) * mask[:, t]
        advantages[:, t] = last
    return advantages, (advantages + values) * mask


def policy_losses(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: max(-A r, -A clip(r, 1 - c, 1 + c)) with r = exp(logp - old_logp).
    logps / old_logps / advantages (B, T) -> (loss (B, T), clipped (B, T) bool: the clipped term is the larger)."""
    ratio = torch.exp(logps - old_logps)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return torch.max(unclipped, clipped), (clipped > unclipped).detach()


def value_losses(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).
    (B, T) -> (loss (B, T), clipped (B, T) bool: the clipped term is the larger)."""
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.max(unclipped, clipped), (clipped > unclipped).detach()


def ppo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    cliprange_value: float,
    vf_coef: float,
) -> torch.Tensor:
    """The mean loss of one batch, policy + vf_coef x value, each a mean over the completion tokens: what TRL's
    PPOTrainer minimizes per mini-batch. For tests and single-batch use; training divides by the global count."""
    mask = mask.float()
    pg = policy_losses(logps, old_logps, advantages, cliprange)[0]
    vf = value_losses(values, old_values, returns, cliprange_value)[0]
    return masked_mean(pg + vf_coef * vf, mask)
