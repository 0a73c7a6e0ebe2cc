"""FSDP2's reduce-scatter copy-in through loom's kernel (``parallel.fsdp_grad_copy triton``): each unit's unsharded
gradients cast into its reduce-scatter buffer by ``loom::chunk_copy_`` (contiguous, vectorized loads and stores)
instead of PyTorch's ``_chunk_cat`` kernel, which copied at 1.76 TB/s on an H200 in the 8B profile (25 ms a step
on the compute stream: docs/benchmarks.md). The same bytes in the same places; units it does not fit (a first dim
that does not divide by the shard count, mixed dtypes) keep FSDP2's own copy. Its rules:
loom.parallel.grad_copy_rules."""

from __future__ import annotations

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

from loom.kernels.chunk_copy.op import chunk_copy_
from loom.kernels.triton_support import triton_runs_on

_TORCH = collectives.foreach_reduce_scatter_copy_in  # FSDP2's own
_OUT_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_grad_copy(kind: str, device: torch.device | None = None) -> None:
    """Every FSDP2 unit of this process copies its gradients with ``kind``'s kernel: ``triton`` loom's where it
    fits, ``torch`` FSDP2's own, ``auto`` loom's where Triton runs on ``device`` (FSDP2 calls its module's copy-in
    function, which this sets, process-wide)."""
    if kind == "auto":
        kind = (
            "triton" if device is not None and device.type == "cuda" and triton_runs_on(device) else "torch"
        )
    collectives.foreach_reduce_scatter_copy_in = grad_copy_in if kind == "triton" else _TORCH


def grad_copy_in(
    unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int
) -> None:
    """FSDP2's ``foreach_reduce_scatter_copy_in``, by loom's kernel where every gradient fits it."""
    if fits(unsharded_grads, reduce_scatter_input, world_size):
        chunk_copy_(unsharded_grads, reduce_scatter_input, world_size)
    else:
        _TORCH(unsharded_grads, reduce_scatter_input, world_size)


def fits(grads: list[torch.Tensor], out: torch.Tensor, world_size: int) -> bool:
    """Contiguous gradients of one dtype whose first dims divide by ``world_size`` (no padding: the buffer holds
    exactly their elements), into a contiguous fp32 or bf16 buffer on their device."""
    return (
        bool(grads)
        and out.is_contiguous()
        and out.dtype in _OUT_DTYPES
        and grads[0].dtype in _GRAD_DTYPES
        and all(
            g.dtype == grads[0].dtype
            and g.device == out.device
            and g.is_contiguous()
            and g.dim() > 0
            and g.shape[0] % world_size == 0
            for g in grads
        )
        and out.numel() == sum(g.numel() for g in grads)
    )
