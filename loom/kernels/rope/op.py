"""RoPE as ``torch.library`` custom ops: ``loom::apply_rope`` and ``loom::apply_rope_backward``.

The Triton kernel runs where Triton does (CUDA, or CPU under TRITON_INTERPRET=1); elsewhere the
reference. Only x is differentiable: the cos/sin table is a buffer and the positions are integers. The
backward needs neither x nor the output, so nothing of the activation size is saved.
"""

from __future__ import annotations

import torch

from loom.kernels.rope import reference
from loom.kernels.triton_support import triton_runs_on


def _contiguous(x, table, positions):
    return x.contiguous(), table.contiguous(), None if positions is None else positions.contiguous()


@torch.library.custom_op("loom::apply_rope", mutates_args=())
def apply_rope_op(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    x, table, positions = _contiguous(x, table, positions)
    if triton_runs_on(x.device):
        from loom.kernels.rope import triton as kernels

        return kernels.apply_rope_forward(x, table, positions)
    return reference.apply_rope(x, table, positions)


@apply_rope_op.register_fake
def _(x, table, positions):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("loom::apply_rope_backward", mutates_args=())
def apply_rope_backward_op(
    grad: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None
) -> torch.Tensor:
    grad, table, positions = _contiguous(grad, table, positions)
    if triton_runs_on(grad.device):
        from loom.kernels.rope import triton as kernels

        return kernels.apply_rope_backward(grad, table, positions)
    return reference.apply_rope_backward(grad, table, positions)


@apply_rope_backward_op.register_fake
def _(grad, table, positions):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    _, table, positions = inputs
    ctx.save_for_backward(table, positions)


def _backward(ctx, grad):
    table, positions = ctx.saved_tensors
    return apply_rope_backward_op(grad, table, positions), None, None


apply_rope_op.register_autograd(_backward, setup_context=_setup_context)


def apply_rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """x: (B, S, H, D); table: (2, L, D) cos and sin (``rope_table``); positions: (B, S) or None for 0..S-1.

    The same values as ``reference.apply_rope``; no gradient flows to table or positions."""
    if x.dim() != 4 or table.dim() != 3 or table.shape[-1] != x.shape[-1] or x.shape[-1] % 2:
        raise ValueError(
            f"apply_rope: x {tuple(x.shape)} must be (B, S, H, D) with D even and the table "
            f"{tuple(table.shape)} (2, L, D)"
        )
    if positions is not None and tuple(positions.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"apply_rope: positions {tuple(positions.shape)}, expected (B, S) = {tuple(x.shape[:2])}"
        )
    return apply_rope_op(x, table, positions)
