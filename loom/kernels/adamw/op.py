"""AdamW step as ``torch.library`` custom ops: ``loom::adamw_step_`` (in place on param and moments) and
``loom::adamw_step_multi_`` (many tensors, one launch).

The Triton kernel runs where Triton does (CUDA, or CPU under TRITON_INTERPRET=1); elsewhere the reference.
"""

from __future__ import annotations

import torch

from loom.kernels.adamw import reference
from loom.kernels.triton_support import triton_runs_on


@torch.library.custom_op("loom::adamw_step_", mutates_args=("param", "exp_avg", "exp_avg_sq"))
def adamw_step_op(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  grad_factor: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, step: int) -> None:
    if triton_runs_on(param.device):
        from loom.kernels.adamw import triton as kernels

        kernels.adamw_step(param, grad, exp_avg, exp_avg_sq, grad_factor, lr, beta1, beta2, eps, weight_decay, step)
        return
    reference.adamw_step_(param, grad, exp_avg, exp_avg_sq, grad_factor, lr, beta1, beta2, eps, weight_decay, step)


@adamw_step_op.register_fake
def _(param, grad, exp_avg, exp_avg_sq, grad_factor, lr, beta1, beta2, eps, weight_decay, step):
    return None


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                grad_factor: torch.Tensor | None = None) -> None:
    """One AdamW step on one tensor, in place (``torch.optim.AdamW``'s math; ``step`` counts from 1);
    the gradient is multiplied by ``grad_factor`` (a one-element fp32 tensor) first when given, and a
    ``grad_factor`` that is not finite skips the step."""
    if not (param.shape == grad.shape == exp_avg.shape == exp_avg_sq.shape):
        raise ValueError(f"adamw_step_: param {tuple(param.shape)}, grad {tuple(grad.shape)}, exp_avg "
                         f"{tuple(exp_avg.shape)}, exp_avg_sq {tuple(exp_avg_sq.shape)} must have one shape")
    adamw_step_op(param, grad, exp_avg, exp_avg_sq, grad_factor, lr, beta1, beta2, eps, weight_decay, step)


@torch.library.custom_op("loom::adamw_step_multi_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def adamw_step_multi_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                        exp_avg_sqs: list[torch.Tensor], grad_factor: torch.Tensor | None, lrs: list[float],
                        weight_decays: list[float], steps: list[int], beta1: float, beta2: float, eps: float) -> None:
    if params and triton_runs_on(params[0].device):
        from loom.kernels.adamw import triton as kernels

        kernels.adamw_step_multi(params, grads, exp_avgs, exp_avg_sqs, grad_factor, lrs, weight_decays, steps, beta1,
                                 beta2, eps)
        return
    for p, g, m, v, lr, wd, step in zip(params, grads, exp_avgs, exp_avg_sqs, lrs, weight_decays, steps, strict=True):
        reference.adamw_step_(p, g, m, v, grad_factor, lr, beta1, beta2, eps, wd, step)


@adamw_step_multi_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, grad_factor, lrs, weight_decays, steps, beta1, beta2, eps):
    return None


def adamw_step_multi_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], *, lrs: list[float], weight_decays: list[float],
                      steps: list[int], beta1: float, beta2: float, eps: float,
                      grad_factor: torch.Tensor | None = None) -> None:
    """``adamw_step_`` on many tensors at once (one launch on a GPU: one device and one gradient dtype per call);
    ``lrs``, ``weight_decays`` and ``steps`` per tensor."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, lrs, weight_decays, steps)
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"adamw_step_multi_: lists of different lengths {[len(x) for x in lists]}")
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not (p.shape == g.shape == m.shape == v.shape):
            raise ValueError(f"adamw_step_multi_: tensor {i}: param {tuple(p.shape)}, grad {tuple(g.shape)}, "
                             f"exp_avg {tuple(m.shape)}, exp_avg_sq {tuple(v.shape)} must have one shape")
    adamw_step_multi_op(params, grads, exp_avgs, exp_avg_sqs, grad_factor, [float(x) for x in lrs],
                        [float(x) for x in weight_decays], [int(x) for x in steps], beta1, beta2, eps)
