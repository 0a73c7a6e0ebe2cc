"""Linear + cross-entropy in pure PyTorch: the unfused definition, and the chunked algorithm that
never holds more than ``chunk_tokens`` rows of logits.

The chunked algorithm (as in Liger-Kernel's fused linear cross-entropy) computes the gradients in
the forward pass, because the logits of a chunk are only alive there:

    for each chunk of rows:  logits = h_c @ W.T                    (n, V) in the input dtype
                             loss_c, logits <- softmax - onehot     per-row CE; gradient in place
                             grad_h[c] = logits @ W                 (n, E)
                             grad_W  += logits.T @ h_c              (V, E), accumulated in fp32

The backward pass then only scales the saved gradients by the incoming scalar. This module runs
the per-chunk CE with torch ops (what CPU runs execute, and the definition of the Triton kernel);
``op.py`` passes the Triton kernel in its place on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from loom.numerics import IGNORE

# Budget of the chunk's logits buffer: chunk_tokens * V * element size stays at or below it.
CHUNK_BYTES = 256 * 2**20


def default_chunk_tokens(vocab: int, dim: int, dtype: torch.dtype, with_grads: bool = True) -> int:
    """Rows per chunk: the (rows, vocab) logits buffer in ``dtype`` fits ``CHUNK_BYTES`` (256 MiB), or,
    when weight gradients (``with_grads``) are computed in bf16/fp16, the size of grad_weight (vocab x dim in ``dtype``) if that
    is larger: the fp32 grad_weight accumulator and its cast already hold three times that, so such a
    chunk adds nothing to the peak, and fewer chunks mean fewer read-modify-writes of the accumulator
    (faster at the same peak: docs/kernels.md). Rounded down to a multiple of 128 rows (matmul tiles) when
    there is room; at least 1 row. V = 128256 in bf16: 1024 rows without gradients (250 MiB), ``dim`` rows
    with them. The torch per-chunk CE upcasts a bf16/fp16 chunk to fp32 on the side (three times the buffer);
    the Triton kernel needs nothing."""
    elem = torch.empty((), dtype=dtype).element_size()
    budget = max(CHUNK_BYTES, vocab * dim * elem) if with_grads and elem < 4 else CHUNK_BYTES
    rows = budget // max(1, vocab * elem)
    if rows >= 128:
        rows = rows // 128 * 128
    return max(1, rows)


def linear_cross_entropy_unfused(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The definition: h (N, E), weight (V, E), labels (N,) with IGNORE. Full logits in the input
    dtype, softmax in fp32; returns the sum of token losses (fp32 scalar). Differentiable."""
    logits = h @ weight.T  # (N, V)
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")


def ce_rows_torch_(logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor, with_grad: bool) -> None:
    """Per-row cross-entropy of a chunk: logits (n, V), labels (n,), loss (n,) fp32 written.
    With ``with_grad`` the logits are overwritten with d(sum of losses)/d(logits) = softmax - onehot
    (zero rows where the label is IGNORE)."""
    x = logits.float()  # (n, V) fp32; the same storage when logits are fp32
    valid = labels != IGNORE  # (n,)
    target = torch.where(valid, labels, 0)[:, None]  # (n, 1)
    lse = torch.logsumexp(x, dim=-1)  # (n,)
    loss.copy_(torch.where(valid, lse - x.gather(1, target).squeeze(1), 0.0))
    if not with_grad:
        return
    x.sub_(lse[:, None]).exp_()  # softmax, in place
    x.scatter_add_(1, target, -valid[:, None].to(x.dtype))  # - onehot on valid rows
    x.mul_(valid[:, None])  # ignored rows: no gradient
    if x.data_ptr() != logits.data_ptr():
        logits.copy_(x)


CeRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None]


def _accumulate_grad_weight(acc: torch.Tensor, dlogits: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """acc (V, E) fp32 += dlogits.T (V, n) @ h (n, E), or = on the ``first`` chunk (acc is uninitialized then:
    beta 0 ignores it, so no pass zeroes it). On CUDA a bf16/fp16 product is written in fp32 by cuBLAS
    (``out_dtype``); elsewhere (aten has no CPU kernel for it) the product is rounded to the input dtype before
    the fp32 sum."""
    beta = 0 if first else 1
    if dlogits.dtype == acc.dtype:
        acc.addmm_(dlogits.T, h, beta=beta)
    elif dlogits.is_cuda:
        torch.addmm(acc, dlogits.T, h, beta=beta, out_dtype=acc.dtype, out=acc)
    elif first:
        acc.copy_(dlogits.T @ h)
    else:
        acc.add_(dlogits.T @ h)


def chunked_linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    with_grads: bool = True,
    ce_rows: CeRows = ce_rows_torch_,
    weight_grad: bool = True,
):
    """h (N, E), weight (V, E), labels (N,) int64. Returns (loss fp32 scalar, grad_h (N, E) and grad_weight (V, E)
    in h's dtype): the gradients of the summed loss, or empty tensors without ``with_grads`` (grad_weight alone
    without ``weight_grad``: a frozen head, as under LoRA, skips its matmul). Matmuls run in h's dtype (call with
    autocast off; an fp32 master weight is cast to it here, as autocast would); extra memory ~ chunk_tokens x V in
    h's dtype, plus an fp32 (V, E) accumulator."""
    weight_grad = with_grads and weight_grad
    weight = weight.to(h.dtype)
    n_rows = h.shape[0]
    loss_rows = torch.zeros(n_rows, dtype=torch.float32, device=h.device)  # (N,)
    if with_grads:
        grad_h = h.new_empty(h.shape)  # (N, E)
    if weight_grad:
        # (V, E) fp32, written by the first chunk's product (beta 0): zeroed only where there is no chunk
        grad_w = (torch.empty if n_rows else torch.zeros)(
            weight.shape, dtype=torch.float32, device=weight.device
        )
    for start in range(0, n_rows, chunk_tokens):
        end = min(start + chunk_tokens, n_rows)
        h_c = h[start:end]  # (n, E)
        logits = h_c @ weight.T  # (n, V), input dtype; becomes dlogits in place
        ce_rows(logits, labels[start:end], loss_rows[start:end], with_grads)
        if with_grads:
            torch.mm(logits, weight, out=grad_h[start:end])
        if weight_grad:
            _accumulate_grad_weight(grad_w, logits, h_c, first=start == 0)
        del logits
    loss = loss_rows.sum()
    if not with_grads:
        return loss, h.new_empty(0), h.new_empty(0)
    return loss, grad_h, grad_w.to(h.dtype) if weight_grad else h.new_empty(0)
