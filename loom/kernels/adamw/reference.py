"""One AdamW step on one tensor in plain PyTorch: the definition the Triton kernel is tested against,
and what CPU runs execute.

The math and the order of operations of ``torch.optim.AdamW``'s single-tensor path (decoupled weight
decay first, then the moments, then the bias-corrected update), with the gradient optionally multiplied
by ``grad_factor`` first (clipping folded into the step). A ``grad_factor`` that is not finite skips the
step, leaving every tensor as it was (the Triton kernel masks its stores; here the host checks)."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad_factor: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    amax: torch.Tensor | None = None,
) -> None:
    """Updates ``param``, ``exp_avg`` and ``exp_avg_sq`` in place; ``step`` counts from 1. ``amax`` (one element):
    raised to the largest |param| after the step."""
    _step(param, grad, exp_avg, exp_avg_sq, grad_factor, lr, beta1, beta2, eps, weight_decay, step)
    if amax is not None and param.numel():
        torch.maximum(amax, param.abs().amax().reshape(amax.shape).to(amax.dtype), out=amax)


def _step(param, grad, exp_avg, exp_avg_sq, grad_factor, lr, beta1, beta2, eps, weight_decay, step) -> None:
    if grad_factor is not None and not bool(torch.isfinite(grad_factor).all()):
        return
    g = grad.to(param.dtype)
    if grad_factor is not None:
        g = g * grad_factor.to(param.dtype)
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
