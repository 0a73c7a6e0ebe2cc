"""``loom::lora_linear``: a frozen linear plus its LoRA adapter as one ``torch.library`` op (with a fake and its
backward op), so that torch.compile keeps the fused product (``reference.py``) instead of tracing through it.
The matmuls are cuBLAS / aten in the input dtype."""

from __future__ import annotations

import torch

from loom.kernels.lora import reference


@torch.library.custom_op("loom::lora_linear", mutates_args=())
def lora_linear_op(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(x.device.type, enabled=False):  # the caller cast for autocast
        return reference.lora_linear(x, w, a, b, scaling)


@lora_linear_op.register_fake
def _(x, w, a, b, scaling):
    return x.new_empty(x.shape[0], w.shape[0]), x.new_empty(x.shape[0], a.shape[0])


@torch.library.custom_op("loom::lora_linear_backward", mutates_args=())
def lora_linear_backward_op(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                            u: torch.Tensor, scaling: float,
                            input_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.autocast(g.device.type, enabled=False):
        return reference.lora_linear_backward(g.contiguous(), x, w, a, b, u, scaling, input_grad)


@lora_linear_backward_op.register_fake
def _(g, x, w, a, b, u, scaling, input_grad):
    dx = x.new_empty(x.shape) if input_grad else x.new_empty(0)
    return dx, a.new_empty(a.shape), b.new_empty(b.shape)


def _setup_context(ctx, inputs, output):
    x, w, a, b, scaling = inputs
    ctx.save_for_backward(x, w, a, b, output[1])
    ctx.scaling = scaling


def _backward(ctx, grad_y, _grad_u):
    x, w, a, b, u = ctx.saved_tensors
    dx, da, db = lora_linear_backward_op(grad_y, x, w, a, b, u, ctx.scaling, ctx.needs_input_grad[0])
    return dx if ctx.needs_input_grad[0] else None, None, da, db, None


lora_linear_op.register_autograd(_backward, setup_context=_setup_context)


def lora_linear(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """x (..., in) @ w (out, in)^T + scaling * (x @ a (r, in)^T) @ b (out, r)^T for a frozen ``w`` (no gradient);
    under autocast every operand is cast to its dtype first, as ``F.linear`` would."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, w, a, b = (t.to(dtype) for t in (x, w, a, b))
    y, _ = lora_linear_op(x.reshape(-1, x.shape[-1]), w, a, b, scaling)
    return y.view(*x.shape[:-1], w.shape[0])
