"""AdamW step as one Triton kernel per tensor, or one launch for many small tensors, and their checking launchers
(imported only when Triton runs).

One pass over the tensor: reads param, grad, exp_avg, exp_avg_sq, writes param, exp_avg, exp_avg_sq
(28 bytes per fp32 parameter, the least an fp32 AdamW can move). fp32 math; the gradient may be bf16 or
fp16. The optional gradient factor (clipping) is a one-element device tensor read by every program, so
the step never waits for the host; a factor that is not finite skips the step (nothing is stored: the
trainer's non-finite guard, decided on the device). Plain pointer arithmetic and masks: Triton 3.6 and newer.

Many small tensors (a 125M model's ~110, each under ``loom.kernels.adamw.op.SMALL`` elements) cost more to launch
one by one than to step: the multi-tensor kernel reads each block's tensor from a table of pointers and steps them all in one launch.
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
    amax_ptr,
    n,
    decay,
    beta1,
    beta2,
    step_size,
    inv_bc2_sqrt,
    eps,
    HAS_FACTOR: tl.constexpr,
    AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    p = _adamw_block(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        factor_ptr,
        offs,
        n,
        decay,
        beta1,
        beta2,
        step_size,
        inv_bc2_sqrt,
        eps,
        HAS_FACTOR,
        AMAX,
        BLOCK,
    )
    if AMAX:  # the block's largest |param| after the step (before it where the step is skipped)
        tl.atomic_max(amax_ptr, tl.max(tl.abs(p), axis=0))


@triton.jit
def _adamw_multi_kernel(
    ptrs,
    block_tensor,
    block_start,
    sizes,
    factor_ptr,
    T,
    decay,
    beta1,
    beta2,
    step_size,
    inv_bc2_sqrt,
    eps,
    G_KIND: tl.constexpr,
    HAS_FACTOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One block of one of ``T`` tensors: ``ptrs`` holds the params', grads', exp_avgs' and exp_avg_sqs' addresses
    (4 x T int64), ``block_tensor`` / ``block_start`` each block's tensor and first element; ``G_KIND``: the
    gradients' dtype, 0 fp32, 1 bf16, 2 fp16 (``typed_pointer``)."""
    blk = tl.program_id(0)
    t = tl.load(block_tensor + blk)
    offs = tl.load(block_start + blk) + tl.arange(0, BLOCK)
    p_ptr = tl.load(ptrs + t).to(tl.pointer_type(tl.float32))
    g_ptr = typed_pointer(tl.load(ptrs + T + t), G_KIND)
    m_ptr = tl.load(ptrs + 2 * T + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(ptrs + 3 * T + t).to(tl.pointer_type(tl.float32))
    _adamw_block(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        factor_ptr,
        offs,
        tl.load(sizes + t),
        decay,
        beta1,
        beta2,
        step_size,
        inv_bc2_sqrt,
        eps,
        HAS_FACTOR,
        False,
        BLOCK,
    )


@triton.jit
def typed_pointer(addr, KIND: tl.constexpr):
    """An int64 address from a table as a pointer to ``KIND``'s dtype: 0 fp32, 1 bf16, 2 fp16 (literal dtypes in
    each branch, as Triton's grouped-GEMM tutorial casts its table's addresses)."""
    if KIND == 1:
        ptr = addr.to(tl.pointer_type(tl.bfloat16))
    elif KIND == 2:
        ptr = addr.to(tl.pointer_type(tl.float16))
    else:
        ptr = addr.to(tl.pointer_type(tl.float32))
    return ptr


@triton.jit
def _adamw_block(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    factor_ptr,
    offs,
    n,
    decay,
    beta1,
    beta2,
    step_size,
    inv_bc2_sqrt,
    eps,
    HAS_FACTOR: tl.constexpr,
    AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The step on elements ``offs`` (those below ``n``) of one tensor; returns the block's parameters after it
    (0 past ``n``; where the step is skipped, as they were, read only with ``AMAX``)."""
    inside = offs < n
    mask = inside
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_FACTOR:
        factor = tl.load(factor_ptr)
        g = g * factor
        # NaN or inf (x - x is NaN) skips the step; compared as a block (the interpreter cannot AND a scalar)
        mask = mask & (tl.zeros([BLOCK], tl.float32) + (factor - factor) == 0.0)
    if AMAX:  # the parameters a skipped step leaves are still read for their amax
        p_old = tl.load(p_ptr + offs, mask=inside, other=0.0)
    else:
        p_old = tl.load(p_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p_old * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) * inv_bc2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    return tl.where(mask, p, p_old)


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
    amax=None,
) -> None:
    """In place on param, exp_avg, exp_avg_sq (fp32, contiguous, one shape); ``step`` counts from 1. ``amax`` (one
    fp32 element): raised to the largest |param| after the step (before it where a non-finite factor skips it)."""
    check(param, grad, exp_avg, exp_avg_sq, grad_factor)
    if amax is not None:
        check_tensor("amax", amax, dtypes=(torch.float32,), device=param.device)
        if amax.numel() != 1:
            raise ValueError(f"amax: expected one element, got shape {tuple(amax.shape)}")
    n = param.numel()
    if n == 0:
        return
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        grad_factor if grad_factor is not None else param,
        amax if amax is not None else param,
        n,
        *_scalars(lr, beta1, beta2, eps, weight_decay, step),
        HAS_FACTOR=grad_factor is not None,
        AMAX=amax is not None,
        BLOCK=BLOCK,
        num_warps=8,
    )


def _scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> tuple:
    """The kernels' scalar arguments: decay, beta1, beta2, bias-corrected step size, 1 / sqrt(bias correction 2),
    eps."""
    if step < 1:
        raise ValueError(f"step: {step}, expected >= 1 (the count including this step)")
    return (
        1.0 - lr * weight_decay,
        beta1,
        beta2,
        lr / (1.0 - beta1**step),
        1.0 / math.sqrt(1.0 - beta2**step),
        eps,
    )


_GRAD_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_BLOCK_TABLES: dict = {}  # (tensor sizes, device) -> (block_tensor, block_start, sizes) on the device
# (addresses, sizes, grad dtype) -> the device's table of addresses: an optimizer's tensors keep their memory from
# step to step, so the checks and the copy run once (recent sets: gradients freed and reallocated can move)
_POINTERS: dict = {}
_POINTER_SETS = 64  # per-layer parameter groups each launch their own set


def _block_tables(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each block's tensor index and first element for tensors of ``sizes``, built once per set of sizes."""
    key = (sizes, str(device))
    if key not in _BLOCK_TABLES:
        counts = torch.tensor([triton.cdiv(n, BLOCK) for n in sizes])
        which = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), counts)
        first = torch.cumsum(counts, 0) - counts  # each tensor's first block
        start = (torch.arange(len(which)) - first[which.long()]) * BLOCK
        sizes_t = torch.tensor(sizes, dtype=torch.int64)
        _BLOCK_TABLES[key] = tuple(x.to(device) for x in (which, start.to(torch.int64), sizes_t))
    return _BLOCK_TABLES[key]


def _tables(params, grads, exp_avgs, exp_avg_sqs, grad_factor) -> tuple[torch.Tensor, ...]:
    """The kernel's tables for these lists: the 4 x T addresses on the device, each block's tensor and first element,
    the sizes. The lists are checked when their addresses, sizes or gradient dtype are new (the per-step host time
    at ~110 tensors was most of a 125M model's step: bench/optimizer.py)."""
    if grad_factor is not None:
        check_tensor("grad_factor", grad_factor, dtypes=(torch.float32,), device=params[0].device)
    addresses = tuple(t.data_ptr() for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts)
    sizes = tuple(p.numel() for p in params)
    # contiguity in the key: a transposed view has its tensor's address
    contiguous = all(t.is_contiguous() for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts)
    key = (addresses, sizes, contiguous, grads[0].dtype, params[0].device)
    ptrs = _POINTERS.get(key)
    if ptrs is None:
        _check_lists(params, grads, exp_avgs, exp_avg_sqs, grad_factor)
        host = torch.tensor(addresses, dtype=torch.int64).pin_memory() if params[0].is_cuda else None
        ptrs = host.to(params[0].device, non_blocking=True) if host is not None else torch.tensor(addresses)
        if len(_POINTERS) >= _POINTER_SETS:
            _POINTERS.pop(next(iter(_POINTERS)))
        _POINTERS[key] = ptrs
    return (ptrs, *_block_tables(sizes, params[0].device))


def _check_lists(params, grads, exp_avgs, exp_avg_sqs, grad_factor) -> None:
    """fp32 params and moments, grads of one dtype, one device, contiguous, one size per index."""
    check(params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], grad_factor)  # dtypes and device, from the first
    device, g_dtype = params[0].device, grads[0].dtype
    for i, group in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        n = group[0].numel()
        for name, t in zip(("param", "grad", "exp_avg", "exp_avg_sq"), group):
            check_tensor(f"{name} {i}", t)  # a tensor subclass without an address of its own
            wanted = g_dtype if name == "grad" else torch.float32
            if t.numel() != n or t.dtype != wanted or t.device != device or not t.is_contiguous():
                raise ValueError(
                    f"{name} {i}: {t.numel()} elements of {t.dtype} on {t.device} (contiguous: "
                    f"{t.is_contiguous()}), expected {n} contiguous of {wanted} on {device}"
                )


def adamw_multi_step(
    params: list,
    grads: list,
    exp_avgs: list,
    exp_avg_sqs: list,
    grad_factor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """``adamw_step`` on every tensor of the lists in one launch: fp32 params and moments, grads of one dtype, all
    on one device and contiguous, one shape per index; ``step`` is all of theirs."""
    if not params:
        return
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError(
            f"params {len(params)}, grads {len(grads)}, exp_avgs {len(exp_avgs)}, exp_avg_sqs "
            f"{len(exp_avg_sqs)}: one list length"
        )
    ptrs, block_tensor, block_start, sizes_t = _tables(params, grads, exp_avgs, exp_avg_sqs, grad_factor)
    if len(block_tensor) == 0:
        return
    g_dtype = grads[0].dtype
    _adamw_multi_kernel[(len(block_tensor),)](
        ptrs,
        block_tensor,
        block_start,
        sizes_t,
        grad_factor if grad_factor is not None else params[0],
        len(params),
        *_scalars(lr, beta1, beta2, eps, weight_decay, step),
        G_KIND=_GRAD_KIND[g_dtype],
        HAS_FACTOR=grad_factor is not None,
        BLOCK=BLOCK,
        num_warps=8,
    )
