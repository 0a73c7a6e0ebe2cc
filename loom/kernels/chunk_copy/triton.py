"""The reduce-scatter copy-in as one Triton launch for a list of tensors, and its checking launcher (imported only
when Triton runs).

Each program copies one block of one tensor's chunk: from that chunk (contiguous in the tensor) to its place in
its row of the output (contiguous there too), cast on the way. A table of the tensors' addresses (new every step:
autograd's gradients are new tensors) and a block table cached per list of sizes; the loads and stores are plain
and contiguous, so the copy runs at the memory's speed whatever the tensors' sizes (PyTorch's ``_chunk_cat`` read
1.76 TB/s in the 8B profile: docs/benchmarks.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels.triton_support import check_tensor

SRC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.float32, torch.bfloat16)
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BLOCK = 4096
_TABLES: dict = {}  # (sizes, chunks, device) -> the block tables on the device
# (addresses, device) -> the device's table of them: the caching allocator hands each step's gradients the blocks
# of the step before, so the copy to the device is mostly done once
_POINTERS: dict = {}
_POINTER_SETS = 256  # the FSDP2 units of a model, a few sets each


@triton.jit
def _chunk_copy_kernel(
    ptrs,
    block_tensor,
    block_row,
    block_start,
    sizes,
    columns,
    out_ptr,
    row_len,
    SRC_KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    blk = tl.program_id(0)
    t = tl.load(block_tensor + blk)
    r = tl.load(block_row + blk).to(tl.int64)
    start = tl.load(block_start + blk)
    n = tl.load(sizes + t)  # the chunk's elements
    col = tl.load(columns + t)  # its first column in each row
    addr = tl.load(ptrs + t)
    if SRC_KIND == 1:
        src = addr.to(tl.pointer_type(tl.bfloat16))
    elif SRC_KIND == 2:
        src = addr.to(tl.pointer_type(tl.float16))
    else:
        src = addr.to(tl.pointer_type(tl.float32))
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src + r * n + offs, mask=mask)
    tl.store(out_ptr + r * row_len + col + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def _tables(sizes: tuple[int, ...], chunks: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(each block's tensor, row and first element; each chunk's elements and first column) for tensors whose
    chunks have ``sizes`` elements, built once per list."""
    key = (sizes, chunks, str(device))
    if key not in _TABLES:
        tensor, row, start = [], [], []
        for i, n in enumerate(sizes):
            for r in range(chunks):
                for s in range(0, n, BLOCK):
                    tensor.append(i), row.append(r), start.append(s)
        columns = [sum(sizes[:i]) for i in range(len(sizes))]
        as_long = [torch.tensor(x, dtype=torch.int64) for x in (tensor, row, start, list(sizes), columns)]
        _TABLES[key] = tuple(x.to(device) for x in as_long)
    return _TABLES[key]


def check(tensors: list, out: torch.Tensor, chunks: int) -> None:
    if chunks < 1:
        raise ValueError(f"chunks: {chunks}, expected >= 1")
    check_tensor("out", out, dtypes=OUT_DTYPES)
    if not out.is_contiguous():
        raise ValueError(f"out: must be contiguous (shape {tuple(out.shape)}, strides {out.stride()})")
    total = 0
    for i, t in enumerate(tensors):
        check_tensor(f"tensor {i}", t, dtypes=(tensors[0].dtype,), device=out.device)
        if t.dtype not in SRC_DTYPES:
            raise ValueError(f"tensor {i}: dtype {t.dtype} not supported (allowed: {SRC_DTYPES})")
        if not t.is_contiguous() or t.dim() == 0 or t.shape[0] % chunks:
            raise ValueError(
                f"tensor {i}: shape {tuple(t.shape)} (contiguous: {t.is_contiguous()}), expected contiguous with a "
                f"first dim divisible by {chunks}"
            )
        total += t.numel()
    if out.numel() != total:
        raise ValueError(f"out: {out.numel()} elements, expected the tensors' {total}")


def chunk_copy(tensors: list, out: torch.Tensor, chunks: int) -> None:
    """``reference.chunk_copy_`` in one launch."""
    check(tensors, out, chunks)
    if out.numel() == 0:
        return
    sizes = tuple(t.numel() // chunks for t in tensors)
    block_tensor, block_row, block_start, sizes_t, columns = _tables(sizes, chunks, out.device)
    key = (tuple(t.data_ptr() for t in tensors), str(out.device))
    ptrs = _POINTERS.get(key)
    if ptrs is None:
        addresses = torch.tensor(key[0], dtype=torch.int64)
        ptrs = addresses.pin_memory().to(out.device, non_blocking=True) if out.is_cuda else addresses
        if len(_POINTERS) >= _POINTER_SETS:
            _POINTERS.pop(next(iter(_POINTERS)))
        _POINTERS[key] = ptrs
    _chunk_copy_kernel[(len(block_tensor),)](
        ptrs,
        block_tensor,
        block_row,
        block_start,
        sizes_t,
        columns,
        out,
        out.numel() // chunks,
        SRC_KIND=_KIND[tensors[0].dtype],
        BLOCK=BLOCK,
        num_warps=8,
    )
