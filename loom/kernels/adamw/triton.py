"""AdamW step as one Triton kernel per tensor, and its checking launcher (imported only when Triton runs).

One pass over the tensor: reads param, grad, exp_avg, exp_avg_sq, writes param, exp_avg, exp_avg_sq
(28 bytes per fp32 parameter, the least an fp32 AdamW can move). fp32 math; the gradient may be bf16 or
fp16. The optional gradient factor (clipping) is a one-element device tensor read by every program, so
the step never waits for the host; a factor that is not finite skips the step (nothing is stored: the
trainer's non-finite guard, decided on the device). Plain pointer arithmetic and masks: Triton 3.6 and newer.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loom.kernels.triton_support import check_tensor

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 4096


@triton.jit
def _adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    factor_ptr,
    n,
    decay,
    beta1,
    beta2,
    step_size,
    inv_bc2_sqrt,
    eps,
    HAS_FACTOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_FACTOR:
        factor = tl.load(factor_ptr)
        g = g * factor
        # NaN or inf (x - x is NaN) skips the step; compared as a block (the interpreter cannot AND a scalar)
        mask = mask & (tl.zeros([BLOCK], tl.float32) + (factor - factor) == 0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) * inv_bc2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def check(param, grad, exp_avg, exp_avg_sq, grad_factor) -> None:
    check_tensor("param", param, dtypes=(torch.float32,))
    check_tensor("grad", grad, dtypes=GRAD_DTYPES, device=param.device)
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if name != "grad":
            check_tensor(name, t, dtypes=(torch.float32,), device=param.device)
        if t.shape != param.shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected param's {tuple(param.shape)}")
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    if grad_factor is not None:
        check_tensor("grad_factor", grad_factor, dtypes=(torch.float32,), device=param.device)
        if grad_factor.numel() != 1:
            raise ValueError(f"grad_factor: expected one element, got shape {tuple(grad_factor.shape)}")


def adamw_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    grad_factor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """In place on param, exp_avg, exp_avg_sq (fp32, contiguous, one shape); ``step`` counts from 1."""
    check(param, grad, exp_avg, exp_avg_sq, grad_factor)
    if step < 1:
        raise ValueError(f"step: {step}, expected >= 1 (the count including this step)")
    n = param.numel()
    if n == 0:
        return
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        grad_factor if grad_factor is not None else param,
        n,
        1.0 - lr * weight_decay,
        beta1,
        beta2,
        lr / (1.0 - beta1**step),
        1.0 / math.sqrt(1.0 - beta2**step),
        eps,
        HAS_FACTOR=grad_factor is not None,
        BLOCK=BLOCK,
        num_warps=8,
    )
