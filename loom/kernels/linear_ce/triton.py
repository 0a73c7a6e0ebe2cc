"""Triton kernel: the per-row cross-entropy of a chunk of logits, with the logits' gradient written
over the logits in place (the chunk's buffer is the gradient buffer; no second (n, V) tensor).

One program per row: pass 1 reads the row in V-blocks and keeps an online max ``m`` and rescaled sum
``s`` of exp(x - m), so lse = m + log(s) in fp32 whatever the storage dtype; the loss is lse - x[label].
Pass 2 (with gradients) reads the row again and stores softmax - onehot = exp(x - lse) - [col == label]
in the logits' dtype. A row whose label is IGNORE gets loss 0 and a zero gradient row without pass 1.

Plain pointer arithmetic only (no block pointers or tensor descriptors): it compiles on triton 3.6
(the GPU image) and newer, and runs in the CPU interpreter (TRITON_INTERPRET=1). Labels outside
[0, V) other than IGNORE are not checked (that would need a host sync): they are an error caught
only under TRITON_DEBUG=1 (device assert); the torch path raises on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels.triton_support import check_tensor
from loom.numerics import IGNORE

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK_V = 4096  # elements of a row per step: 16 KiB fp32 in registers over 8 warps


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    labels_ptr,
    loss_ptr,
    V,
    stride_row,
    ignore_index,
    WITH_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: rows * V can pass 2**31 for large chunks
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row)
    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if WITH_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=logits_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                tl.store(row_ptr + start + cols, zeros, mask=start + cols < V)
    else:
        tl.device_assert((label >= 0) & (label < V), "label outside [0, V) and not IGNORE")
        m = tl.full([], float("-inf"), tl.float32)  # running max
        s = tl.zeros([], dtype=tl.float32)  # running sum of exp(x - m)
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            x = tl.load(row_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        target = tl.load(row_ptr + label).to(tl.float32)  # read before pass 2 overwrites it
        tl.store(loss_ptr + row, lse - target)
        if WITH_GRAD:
            for start in range(0, V, BLOCK_V):
                mask = start + cols < V
                x = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(x - lse)
                g = tl.where(start + cols == label, g - 1.0, g)
                tl.store(row_ptr + start + cols, g.to(logits_ptr.dtype.element_ty), mask=mask)


def ce_rows_triton_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    with_grad: bool,
    block_v: int | None = None,
) -> None:
    """logits (n, V) contiguous fp32/bf16/fp16; labels (n,) int64; loss (n,) fp32 contiguous, written.
    With ``with_grad`` the logits are overwritten with softmax - onehot (zero rows for IGNORE).
    ``block_v`` (a power of two) overrides the V-block size (tests use it to cover several blocks)."""
    check_tensor("logits", logits, dtypes=LOGIT_DTYPES, ndim=2)
    check_tensor("labels", labels, dtypes=(torch.int64,), ndim=1, device=logits.device)
    check_tensor("loss", loss, dtypes=(torch.float32,), ndim=1, device=logits.device)
    n_rows, vocab = logits.shape
    if labels.shape[0] != n_rows or loss.shape[0] != n_rows:
        raise ValueError(
            f"labels {tuple(labels.shape)} and loss {tuple(loss.shape)} must have "
            f"{n_rows} rows, as logits {tuple(logits.shape)}"
        )
    for name, t in (("logits", logits), ("labels", labels), ("loss", loss)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")
    if n_rows == 0:
        return
    block = block_v or min(MAX_BLOCK_V, triton.next_power_of_2(vocab))
    if block & (block - 1):
        raise ValueError(f"block_v: must be a power of two, got {block}")
    _ce_rows_kernel[(n_rows,)](
        logits,
        labels,
        loss,
        vocab,
        logits.stride(0),
        IGNORE,
        WITH_GRAD=with_grad,
        BLOCK_V=block,
        num_warps=8 if block >= 2048 else 4,
    )
