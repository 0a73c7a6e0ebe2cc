"""``loom::linear_cross_entropy``: the summed cross-entropy of ``h @ weight.T`` without the full logits.

The op returns (loss, grad_h, grad_weight): the gradients are computed in the forward pass (see
``reference.py``), saved, and the autograd formula scales them by the incoming scalar. On CUDA (or on
CPU under TRITON_INTERPRET=1) the per-chunk CE runs the Triton kernel, otherwise torch ops; the
matmuls are cuBLAS / aten in the input dtype either way.

Autocast: a custom op is not autocast-aware, so ``linear_cross_entropy`` casts h to the autocast dtype
itself when autocast is on for its device, and the op casts the weight to h's dtype, as the unfused
path's ``F.linear`` would: under bf16 autocast the matmuls run in bf16 and the softmax in fp32; the weight
gradient is accumulated in fp32, kept in bf16 until backward (the memory of the unfused path), and there
cast to the weight's fp32 and scaled in one vectorized pass each, where autograd's cast back after a
mixed-dtype scaling cost more (docs/kernels.md).
"""

from __future__ import annotations

import torch

from loom.kernels.linear_ce.reference import (
    ce_rows_torch_,
    chunked_linear_cross_entropy,
    default_chunk_tokens,
)
from loom.kernels.triton_support import triton_runs_on


def _ce_rows_for(device: torch.device):
    if triton_runs_on(device):
        from loom.kernels.linear_ce.triton import ce_rows_triton_

        return ce_rows_triton_
    return ce_rows_torch_


@torch.library.custom_op("loom::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    with_grads: bool,
    weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h (N, E), weight (V, E) in h's dtype or fp32 (cast to h's for the matmuls), labels (N,) int64. Returns
    (loss fp32 scalar, grad_h (N, E), grad_weight (V, E), both in h's dtype) of the summed loss; the gradients
    are empty (0,) tensors without ``with_grads``, and grad_weight without ``weight_grad`` (a frozen weight)."""
    # Autocast's dispatch key falls through for this op but stays on for the ops inside: keep it off
    # so that the matmuls run in the input dtype (the caller has already cast for autocast).
    with torch.autocast(h.device.type, enabled=False):
        return chunked_linear_cross_entropy(
            h, weight, labels, chunk_tokens, with_grads, _ce_rows_for(h.device), weight_grad
        )


@linear_cross_entropy_op.register_fake
def _(h, weight, labels, chunk_tokens, with_grads, weight_grad):
    loss = h.new_empty((), dtype=torch.float32)
    if not with_grads:
        return loss, h.new_empty(0), h.new_empty(0)
    return loss, h.new_empty(h.shape), h.new_empty(weight.shape if weight_grad else 0)


def _setup_context(ctx, inputs, output):
    _, grad_h, grad_w = output
    ctx.weight_dtype = inputs[1].dtype
    ctx.save_for_backward(grad_h, grad_w)


def _backward(ctx, grad_loss, _grad_grad_h, _grad_grad_w):
    """d(loss)/d(h) and d(loss)/d(weight) were computed in forward: scale by the incoming scalar, the weight's in
    its own dtype (an fp32 master weight: cast first, then scaled in place in fp32, so that no mixed-dtype product
    and no cast back by autograd follow). The op's gradient outputs are treated as constants (nothing
    differentiates through them)."""
    grad_h, grad_w = ctx.saved_tensors
    dh = (grad_h * grad_loss).to(grad_h.dtype) if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.needs_input_grad[1]:
        same = grad_w.dtype == ctx.weight_dtype
        dw = grad_w * grad_loss if same else grad_w.to(ctx.weight_dtype).mul_(grad_loss)
    return dh, dw, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Sum over tokens of cross_entropy(h @ weight.T, labels) (IGNORE = no loss) as an fp32 scalar,
    never holding more than ``chunk_tokens`` rows of logits (default: ``default_chunk_tokens``: a
    256 MiB buffer, or as large as grad_weight when 16-bit gradients are computed and that is larger).
    h: (..., E), weight: (V, E), labels: h's leading shape, int64. Same value as
    ``cross_entropy_sum(h @ weight.T, labels)``; a tied weight gets the sum of both uses' gradients
    from autograd as usual. Gradients are computed in the forward pass only when autograd needs them."""
    if h.dim() < 1 or weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: h {tuple(h.shape)} and weight {tuple(weight.shape)} "
            "must be (..., E) and (V, E)"
        )
    if labels.shape != h.shape[:-1] or labels.dtype != torch.int64:
        raise ValueError(
            f"linear_cross_entropy: labels {tuple(labels.shape)} {labels.dtype} must be int64 "
            f"of shape {tuple(h.shape[:-1])}"
        )
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h = h.to(dtype)  # the weight: cast in the op, its gradient kept in its own dtype
        if weight.dtype not in (dtype, torch.float32):
            weight = weight.to(dtype)
    elif h.dtype != weight.dtype:
        raise ValueError(
            f"linear_cross_entropy: h is {h.dtype} and weight {weight.dtype}; "
            "cast them to one dtype (or use autocast)"
        )
    h2 = h.reshape(-1, h.shape[-1])  # (N, E)
    with_grads = torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad)
    weight_grad = with_grads and weight.requires_grad  # a frozen head (LoRA) takes no weight-gradient matmul
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0], weight.shape[1], h.dtype, weight_grad)
    if chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")
    loss, _, _ = linear_cross_entropy_op(
        h2, weight, labels.reshape(-1), chunk_tokens, with_grads, weight_grad
    )
    return loss
