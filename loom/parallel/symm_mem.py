"""FSDP2's collective buffers in NCCL symmetric memory (``parallel.fsdp_symm_mem``). With NCCL's zero-CTA policy
(loom.runtime.env sets it) an all-gather into a registered buffer runs on the GPU's copy engines within a node, so
the matmuls it overlaps keep every SM; a reduce-scatter between registered buffers runs NCCL's symmetric kernels.
FSDP2's own switch (``set_symm_mem_for_comm``) where this PyTorch has it; on 2.11, which lacks it, the same recipe
through FSDP2's custom-communication hooks: the buffers drawn from symmetric memory's pool, registered with the
group before each collective (NCCL caches the registration of a reused buffer)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


def available() -> bool:
    """Whether this PyTorch can place FSDP2's buffers in symmetric memory (its own switch, or the custom hooks)."""
    from torch.distributed.fsdp import FSDPModule

    return any(hasattr(FSDPModule, name) for name in ("set_symm_mem_for_comm", "set_custom_all_gather"))


def use_symm_mem(model: nn.Module) -> None:
    """Every FSDP2 unit of ``model`` (a MoE block's experts too) gathers and reduces in symmetric memory."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if hasattr(FSDPModule, "set_symm_mem_for_comm"):
        for unit in units:
            unit.set_symm_mem_for_comm()
        return
    symm_mem.set_backend("NCCL")
    gather, reduce = SymmMemGather(), SymmMemReduce()
    groups = {}
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is None:  # a unit whose parameters all belong to units below it
            continue
        for pg in (group._all_gather_process_group, group._reduce_scatter_process_group):
            groups[pg.group_name] = pg
        unit.set_custom_all_gather(gather)
        unit.set_custom_reduce_scatter(reduce)
    for pg in groups.values():  # each communicator formed before the first registration asks for it
        dist.barrier(group=pg)


def _allocate(size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
        return torch.empty(size, dtype=dtype, device=device)


class SymmMemGather(AllGather):
    """The output registered (the input is a slice of it: FSDP2 gathers in place), then NCCL's all-gather."""

    def allocate(self, size, *, dtype, device):
        return _allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        symm_mem.rendezvous(output_tensor, group=group.group_name)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class SymmMemReduce(ReduceScatter):
    """Both buffers registered, then NCCL's reduce-scatter."""

    def allocate(self, size, *, dtype, device):
        return _allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        symm_mem.rendezvous(input_tensor, group=group.group_name)
        symm_mem.rendezvous(output_tensor, group=group.group_name)
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
