"""AdamW step as a ``torch.library`` custom op: ``loom::adamw_step_`` (in place on param and moments).

The Triton kernel runs where Triton does (CUDA, or CPU under TRITON_INTERPRET=1); elsewhere the reference.
"""

from __future__ import annotations

import torch

from loom.kernels.adamw import reference
from loom.kernels.triton_support import triton_runs_on

# elements below which an optimizer steps a tensor in the multi-tensor launch (``adamw_multi_step_``): a launch from
# Python costs tens of microseconds, the time a ~3 TB/s GPU takes to step about 4M fp32 parameters (28 bytes each)
SMALL = 1 << 22


@torch.library.custom_op("loom::adamw_step_", mutates_args=("param", "exp_avg", "exp_avg_sq", "amax"))
def adamw_step_op(
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
    amax: torch.Tensor | None,
) -> None:
    # amax has no default: torch 2.11's in-place bookkeeping indexes the mutated arguments among those passed, so a
    # defaulted one left out raises IndexError there (2.13 fills the defaults first)
    args = (param, grad, exp_avg, exp_avg_sq, grad_factor, lr, beta1, beta2, eps, weight_decay, step, amax)
    if triton_runs_on(param.device):
        from loom.kernels.adamw import triton as kernels

        kernels.adamw_step(*args)
        return
    reference.adamw_step_(*args)


@adamw_step_op.register_fake
def _(param, grad, exp_avg, exp_avg_sq, grad_factor, lr, beta1, beta2, eps, weight_decay, step, amax):
    return None


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_factor: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> None:
    """One AdamW step on one tensor, in place (``torch.optim.AdamW``'s math; ``step`` counts from 1);
    the gradient is multiplied by ``grad_factor`` (a one-element fp32 tensor) first when given, and a
    ``grad_factor`` that is not finite skips the step. ``amax`` (a one-element fp32 tensor): raised to the
    largest |param| after the step, in the same pass (float8's weight scale needs it: no second read of the
    weights)."""
    if not (param.shape == grad.shape == exp_avg.shape == exp_avg_sq.shape):
        raise ValueError(
            f"adamw_step_: param {tuple(param.shape)}, grad {tuple(grad.shape)}, exp_avg "
            f"{tuple(exp_avg.shape)}, exp_avg_sq {tuple(exp_avg_sq.shape)} must have one shape"
        )
    adamw_step_op(
        param, grad, exp_avg, exp_avg_sq, grad_factor, lr, beta1, beta2, eps, weight_decay, step, amax
    )


def _launch_multi(params, grads, exp_avgs, exp_avg_sqs, grad_factor, *hyper) -> bool:
    """The multi-tensor Triton launch where Triton runs on the lists' device; False where it does not."""
    if not params or not triton_runs_on(params[0].device):
        return False
    from loom.kernels.adamw import triton as kernels

    kernels.adamw_multi_step(params, grads, exp_avgs, exp_avg_sqs, grad_factor, *hyper)
    return True


@torch.library.custom_op("loom::adamw_multi_step_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def adamw_multi_step_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    grad_factor: torch.Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    if _launch_multi(
        params, grads, exp_avgs, exp_avg_sqs, grad_factor, lr, beta1, beta2, eps, weight_decay, step
    ):
        return
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        reference.adamw_step_(p, g, m, v, grad_factor, lr, beta1, beta2, eps, weight_decay, step)


@adamw_multi_step_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, grad_factor, lr, beta1, beta2, eps, weight_decay, step):
    return None


def adamw_multi_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_factor: torch.Tensor | None = None,
) -> None:
    """``adamw_step_`` on each index of the lists (one step count for all), in one launch where Triton runs: many
    small tensors cost one launch instead of one each. Outside torch.compile the launcher is called directly: the
    custom op's dispatch of four lists of ~110 tensors took 0.2 ms of host time a step, as long as a 125M model's
    step on the GPU (the op is what a compiled graph records)."""
    args = (params, grads, exp_avgs, exp_avg_sqs, grad_factor, lr, beta1, beta2, eps, weight_decay, step)
    if not torch.compiler.is_compiling() and _launch_multi(*args):
        return
    adamw_multi_step_op(*args)
