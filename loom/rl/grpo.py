"""GRPO's math as plain functions on tensors: group-normalized advantages, the clipped importance-ratio token loss,
the k3 estimator of the KL to a reference, and the loss normalizations, as TRL's GRPOTrainer computes them (its
``scale_rewards``, ``epsilon`` / ``epsilon_high``, ``beta`` and ``loss_type``). tests/unit/test_grpo.py checks them
against TRL's own code.

Every reduction here returns a SUM and the COUNT it is to be divided by, never a mean: a training step divides the
sum over its whole global batch by the global count (loom.train.objective), so the loss does not depend on how the
rollouts are split over ranks and micro-batches. The normalizations (``loss_type``):

- ``grpo``: each completion's token losses averaged over its own length, then averaged over completions (the count
  is completions). Short completions weigh more per token than long ones.
- ``bnpo`` / ``dapo``: every completion token of the batch weighs the same (the count is completion tokens). TRL's
  ``bnpo`` divides by each process's micro-batch's tokens and ``dapo`` by the global batch's; with loom's global
  count the two are the same loss.
- ``dr_grpo``: token losses summed and divided by completions x ``max_completion_length`` (Dr. GRPO): no length
  bias, a constant denominator.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # added to the std before dividing, as TRL does (a group of equal rewards gets advantages 0)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", batch_std: torch.Tensor | None = None
) -> torch.Tensor:
    """Advantages of rewards (N,) laid out as N / group_size groups of consecutive completions of one prompt: each
    reward minus its group's mean, divided (``scale``) by its group's std ('group'), by the std of all N rewards
    ('batch'; ``batch_std`` overrides it with the global batch's when the rollouts are spread over ranks) or by
    nothing ('none'). Stds are unbiased (Bessel), as TRL's. -> (N,) fp32."""
    rewards = rewards.float()
    groups = rewards.view(-1, group_size)  # (P, G)
    centred = (groups - groups.mean(dim=1, keepdim=True)).view(-1)  # (N,)
    if scale == "none":
        return centred
    if scale == "group":
        std = groups.std(dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
    elif scale == "batch":
        std = (
            batch_std
            if batch_std is not None
            else (rewards.std() if rewards.numel() > 1 else rewards.new_zeros(()))
        )
        std = std.expand_as(rewards)
    else:
        raise ValueError(f"scale_rewards {scale!r}: allowed {SCALE_REWARDS}")
    return centred / (std + STD_EPS)


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: exp(r - p) - (r - p) - 1 >= 0, unbiased and
    low-variance for samples drawn from the policy. (B, T) -> (B, T)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, plus beta x KL to the reference (skipped when beta is 0):
    -min(ratio A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) A) with ratio = exp(logp - old_logp), the
    surrogate times ``is_weight`` (B, T) where given (off-policy samples' truncated importance weights, before the
    KL term: TRL's order). logps / old_logps / ref_logps (B, T) fp32, advantages (B,). Returns (loss (B, T), kl (B, T) or None, clipped
    low (B, T) bool, clipped high (B, T) bool): where the ratio left the trust region in the direction the
    advantage pushes it (TRL's clip_ratio/low and /high)."""
    adv = advantages[:, None]  # (B, 1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * adv, clipped * adv)
    if is_weight is not None:
        loss = loss * is_weight
    kl = None
    if beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probabilities"
        kl = kl_k3(logps, ref_logps)
        loss = loss + beta * kl
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
    return loss, kl, low, high


def loss_sum(losses: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The summed loss of a micro-batch under ``loss_type`` (see the module's docstring); the step divides it by the
    global ``loss_count``. losses (B, T), mask (B, T) 1 on completion tokens -> () fp32."""
    masked = losses * mask
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()
    if loss_type in ("bnpo", "dapo", "dr_grpo"):
        return masked.sum()
    raise ValueError(f"loss_type {loss_type!r}: allowed {LOSS_TYPES}")


def loss_count(mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """What ``loss_sum`` of these rows is divided by (summed over the global batch): completions ('grpo'),
    completion tokens ('bnpo', 'dapo'), completions x max_completion_length ('dr_grpo'). mask (B, T) -> () fp32."""
    rows = torch.tensor(float(mask.shape[0]), device=mask.device)
    if loss_type == "grpo":
        return rows
    if loss_type in ("bnpo", "dapo"):
        return mask.sum().float()
    if loss_type == "dr_grpo":
        return rows * max_completion_length
    raise ValueError(f"loss_type {loss_type!r}: allowed {LOSS_TYPES}")


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    max_completion_length: int,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """The mean loss of one whole batch (``loss_sum`` / ``loss_count``): what TRL's ``_compute_loss`` returns for
    one process without accumulation. For tests and single-batch use; training divides by the global count."""
    losses = token_losses(logps, old_logps, advantages, epsilon_low, epsilon_high, ref_logps, beta)[0]
    return loss_sum(losses, mask, loss_type) / loss_count(mask, loss_type, max_completion_length).clamp(min=1)
