"""FSDP2's all-gather copy-in in one pass (``parallel.fsdp_gather_copy fused``). Under mixed precision FSDP2 casts each
unit's fp32 shards into a temporary bf16 buffer, then copies that buffer into the all-gather's input: every step moves
the shards' bf16 bytes twice more than needed (16 GB of 40 a step for an 8B model's half on each of 2 GPUs). Here
the cast writes straight into the all-gather buffer: the same values in the same places, one foreach kernel, no
temporary. Units it does not fit (no mixed precision, CPU offload, a tensor subclass's own all-gather inputs such as
float8's, mixed param dtypes) keep FSDP2's own path."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import _get_device_handle
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

_TORCH = collectives.foreach_all_gather  # FSDP2's own
# PyTorch 2.11's FSDP2 checks it before its foreach path; 2.13's has no such check
_compiled_autograd = getattr(collectives, "compiled_autograd_enabled", lambda: False)


def use_gather_copy(kind: str) -> None:
    """Every FSDP2 unit of this process gathers through ``kind``'s copy-in: ``fused`` loom's one pass where it fits,
    ``torch`` FSDP2's own (FSDP2's parameter groups call the function their module imported, which this sets,
    process-wide)."""
    param_group.foreach_all_gather = fused_all_gather if kind == "fused" else _TORCH


def fits(fsdp_params) -> bool:
    """Shards that FSDP2 itself would cast by its foreach path, all to one dtype (not under compiled autograd, where
    PyTorch 2.11's FSDP2 takes its other path)."""
    return (
        bool(fsdp_params)
        and not _compiled_autograd()
        and all(
            p.param_dtype is not None
            and p.param_dtype == fsdp_params[0].param_dtype
            and not p.offload_to_cpu
            and not hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather")
            for p in fsdp_params
        )
    )


@torch.no_grad()
def fused_all_gather(*args, **kwargs):
    """FSDP2's ``foreach_all_gather`` (PyTorch 2.11-2.13's seven arguments, the same result), the shards cast into
    the buffer directly; FSDP2's own for any other call (another PyTorch's arguments) or units it does not fit."""
    if kwargs or len(args) != 7 or not fits(args[0]):
        return _TORCH(*args, **kwargs)
    fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device, all_gather_comm = args
    world, rank = group.size(), group.rank()
    dtype = fsdp_params[0].param_dtype
    streams = _get_device_handle(device.type)
    with streams.stream(all_gather_copy_in_stream):
        shards = [
            p._sharded_param_data
            if p.sharded_state == ShardedState.SHARDED
            else p._sharded_post_forward_param_data
            for p in fsdp_params
        ]
        numels = [t.numel() for t in shards]
        total = sum(numels)
        output = all_gather_comm.allocate((total * world,), dtype=dtype, device=device)
        mine = output.narrow(0, total * rank, total)
        torch._foreach_copy_(list(torch.split(mine, numels)), shards)
    all_gather_stream.wait_stream(all_gather_copy_in_stream)
    with streams.stream(all_gather_stream):
        work = all_gather_comm(output_tensor=output, input_tensor=mine, group=group, async_op=async_op)
        return collectives.AllGatherResult(
            output,
            all_gather_stream.record_event(),
            work,
            [[dtype] for _ in shards],
            [[n] for n in numels],
            numels,
        )
