"""The sum of squares of many tensors as a ``torch.library`` custom op: ``loom::sum_squares``.

The Triton kernel runs where Triton does (CUDA, or CPU under TRITON_INTERPRET=1); elsewhere the reference.
"""

from __future__ import annotations

import torch

from loom.kernels.sum_squares import reference
from loom.kernels.triton_support import triton_runs_on


@torch.library.custom_op("loom::sum_squares", mutates_args=())
def sum_squares_op(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors and triton_runs_on(tensors[0].device):
        from loom.kernels.sum_squares import triton as kernels

        return kernels.sum_squares(tensors)
    return reference.sum_squares(tensors).to(tensors[0].device if tensors else "cpu")


@sum_squares_op.register_fake
def _(tensors):
    return torch.empty((), dtype=torch.float32, device=tensors[0].device if tensors else "cpu")


def sum_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element of ``tensors`` (one device; contiguous where Triton runs), a 0-dim
    fp32 tensor on their device: a gradient norm's local part in two launches for any number of tensors."""
    if not tensors:
        raise ValueError("sum_squares: no tensors")
    return sum_squares_op([t.detach() for t in tensors])
