"""SwiGLU as ``torch.library`` custom ops: ``loom::swiglu`` and ``loom::swiglu_backward``.

The Triton kernels run where Triton does (CUDA, or CPU under TRITON_INTERPRET=1); elsewhere the
reference. Backward keeps only a and b (the unfused graph also keeps silu(a)).
"""

from __future__ import annotations

import torch

from loom.kernels.swiglu import reference
from loom.kernels.triton_support import triton_runs_on


@torch.library.custom_op("loom::swiglu", mutates_args=())
def swiglu_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    if triton_runs_on(a.device):
        from loom.kernels.swiglu import triton as kernels

        return kernels.swiglu_forward(a, b)
    return reference.swiglu(a, b)


@swiglu_op.register_fake
def _(a, b):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.custom_op("loom::swiglu_backward", mutates_args=())
def swiglu_backward_op(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    grad, a, b = grad.contiguous(), a.contiguous(), b.contiguous()
    if triton_runs_on(a.device):
        from loom.kernels.swiglu import triton as kernels

        return kernels.swiglu_backward(grad, a, b)
    return reference.swiglu_backward(grad, a, b)


@swiglu_backward_op.register_fake
def _(grad, a, b):
    return (
        torch.empty_like(a, memory_format=torch.contiguous_format),
        torch.empty_like(b, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    da, db = swiglu_backward_op(grad, a, b)
    return da if ctx.needs_input_grad[0] else None, db if ctx.needs_input_grad[1] else None


swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for a, b of the same shape and dtype (the gate and up projections of a SwiGLU MLP)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"swiglu: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} must match")
    return swiglu_op(a, b)
