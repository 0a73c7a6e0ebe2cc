"""Gradient norm over every shard, clipping, and unscaling."""

from __future__ import annotations

import torch

from loom.parallel.pipeline import last_stage_embeds, stage_rank
from loom.parallel.shards import local_tensor

_NORM_KERNEL = ["torch"]  # training.grad_norm_kernel, set for the process by ``use_norm_kernel``


def use_norm_kernel(kind: str) -> None:
    """``global_grad_norm`` sums sharded gradients on CUDA with ``kind``'s kernel from now on (training.grad_norm_kernel:
    ``triton`` loom's ``sharded_sum_squares``, ``torch`` PyTorch's norm)."""
    _NORM_KERNEL[0] = kind


def global_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The true L2 norm of the full gradient, whatever the sharding (a 0-dim fp32 tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=params[0].device if params else None)
    norms = []
    for group in by_mesh(
        grads
    ):  # DTensor norms reduce over their own mesh (experts and the rest differ under ep)
        on_cuda = group[0].device.type == "cuda"
        sq = sharded_sum_squares(group) if on_cuda and _NORM_KERNEL[0] == "triton" else None
        if (
            sq is not None
        ):  # loom's one-launch sum of squares on the local shards (foreach: ~one launch a tensor)
            norms.append(sq.sqrt())
            continue
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, error_if_nonfinite=False, foreach=True)
        if hasattr(norm, "full_tensor"):  # DTensor grads: partial norms are reduced across their mesh
            norm = norm.full_tensor()
        norms.append(norm.float())
    return norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()


def sharded_sum_squares(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The sum of squares of every element of ``grads`` (DTensors on one mesh), whatever their sharding: each rank's
    local shards through ``loom::sum_squares`` (on CUDA one launch per dtype, not PyTorch's foreach norm's launch per
    few tensors), summed over the mesh dims they are sharded on, once per placement. None where a gradient is not a
    DTensor or holds a pending sum (Partial): the caller takes PyTorch's norm there."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from loom.kernels.sum_squares.op import sum_squares

    by_placement: dict = {}
    for g in grads:
        if not isinstance(g, DTensor) or any(p.is_partial() for p in g.placements):
            return None
        by_placement.setdefault(tuple(g.placements), []).append(g._local_tensor.contiguous())
    mesh, total = grads[0].device_mesh, None
    for placements, shards in by_placement.items():
        sq = sum_squares(shards)
        for dim, placement in enumerate(placements):
            if placement.is_shard() and mesh.size(dim) > 1:
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total = sq if total is None else total + sq
    return total


@torch.no_grad()
def scale_grads(params: list[torch.nn.Parameter], factor: float | torch.Tensor) -> None:
    """Multiply every gradient by ``factor`` in place, shard by shard: a scale is linear, so it holds for any
    placement (sharded, replicated, partial), and the local shards skip DTensor's dispatch (its sharding
    propagation missed its cache on every step here: a tenth of a tiny TP x EP step on the host)."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by DTensor mesh (plain tensors together): under expert parallelism the experts live
    on another mesh than the rest, and DTensor ops (foreach, norms) take one mesh at a time."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)
    return list(groups.values())


def unique_params(parts) -> list[torch.nn.Parameter]:
    """Trainable parameters of all model parts, each once (a tied weight is one Parameter per part)."""
    seen, out = set(), []
    for part in parts:
        for p in part.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class TiedEmbeddingGrads:
    """The embedding the last pipeline stage reads too, a tied head's or multi-token prediction's (as Megatron does).

    The first stage's ``tok_embeddings.weight`` and the last stage's copy of it (held as
    ``tok_embeddings.weight`` too: loom.parallel.pipeline.build_stage) start equal; after each backward their gradients
    are summed, so the two optimizers take identical steps and the copies stay equal. The copies live
    on the first and last pp rank (an all-reduce over a two-rank embedding group per coordinate of the
    other axes), or both on pp rank 0 with V-shaped schedules (a local sum)."""

    def __init__(self, parts, plan, dims):
        self.copies = []  # this rank's copies: (stage, parameter)
        shared = last_stage_embeds(parts[0].args)
        if shared:
            self.copies = [
                (s, part.tok_embeddings.weight)
                for s, part in zip(plan.local, parts)
                if part.tok_embeddings is not None
            ]
        self.group = None
        first_rank, last_rank = 0, _rank_of_last(plan)
        if shared and first_rank != last_rank:
            self.group = _embedding_group(dims, first_rank, last_rank)

    def params_counted_once(self, parts) -> list[torch.nn.Parameter]:
        """This rank's parameters for the global norm: a last-stage copy of the tied weight is left out."""
        skip = {id(p) for s, p in self.copies if s != 0}
        return [p for p in unique_params(parts) if id(p) not in skip]

    @torch.no_grad()
    def sync(self) -> None:
        for _, p in self.copies:
            _match_param_placement(p)
        grads = [local_tensor(p.grad) for _, p in self.copies if p.grad is not None]
        if len(grads) == 2:  # both stages on this rank
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        if self.group is not None and grads:
            import torch.distributed as dist

            dist.all_reduce(grads[0], group=self.group)


def _match_param_placement(p: torch.nn.Parameter) -> None:
    """Give a DTensor gradient its parameter's placements (an embedding's gradient under TP can come back
    partial or replicated), so the local tensors of both copies hold the same rows."""
    g = p.grad
    if g is not None and hasattr(g, "placements") and tuple(g.placements) != tuple(p.placements):
        p.grad = g.redistribute(p.device_mesh, p.placements)


def _rank_of_last(plan) -> int:
    return stage_rank(plan.n_stages - 1, plan.pp, plan.schedule)


def _embedding_group(dims, first_rank: int, last_rank: int):
    """The two-rank group {pp = first, pp = last} that contains this rank (every rank creates all of them,
    as ``new_group`` requires; ranks in middle stages belong to none)."""
    import torch.distributed as dist

    ranks = dims.mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) global ranks
    pairs = torch.stack([ranks[first_rank].flatten(), ranks[last_rank].flatten()], dim=1).tolist()
    mine = None
    for pair in pairs:
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine
