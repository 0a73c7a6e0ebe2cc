"""The reduce-scatter copy-in as Triton launches, one per tensor, and their checking launcher (imported only when
Triton runs).

Each program copies one block of one chunk of one tensor: from that chunk (contiguous in the tensor) to its place in
its row of the output (contiguous there too), cast on the way. The tensors' addresses and sizes are kernel
arguments, so Triton specializes them on their alignment and vectorizes the loads and stores (a table of addresses
read on the device would hide it); PyTorch's ``_chunk_cat`` read 1.76 TB/s in the 8B profile (docs/benchmarks.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels.triton_support import check_tensor

SRC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16)
BLOCK = 4096


@triton.jit
def _chunk_copy_kernel(src_ptr, out_ptr, n, row_len, col, BLOCK: tl.constexpr):
    """Block ``program_id(0)`` of chunk ``program_id(1)`` (``n`` elements) into row ``program_id(1)`` of ``out``
    (``row_len`` elements a row) from column ``col``."""
    r = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + r * n + offs, mask=mask)
    tl.store(out_ptr + r * row_len + col + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def check(tensors: list, out: torch.Tensor, chunks: int) -> None:
    if chunks < 1:
        raise ValueError(f"chunks: {chunks}, expected >= 1")
    check_tensor("out", out, dtypes=OUT_DTYPES)
    if not out.is_contiguous():
        raise ValueError(f"out: must be contiguous (shape {tuple(out.shape)}, strides {out.stride()})")
    total = 0
    for i, t in enumerate(tensors):
        check_tensor(f"tensor {i}", t, dtypes=SRC_DTYPES, device=out.device)
        if t.dtype != tensors[0].dtype:
            raise ValueError(f"tensor {i}: dtype {t.dtype}, expected the first tensor's {tensors[0].dtype}")
        if not t.is_contiguous() or t.dim() == 0 or t.shape[0] % chunks:
            raise ValueError(
                f"tensor {i}: shape {tuple(t.shape)} (contiguous: {t.is_contiguous()}), expected contiguous with a "
                f"first dim divisible by {chunks}"
            )
        total += t.numel()
    if out.numel() != total:
        raise ValueError(f"out: {out.numel()} elements, expected the tensors' {total}")


def chunk_copy(tensors: list, out: torch.Tensor, chunks: int) -> None:
    """``reference.chunk_copy_``, a launch per tensor."""
    check(tensors, out, chunks)
    row_len, col = out.numel() // chunks, 0
    for t in tensors:
        n = t.numel() // chunks
        if n:
            _chunk_copy_kernel[(triton.cdiv(n, BLOCK), chunks)](
                t, out, n, row_len, col, BLOCK=BLOCK, num_warps=8
            )
        col += n
