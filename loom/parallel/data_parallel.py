"""Data parallelism: FSDP2 (``fully_shard``, also HSDP on a 2-D mesh) and DDP."""

from __future__ import annotations

import torch
from torch import nn

from loom.models.common.moe import moe_modules
from loom.parallel.gather_copy import use_gather_copy
from loom.parallel.grad_copy import use_grad_copy
from loom.parallel.symm_mem import use_symm_mem
from loom.parallel.vocab_embedding import VocabShardedEmbedding


def mixed_precision_policy(compute_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32):
    """FSDP2 policy: parameters gathered in the compute dtype, gradients reduced in ``reduce_dtype``
    (parallel.reduce_dtype: fp32 by default)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)


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
    explicit_prefetch: bool = False,
    reduce_dtype: torch.dtype = torch.float32,
    symm_mem: bool = False,
    grad_copy: str = "torch",
    device: torch.device | None = None,
    vocab_embedding: bool = False,
    gather_copy: str = "torch",
) -> nn.Module:
    """Shard each block; then, where ``head_units`` allows, the embedding (resharded after forward as the blocks)
    and the final norm with the head (kept gathered: backward starts there), so the head's gradients are reduced
    while the blocks' backward runs rather than at its end; then the root (what is left). ``mesh`` is 1-D (FSDP) or
    2-D (HSDP), of one rank for CPU offload alone (nothing is sharded: FSDP2 streams each block's parameters to
    the device). ``explicit_prefetch`` (parallel.fsdp_prefetch; by default under expert parallelism):
    ``prefetch_in_order``. ``symm_mem`` (parallel.fsdp_symm_mem): every FSDP2 unit's collective buffers, the
    experts' too, in NCCL symmetric memory. ``grad_copy`` (parallel.fsdp_grad_copy) ``triton``, or ``auto`` on a
    CUDA ``device``: the gradients' copy into the reduce-scatter buffer by loom's kernel (loom.parallel.grad_copy).
    ``vocab_embedding`` (parallel.fsdp_embedding resolved to vocab: loom.parallel.vocab_embedding_rules): the
    embedding split by rows over ``mesh`` instead of an FSDP2 unit (loom.parallel.vocab_embedding), where this part
    holds it. ``gather_copy`` (parallel.fsdp_gather_copy):
    ``fused`` casts the shards straight into the all-gather buffer (loom.parallel.gather_copy)."""
    from torch.distributed.fsdp import fully_shard

    kw = dict(
        mesh=mesh,
        mp_policy=mixed_precision_policy(compute_dtype, reduce_dtype),
        offload_policy=offload_policy(mesh, cpu_offload),
    )
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    embed, head = head_units(model)
    split = vocab_embedding and embed is not None
    if split:
        model.tok_embeddings = embed = VocabShardedEmbedding(embed, mesh, compute_dtype)
    elif embed is not None:
        fully_shard(embed, reshard_after_forward=reshard_after_forward, **kw)
    if head:
        fully_shard(head, reshard_after_forward=False, **kw)
    # the root's parameters are used last in forward and first in backward: never reshard them
    fully_shard(model, reshard_after_forward=False, ignored_params={embed.weight} if split else None, **kw)
    if explicit_prefetch:
        prefetch_in_order(model, blocks, None if split else embed, head)
    if symm_mem:
        use_symm_mem(model)
    use_grad_copy(grad_copy, device)
    use_gather_copy(gather_copy)
    return model


def head_units(model: nn.Module) -> tuple[nn.Module | None, list[nn.Module]]:
    """(the embedding, [final norm, head]) to shard as units of their own, each None / empty where it stays in
    the root: tied embeddings (one weight for both), multi-token prediction (its modules embed and project again
    after the blocks), a pipeline stage without them."""
    embed, norm, output = (getattr(model, n, None) for n in ("tok_embeddings", "norm", "output"))
    if getattr(model, "mtp", None) is not None:
        return None, []
    if embed is not None and output is not None and output.weight is embed.weight:
        return None, []
    return embed, [m for m in (norm, output) if m is not None] if output is not None else []


def prefetch_in_order(
    model: nn.Module, blocks: list[nn.Module], embed: nn.Module | None, head: list[nn.Module]
) -> None:
    """Each unit all-gathers the next one's parameters when its own forward starts (in backward the previous
    one's), a MoE block's experts with it: the next gather hides behind this unit's compute even where the host is
    not ahead of the GPU, as under expert parallelism, where every MoE block waits on the host for its token
    counts and the next unit's gather, issued implicitly when the host reaches it, would start too late."""
    from torch.distributed.fsdp import FSDPModule

    def with_experts(block: nn.Module) -> list[nn.Module]:
        return [block] + [m.experts for m in moe_modules(block) if isinstance(m.experts, FSDPModule)]

    if not blocks:
        return
    (embed if embed is not None else model).set_modules_to_forward_prefetch(with_experts(blocks[0]))
    for block, nxt in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch(with_experts(nxt))
    if head:
        blocks[-1].set_modules_to_forward_prefetch([head[-1]])
        head[-1].set_modules_to_backward_prefetch(with_experts(blocks[-1]))
    for block, prev in zip(blocks[1:], blocks):
        block.set_modules_to_backward_prefetch(with_experts(prev))


def apply_fsdp_experts(
    model: nn.Module,
    mesh,
    *,
    compute_dtype: torch.dtype,
    reshard_after_forward: bool,
    cpu_offload: bool = False,
    reduce_dtype: torch.dtype = torch.float32,
    grad_factor: float = 1.0,
) -> None:
    """Under expert parallelism: shard each MoE block's experts over ``mesh`` (the ranks holding the same
    experts), before the blocks are sharded (their fully_shard then leaves these parameters alone). Their
    gradients sum over ``mesh`` while the others average over every data-parallel rank, so their reduction
    divides by ``mesh.size() / grad_factor`` (``ParallelDims.expert_grad_factor``) instead of ``mesh.size()``:
    the collectives sum and FSDP2 divides the shard after, on every backend alike (NCCL could scale inside the
    reduce-scatter, but then GPUs would run a path the gloo tests never do). Nothing rescales them after the backward
    (as torchtitan: a pass over every expert gradient saved)."""
    from torch.distributed.fsdp import fully_shard

    for moe in moe_modules(model):
        fully_shard(
            moe.experts,
            mesh=mesh,
            mp_policy=mixed_precision_policy(compute_dtype, reduce_dtype),
            reshard_after_forward=reshard_after_forward,
            offload_policy=offload_policy(mesh, cpu_offload),
        )
        moe.experts.set_gradient_divide_factor(mesh.size() / grad_factor)
        # a shard dim of one rank reduce-scatters nothing and divides by itself; forcing the sum there would divide
        # twice (torch 2.11-2.13: the one-rank copy divides, then the post-divide), which the gloo tests caught
        if mesh.size(mesh.ndim - 1) > 1:
            moe.experts.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: nn.Module, mesh, *, bucket_mb: float) -> nn.Module:
    """DDP over a 1-D mesh; gradient buckets all-reduce while backward runs. Call after materializing. No buffer
    broadcast before each forward: loom's buffers are recomputed alike on every rank (RoPE tables), kept equal by
    loom (the selection biases) or are each rank's own (a compiled MoE block's load count, summed over the ranks at
    the bias update), which rank 0's copy would overwrite."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None if model_device(model).type == "cpu" else [model_device(model)]
    return DistributedDataParallel(
        model,
        process_group=mesh.get_group(),
        bucket_cap_mb=bucket_mb,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
        broadcast_buffers=False,
    )


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
