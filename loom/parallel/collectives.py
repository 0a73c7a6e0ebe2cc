"""Collectives inside the model's forward, with their backward: gathering rows over a group (backward: the
gradients summed and scattered back) and the reverse.

Eager: blocking c10d collectives in autograd functions. Under torch.compile: PyTorch's functional collectives,
which Dynamo traces and Inductor waits for. Eagerly the functional ones run asynchronously and are waited for
on first use, which corrupted gloo ranks' memory now and then (docs/parallelism.md), so eager code does not use
them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherRows(torch.autograd.Function):
    """Rows of ``x`` (T, ...) from every rank of ``group``, in rank order -> (size T, ...); backward: the rows'
    gradients summed over the ranks, each rank keeping its own (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _blocking_gather(x, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ScatterRowsSum.apply(grad, ctx.group, ctx.size), None, None


class _ScatterRowsSum(torch.autograd.Function):
    """``x`` (size T, ...) summed over the ranks of ``group``, rank r keeping rows [r T, (r + 1) T) -> (T, ...);
    backward: the gathered gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        out = x.new_empty(x.shape[0] // size, *x.shape[1:])
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _GatherRows.apply(grad, ctx.group, ctx.size), None, None


def _blocking_gather(x: torch.Tensor, group, size: int) -> torch.Tensor:
    out = x.new_empty(size * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def gather_rows(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(T, ...) on each of the ``size`` ranks of ``group`` -> (size T, ...), rows in rank order; differentiable
    (backward: reduce-scatter) when ``x`` requires grad."""
    from torch.distributed import _functional_collectives as fc

    if not torch.compiler.is_compiling():
        return _GatherRows.apply(x, group, size) if x.requires_grad else _blocking_gather(x, group, size)
    if not x.requires_grad:
        gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
        return fc.wait_tensor(gather(x, 0, group))
    # newer torch renamed them (*_single*) and warns on the old names; the package accepts torch >= 2.11
    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
    return gather(x, 0, group)


def gather_along(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """``gather_rows`` along ``dim``: (..., n, ...) -> (..., size n, ...), rank r's part at [r n, (r + 1) n)."""
    if dim == 0:
        return gather_rows(x, group, size)
    return gather_rows(x.movedim(dim, 0), group, size).movedim(0, dim).contiguous()


def reduce_scatter_rows(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(size T, ...) partial sums on each rank -> (T, ...): the sum over the ranks of this rank's rows;
    differentiable (backward: all-gather)."""
    if not torch.compiler.is_compiling():
        return _ScatterRowsSum.apply(x, group, size)
    from torch.distributed import _functional_collectives as fc

    scatter = getattr(fc, "reduce_scatter_single_autograd", None) or fc.reduce_scatter_tensor_autograd
    return scatter(x, "sum", 0, group)
