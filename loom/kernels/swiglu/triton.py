"""SwiGLU Triton kernels and their checking launchers (imported only when Triton runs).

Elementwise over the flattened tensors, fp32 inside. Forward rounds silu(a) to the input dtype
before the product, as the unfused ``F.silu(a) * b`` does; backward computes both gradients from one
read of grad, a and b and rounds each once. Plain pointer arithmetic and masks: Triton 3.6 and newer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels.triton_support import check_tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (a / (1.0 + tl.exp(-a))).to(a_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (silu * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(grad_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    da = g * b * sig * (1.0 + a * (1.0 - sig))
    db = g * a * sig
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)


def _check(a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor | None = None) -> None:
    check_tensor("a", a, dtypes=DTYPES)
    check_tensor("b", b, dtypes=(a.dtype,), device=a.device)
    named = [("a", a), ("b", b)] + ([("grad", grad)] if grad is not None else [])
    if grad is not None:
        check_tensor("grad", grad, dtypes=DTYPES, device=a.device)
    for name, t in named:
        if t.shape != a.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected a's {tuple(a.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b: the same shape and dtype, contiguous. Returns silu(a) * b."""
    _check(a, b)
    out = torch.empty_like(a)
    n = a.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](a, b, out, n, BLOCK=BLOCK, num_warps=4)
    return out


def swiglu_backward(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (da, db) in a's and b's dtype."""
    _check(a, b, grad)
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](grad, a, b, da, db, n, BLOCK=BLOCK, num_warps=4)
    return da, db
