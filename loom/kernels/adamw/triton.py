"""AdamW step as one Triton kernel per tensor or one for many tensors, and their checking launchers (imported only
when Triton runs).

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
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, factor_ptr, n, decay, beta1, beta2, step_size, inv_bc2_sqrt, eps,
                  HAS_FACTOR: tl.constexpr, BLOCK: tl.constexpr):
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


def adamw_step(param, grad, exp_avg, exp_avg_sq, grad_factor, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, step: int) -> None:
    """In place on param, exp_avg, exp_avg_sq (fp32, contiguous, one shape); ``step`` counts from 1."""
    check(param, grad, exp_avg, exp_avg_sq, grad_factor)
    if step < 1:
        raise ValueError(f"step: {step}, expected >= 1 (the count including this step)")
    n = param.numel()
    if n == 0:
        return
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, grad_factor if grad_factor is not None else param, n,
        1.0 - lr * weight_decay, beta1, beta2, lr / (1.0 - beta1**step), 1.0 / math.sqrt(1.0 - beta2**step), eps,
        HAS_FACTOR=grad_factor is not None, BLOCK=BLOCK, num_warps=8)


# ---- many tensors in one launch ----------------------------------------------------------------------------------
# A step of a model's every tensor as one kernel: per-tensor launches cost the host tens of microseconds each, which
# for a small model (or LoRA's many small adapters) is the optimizer step's whole time. Each tensor's row of a
# table holds its four addresses, its size and its first program; each program finds its tensor in a cached map.
ROW = 6  # int64 per tensor: param, grad, exp_avg, exp_avg_sq addresses, numel, first program
SCALARS = 3  # fp32 per tensor: decay (1 - lr * weight_decay), step size (lr / bias correction 1), 1 / sqrt(bc2)
_block_maps: dict = {}


@triton.jit
def _adamw_multi_kernel(table_ptr, scalars_ptr, block_map_ptr, factor_ptr, beta1, beta2, eps,
                        GRAD_DTYPE: tl.constexpr, HAS_FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_map_ptr + pid).to(tl.int64)
    row = table_ptr + t * 6
    # addresses from the table: 16-byte aligned (the launcher checks), which the compiler needs told to vectorize
    p_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.float32)), 16)
    g_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(GRAD_DTYPE)), 16)
    m_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.float32)), 16)
    v_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.float32)), 16)
    n = tl.load(row + 4)
    first = tl.load(row + 5)
    decay = tl.load(scalars_ptr + t * 3)
    step_size = tl.load(scalars_ptr + t * 3 + 1)
    inv_bc2_sqrt = tl.load(scalars_ptr + t * 3 + 2)
    offs = (pid - first) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_FACTOR:
        factor = tl.load(factor_ptr)
        g = g * factor
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


TL_GRAD = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def adamw_step_multi(params, grads, exp_avgs, exp_avg_sqs, grad_factor, lrs, weight_decays, steps, beta1: float,
                     beta2: float, eps: float) -> None:
    """``adamw_step`` on every tensor of the lists (one device, one gradient dtype) in one launch; ``lrs``,
    ``weight_decays`` and ``steps`` per tensor."""
    if not params:
        return
    device, gdtype = params[0].device, grads[0].dtype
    ints, floats, counts = [], [], []
    for p, g, m, v, lr, wd, step in zip(params, grads, exp_avgs, exp_avg_sqs, lrs, weight_decays, steps, strict=True):
        check(p, g, m, v, grad_factor)
        if p.device != device or g.dtype != gdtype:
            raise ValueError(f"adamw_step_multi: one device and one gradient dtype per call, got {p.device} / "
                             f"{g.dtype} after {device} / {gdtype}")
        if step < 1:
            raise ValueError(f"step: {step}, expected >= 1 (the count including this step)")
        n = p.numel()
        if n == 0:
            continue
        if any(t.data_ptr() % 16 for t in (p, g, m, v)):  # a view at an odd offset: its own launch
            adamw_step(p, g, m, v, grad_factor, lr, beta1, beta2, eps, wd, step)
            continue
        ints += [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, sum(counts)]
        floats += [1.0 - lr * wd, lr / (1.0 - beta1**step), 1.0 / math.sqrt(1.0 - beta2**step)]
        counts.append(triton.cdiv(n, BLOCK))
    if not counts:
        return
    key = (device, tuple(counts))
    if key not in _block_maps:  # the program -> tensor map depends only on the sizes: built once per model
        if len(_block_maps) > 16:
            _block_maps.clear()
        _block_maps[key] = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32),
                                                   torch.tensor(counts)).to(device)
    # one host-to-device copy: the int64 table, then the fp32 scalars
    host = torch.cat([torch.tensor(ints, dtype=torch.int64).view(torch.uint8),
                      torch.tensor(floats, dtype=torch.float32).view(torch.uint8)])
    buf = host.to(device, non_blocking=True)
    table, scalars = buf[:8 * len(ints)].view(torch.int64), buf[8 * len(ints):].view(torch.float32)
    _adamw_multi_kernel[(sum(counts),)](
        table, scalars, _block_maps[key], grad_factor if grad_factor is not None else scalars, beta1, beta2, eps,
        GRAD_DTYPE=TL_GRAD[gdtype], HAS_FACTOR=grad_factor is not None, BLOCK=BLOCK, num_warps=8)
