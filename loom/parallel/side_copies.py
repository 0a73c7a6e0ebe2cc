"""FSDP2's two per-unit copies off the compute stream (``parallel.fsdp_side_copies``). FSDP2 runs both on it, so
the step waits for each: the gathered parameters' copy-out into each parameter's storage (before the unit's
forward) and the gradients' copy-in to the reduce-scatter buffer (after its backward); ~9 and ~12 ms of an 8B
step on 2 H200s. Here the copy-out runs on the all-gather stream right after the gather (on CUDA as copy-engine
copies, one per parameter and rank, so no SM is taken from the matmuls it overlaps), and the copy-in on the
reduce-scatter stream before the reduce-scatter; the compute stream waits only for their events. The same bytes
to the same places: the same numbers. FSDP2 looks both functions up in its modules' globals, which this sets,
process-wide; units it does not fit (a parameter sharded on another dim, an asynchronous gather) keep FSDP2's."""

from __future__ import annotations

import inspect
import weakref

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

KINDS = ("none", "gather", "reduce", "both")
_TORCH_GATHER = param_group.foreach_all_gather
_TORCH_COPY_OUT = param_group.foreach_all_gather_copy_out
_TORCH_REDUCE = param_group.foreach_reduce
_REDUCE_STREAM = inspect.signature(_TORCH_REDUCE).parameters
_COPIED: dict[
    int, weakref.ref
] = {}  # all-gather outputs (by id) whose copy-out already ran on the gather stream
_reduce_stream: list = []  # the reduce-scatter stream of the reduction running now
_inner_copy_in = [collectives.foreach_reduce_scatter_copy_in]


def use_side_copies(kind: str) -> None:
    """Every FSDP2 unit of this process runs ``kind``'s copies off the compute stream (``none``: FSDP2's own).
    Call after loom.parallel.grad_copy.use_grad_copy: the gradients' copy keeps the kernel that chose."""
    gather, reduce = kind in ("gather", "both"), kind in ("reduce", "both")
    param_group.foreach_all_gather = gather_then_copy_out if gather else _TORCH_GATHER
    param_group.foreach_all_gather_copy_out = copy_out_or_wait if gather else _TORCH_COPY_OUT
    param_group.foreach_reduce = reduce_on_its_stream if reduce else _TORCH_REDUCE
    current = collectives.foreach_reduce_scatter_copy_in
    if current is not copy_in_on_reduce_stream:
        _inner_copy_in[0] = current
    collectives.foreach_reduce_scatter_copy_in = copy_in_on_reduce_stream if reduce else _inner_copy_in[0]


def gather_then_copy_out(fsdp_params, group, async_op, copy_in_stream, gather_stream, device, comm):
    """FSDP2's ``foreach_all_gather``, then its copy-out on the gather stream; the result's event is the copy's."""
    result = _TORCH_GATHER(fsdp_params, group, async_op, copy_in_stream, gather_stream, device, comm)
    if result is None or async_op or any(p.fsdp_placement.dim != 0 for p in fsdp_params):
        return result
    handle = collectives._get_device_handle(device.type)
    compute, world = handle.current_stream(), group.size()
    with handle.stream(gather_stream):
        outs = []
        for numels, dtypes, p in zip(
            result.param_all_gather_input_numels, result.param_all_gather_input_dtypes, fsdp_params
        ):
            p.init_all_gather_outputs(numels, dtypes, world, device)
            p.alloc_all_gather_outputs()
            outs.extend(p.all_gather_outputs)
        copy_out(result.all_gather_output, result.all_gather_input_split_sizes, outs, world)
        for t in outs:
            if t.is_cuda:  # allocated here, read and freed on the compute stream
                t.record_stream(compute)
        event = gather_stream.record_event()
    _COPIED[id(result.all_gather_output)] = weakref.ref(result.all_gather_output)
    return result._replace(all_gather_event=event)


def copy_out(gathered: torch.Tensor, sizes: list[int], outs: list[torch.Tensor], world: int) -> None:
    """Rank r's ``sizes[i]`` elements at each parameter's offset of ``gathered`` into row r of ``outs[i]``
    (FSDP2's ``split_with_sizes_copy`` along dim 1): contiguous copies, each a copy-engine copy on CUDA."""
    src = gathered.view(world, -1)
    views = [
        t.view(world, -1).view(torch.uint8) if src.dtype == torch.uint8 else t.view(world, -1) for t in outs
    ]
    live = tuple(v for v in views if not v.is_inference())
    with torch.autograd._unsafe_preserve_version_counter(live):
        offset = 0
        for size, dst in zip(sizes, views):
            for r in range(world):
                dst[r].copy_(src[r, offset : offset + size])
            offset += size


def copy_out_or_wait(result, fsdp_params, group) -> None:
    """FSDP2's ``foreach_all_gather_copy_out``, or, where the gather stream already copied, a wait for it."""
    ref = _COPIED.pop(id(result.all_gather_output), None)
    if ref is not None and ref() is result.all_gather_output:
        handle = collectives._get_device_handle(result.all_gather_output.device.type)
        handle.current_stream().wait_event(result.all_gather_event)
        return
    _TORCH_COPY_OUT(result, fsdp_params, group)


def reduce_on_its_stream(*args, **kwargs):
    """FSDP2's ``foreach_reduce``, its reduce-scatter stream known to the copy-in it calls."""
    stream = _stream_argument(args, kwargs)
    _reduce_stream.append(stream)
    try:
        return _TORCH_REDUCE(*args, **kwargs)
    finally:
        _reduce_stream.pop()


def _stream_argument(args, kwargs):
    if "reduce_scatter_stream" in kwargs:
        return kwargs["reduce_scatter_stream"]
    return args[list(_REDUCE_STREAM).index("reduce_scatter_stream")]


def copy_in_on_reduce_stream(grads: list[torch.Tensor], out: torch.Tensor, world_size: int) -> None:
    """The gradients' copy-in (the kernel grad_copy chose) on the reduce-scatter stream, after the compute stream
    wrote them; each gradient held until that stream has read it (FSDP2 frees them right after)."""
    if not _reduce_stream:
        return _inner_copy_in[0](grads, out, world_size)
    stream = _reduce_stream[-1]
    handle = collectives._get_device_handle(out.device.type)
    stream.wait_stream(handle.current_stream())
    with handle.stream(stream):
        _inner_copy_in[0](grads, out, world_size)
    for g in grads:
        if g.is_cuda:
            g.record_stream(stream)
