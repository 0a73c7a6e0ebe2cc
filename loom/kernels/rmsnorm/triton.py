"""RMSNorm Triton kernels and their checking launchers (imported only when Triton runs).

Each row of x (..., N) is held whole in registers (N up to ``MAX_N``), so forward reads x once and
backward reads x and grad once. Statistics in fp32 whatever the input dtype. Backward computes dweight
without atomics: a bounded number of persistent programs each sum grad * y over a contiguous range of
rows into their own fp32 row of a (P, N) buffer, and one ``sum(0)`` reduces the P partial rows.

Plain pointer arithmetic and masks only (no block pointers / tensor descriptors): Triton 3.6 and newer.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loom.kernels.triton_support import check_tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_N = 65536  # a row lives in registers (spilling past ~16K in backward); longer rows would need a loop
_TILE = 2048  # elements per program forward: several short rows per program when N is small


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, out_ptr, n_rows, n_cols, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]  # (BLOCK_M, BLOCK_N) int64
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # (BLOCK_M,)
    # the model's rounding: normalized value and weight each rounded to x's dtype, product rounded once
    y = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    grad_ptr,
    x_ptr,
    w_ptr,
    dx_ptr,
    dw_partial_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & col_ok[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # recomputed: x is loaded anyway
        y = x * rstd[:, None]
        dy = g * w[None, :]
        c = tl.sum(dy * y, axis=1) / n_cols  # (BLOCK_M,)
        dx = (dy - y * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.where(mask, g * y, 0.0)  # padding rows: y is nan when eps == 0
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_ok)


def _blocks(n_cols: int) -> tuple[int, int, int]:
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, min(16, _TILE // block_n))
    tile = block_m * block_n
    num_warps = 4 if tile < 2048 else 8 if tile < 8192 else 16 if tile < 32768 else 32  # as Liger-Kernel
    return block_m, block_n, num_warps


def _check(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor | None = None) -> int:
    check_tensor("x", x, dtypes=DTYPES)
    check_tensor("weight", weight, dtypes=DTYPES, ndim=1, device=x.device)
    if x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"weight: shape {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}"
        )
    n_cols = weight.shape[0]
    if not 0 < n_cols <= MAX_N:
        raise ValueError(f"x: last dim {n_cols} not supported (1..{MAX_N})")
    named = [("x", x), ("weight", weight)]
    if grad is not None:
        check_tensor("grad", grad, dtypes=DTYPES, device=x.device)
        if grad.shape != x.shape:
            raise ValueError(f"grad: shape {tuple(grad.shape)}, expected x's {tuple(x.shape)}")
        named.append(("grad", grad))
    for name, t in named:
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    return n_cols


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., N) contiguous; weight: (N,). Returns (..., N) in x's dtype."""
    n_cols = _check(x, weight)
    out = torch.empty_like(x)
    n_rows = x.numel() // n_cols
    if n_rows == 0:
        return out
    block_m, block_n, num_warps = _blocks(n_cols)
    _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        x, weight, out, n_rows, n_cols, eps, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps
    )
    return out


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _n_programs(device: torch.device, n_rows: int) -> int:
    """Backward programs: a few per SM keep the GPU busy; the (P, N) partial buffer stays small."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n_rows, 4 * _sm_count(index)))
    return max(1, min(n_rows, 4))  # the CPU interpreter: a few programs still exercise the reduction


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx in x's dtype, dweight in weight's dtype)."""
    n_cols = _check(x, weight, grad)
    dx = torch.empty_like(x)
    n_rows = x.numel() // n_cols
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    block_m, block_n, num_warps = _blocks(n_cols)
    n_programs = _n_programs(x.device, n_rows)
    rows_per_program = triton.cdiv(n_rows, n_programs)
    n_programs = triton.cdiv(n_rows, rows_per_program)  # no idle program
    dw_partial = torch.empty(n_programs, n_cols, dtype=torch.float32, device=x.device)  # (P, N)
    _rms_norm_bwd_kernel[(n_programs,)](
        grad,
        x,
        weight,
        dx,
        dw_partial,
        n_rows,
        n_cols,
        rows_per_program,
        eps,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return dx, dw_partial.sum(0).to(weight.dtype)
