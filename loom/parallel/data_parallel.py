"""Data parallelism: FSDP2 (``fully_shard``, also HSDP on a 2-D mesh) and DDP."""

from __future__ import annotations

import torch
from torch import nn

from loom.models.common.moe import moe_modules


def mixed_precision_policy(compute_dtype: torch.dtype):
    """FSDP2 policy: parameters gathered in the compute dtype, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def offload_policy(mesh, cpu_offload: bool):
    """FSDP2's offload policy: with ``cpu_offload`` the shards and their gradients live on the host, pinned where
    the mesh is on CUDA (copies to and from the GPU run asynchronously only from pinned memory)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    mesh,
    *,
    compute_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool,
) -> nn.Module:
    """Shard each block, then the root (embeddings, final norm, head). ``mesh`` is 1-D (FSDP) or 2-D (HSDP), of
    one rank for CPU offload alone (nothing is sharded: FSDP2 streams each block's parameters to the device)."""
    from torch.distributed.fsdp import fully_shard

    kw = dict(
        mesh=mesh,
        mp_policy=mixed_precision_policy(compute_dtype),
        offload_policy=offload_policy(mesh, cpu_offload),
    )
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    # the root's parameters are used last in forward and first in backward: never reshard them
    fully_shard(model, reshard_after_forward=False, **kw)
    return model


def apply_fsdp_experts(
    model: nn.Module,
    mesh,
    *,
    compute_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool = False,
) -> None:
    """Under expert parallelism: shard each MoE block's experts over ``mesh`` (the ranks holding the same
    experts), before the blocks are sharded (their fully_shard then leaves these parameters alone). Their
    reduction averages over ``mesh`` while the other gradients average over every data-parallel rank: the
    trainer rescales them (``ParallelDims.expert_grad_factor``)."""
    from torch.distributed.fsdp import fully_shard

    for moe in moe_modules(model):
        fully_shard(
            moe.experts,
            mesh=mesh,
            mp_policy=mixed_precision_policy(compute_dtype),
            reshard_after_forward=reshard_after_forward,
            offload_policy=offload_policy(mesh, cpu_offload),
        )


def apply_ddp(model: nn.Module, mesh, *, bucket_mb: float) -> nn.Module:
    """DDP over a 1-D mesh; gradient buckets all-reduce while backward runs. Call after materializing."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None if model_device(model).type == "cpu" else [model_device(model)]
    return DistributedDataParallel(
        model,
        process_group=mesh.get_group(),
        bucket_cap_mb=bucket_mb,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
    )


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
