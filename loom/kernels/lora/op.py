"""``loom::lora_linear``: frozen linears that share an input, each plus its LoRA adapter, as one ``torch.library``
op (with a fake and its backward op), so that torch.compile keeps the fused products (``reference.py``) instead of
tracing through them, and one call replaces n. The matmuls are cuBLAS / aten in the input dtype."""

from __future__ import annotations

import torch

from loom.kernels.lora import reference


@torch.library.custom_op("loom::lora_linear", mutates_args=())
def lora_linear_op(
    x: torch.Tensor, ws: list[torch.Tensor], a: list[torch.Tensor], b: list[torch.Tensor], scaling: float
) -> list[torch.Tensor]:
    with torch.autocast(x.device.type, enabled=False):  # the caller cast for autocast
        return reference.lora_linear(x, ws, a, b, scaling)


@lora_linear_op.register_fake
def _(x, ws, a, b, scaling):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in ws] + [
        x.new_empty(x.shape[0], sum(t.shape[0] for t in a))
    ]


@torch.library.custom_op("loom::lora_linear_backward", mutates_args=())
def lora_linear_backward_op(
    g: list[torch.Tensor],
    x: torch.Tensor,
    ws: list[torch.Tensor],
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    u: torch.Tensor,
    scaling: float,
    input_grad: bool,
) -> list[torch.Tensor]:
    with torch.autocast(x.device.type, enabled=False):
        return reference.lora_linear_backward(
            [t.contiguous() for t in g], x, ws, a, b, u, scaling, input_grad
        )


@lora_linear_backward_op.register_fake
def _(g, x, ws, a, b, u, scaling, input_grad):
    dx = x.new_empty(x.shape) if input_grad else x.new_empty(0)
    return [dx] + [t.new_empty(t.shape) for t in a] + [t.new_empty(t.shape) for t in b]


def _setup_context(ctx, inputs, output):
    x, ws, a, b, scaling = inputs
    ctx.n, ctx.scaling = len(ws), scaling
    ctx.save_for_backward(x, *ws, *a, *b, output[-1])


def _backward(ctx, grads):
    n = ctx.n
    saved = ctx.saved_tensors  # read once: a checkpointed block's saved tensors unpack once (non-reentrant)
    x, saved = saved[0], saved[1:]
    ws, a, b, u = list(saved[:n]), list(saved[n : 2 * n]), list(saved[2 * n : 3 * n]), saved[-1]
    g = [
        torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) if gi is None else gi
        for gi, w in zip(grads[:n], ws)
    ]  # an output that took no part in the loss
    input_grad = bool(ctx.needs_input_grad[0])
    out = lora_linear_backward_op(g, x, ws, a, b, u, ctx.scaling, input_grad)
    return out[0] if input_grad else None, [None] * n, list(out[1 : n + 1]), list(out[n + 1 :]), None


lora_linear_op.register_autograd(_backward, setup_context=_setup_context)


def lora_linear(
    x: torch.Tensor, ws: list[torch.Tensor], a: list[torch.Tensor], b: list[torch.Tensor], scaling: float
) -> list[torch.Tensor]:
    """[x (..., in) @ w_i (out_i, in)^T + scaling * (x @ a_i (r, in)^T) @ b_i (out_i, r)^T for each i] for frozen
    ``ws`` (no gradient) of one input; under autocast every operand is cast to its dtype first, as ``F.linear``
    would."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, ws, a, b = (
            x.to(dtype),
            [t.to(dtype) for t in ws],
            [t.to(dtype) for t in a],
            [t.to(dtype) for t in b],
        )
    ys = lora_linear_op(x.reshape(-1, x.shape[-1]), ws, a, b, scaling)[:-1]
    return [y.view(*x.shape[:-1], y.shape[-1]) for y in ys]
