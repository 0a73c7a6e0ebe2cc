"""RMSNorm as ``torch.library`` custom ops: ``loom::rms_norm`` and ``loom::rms_norm_backward``.

The Triton kernels run where Triton does (CUDA, or CPU under TRITON_INTERPRET=1); elsewhere the
reference. Fake implementations let ``torch.compile`` trace through (the op stays one opaque node);
the autograd formula is the backward op, which recomputes the row statistics instead of saving them
(x is read there anyway), so only x and the weight are kept for backward.
"""

from __future__ import annotations

import torch

from loom.kernels.rmsnorm import reference
from loom.kernels.triton_support import triton_runs_on


@torch.library.custom_op("loom::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = x.contiguous(), weight.contiguous()  # outputs are contiguous on every path
    if triton_runs_on(x.device):
        from loom.kernels.rmsnorm import triton as kernels

        return kernels.rms_norm_forward(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("loom::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    grad, x, weight = grad.contiguous(), x.contiguous(), weight.contiguous()
    if triton_runs_on(x.device):
        from loom.kernels.rmsnorm import triton as kernels

        return kernels.rms_norm_backward(grad, x, weight, eps)
    return reference.rms_norm_backward(grad, x, weight, eps)


@rms_norm_backward_op.register_fake
def _(grad, x, weight, eps):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(grad, x, weight, ctx.eps)
    return (dx if ctx.needs_input_grad[0] else None, dweight if ctx.needs_input_grad[1] else None, None)


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., N); weight: (N,). RMSNorm over the last dim, fp32 statistics; returns (..., N) in x's dtype."""
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    return rms_norm_op(x, weight, float(eps))
