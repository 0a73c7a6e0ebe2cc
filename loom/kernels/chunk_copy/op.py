"""FSDP2's reduce-scatter copy-in as a ``torch.library`` custom op: ``loom::chunk_copy_`` (in place on ``out``).

The Triton kernel runs where Triton does (CUDA, or CPU under TRITON_INTERPRET=1); elsewhere the reference.
"""

from __future__ import annotations

import torch

from loom.kernels.chunk_copy import reference
from loom.kernels.triton_support import triton_runs_on


@torch.library.custom_op("loom::chunk_copy_", mutates_args=("out",))
def chunk_copy_op(tensors: list[torch.Tensor], out: torch.Tensor, chunks: int) -> None:
    if triton_runs_on(out.device):
        from loom.kernels.chunk_copy import triton as kernels

        kernels.chunk_copy(tensors, out, chunks)
        return
    reference.chunk_copy_(tensors, out, chunks)


@chunk_copy_op.register_fake
def _(tensors, out, chunks):
    return None


def chunk_copy_(tensors: list[torch.Tensor], out: torch.Tensor, chunks: int) -> None:
    """Each tensor split along its first dim into ``chunks`` parts; part r of every tensor, in order, cast into row r
    of ``out`` (``torch._chunk_cat``'s layout where every first dim divides by ``chunks``)."""
    if any(t.dim() == 0 or t.shape[0] % chunks for t in tensors):
        raise ValueError(
            f"chunk_copy_: every tensor's first dim must divide by {chunks}: "
            f"{[tuple(t.shape) for t in tensors if t.dim() == 0 or t.shape[0] % chunks][:3]}"
        )
    chunk_copy_op(tensors, out, chunks)
