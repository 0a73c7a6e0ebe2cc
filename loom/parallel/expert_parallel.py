"""Expert parallelism: the experts of every MoE block split over the ``ep`` mesh axis, tokens sent to them.

``ep`` consecutive ranks of ``dp_shard x cp`` (the FSDP shard ranks) each hold ``n_experts / ep`` experts (their stacked
weights become DTensors sharded on dim 0 over ``ep``, so checkpoints reshard to any layout). After routing,
each rank sends every token-slot to the rank holding its expert (one uneven ``all_to_all_single`` over the
ep group, whose backward is the reverse exchange), the receiving rank runs its local experts on what it got
from every rank (grouped by expert), and the outputs travel back the same way; the MoE module then combines
them as on one device. The ranks holding the same experts (``edp = dp_shard x cp / ep``, times dp_replicate)
shard them with FSDP2 (``loom.parallel.data_parallel.apply_fsdp_experts``). An expert's gradient already sums
the tokens of the whole ep group before FSDP2 averages it over those edp x dp_replicate ranks, while every
other gradient is averaged over all dp_replicate x dp_shard x cp ranks: the trainer multiplies expert gradients by
``ParallelDims.expert_grad_factor`` (1 / ep; tp / ep when the ep ranks take in the tp ranks, which hold
slices of the same samples) after the backward so both carry the same token-sum semantics (FSDP2's own
divide factor would do it inside the reduction, but needs a PREMUL_SUM reduction gloo lacks).

Under tensor parallelism (torchtitan's etp = 1) the ep ranks include the tp ranks: each tp rank routes the
tokens of its own sequence slice and exchanges them with every ep rank; the experts are not replicated over
tp (``loom.parallel.tensor_parallel`` leaves them to this module). With etp = tp the ep ranks are
data-parallel ranks only and each expert is also sharded over tp by its hidden width: every tp rank sends the
tp group's gathered tokens to its own ep peers (the same tp coordinate), and the MoE block sums the tp ranks'
partial outputs (``loom.models.common.moe``).

Applied by ``apply_expert_parallel(model, ep_mesh)`` after the model is built on the meta device; the model
code stays single-device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.collectives import gather_rows, reduce_scatter_rows


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` (R, E) exchanged over ``group``: ``send[i]`` rows go to rank i, ``recv[i]`` come from it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, send, recv, group)


class ExpertTensorParallel:
    """The tp group of a MoE block whose experts are sharded over tp by hidden width (parallel.etp = tp): gathers
    the group's token rows before the experts and sums the partial outputs back (loom.models.common.moe), through
    ``loom.parallel.collectives``."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (size T, ...), rows in rank order; integer tensors carry no gradient."""
        return gather_rows(x, self.group, self.size)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(size T, ...) partial sums -> (T, ...): the sum over the ranks of this rank's rows."""
        return reduce_scatter_rows(x, self.group, self.size)


class ExpertParallel:
    """Runs a MoE block's experts across the ep group; see the module docstring."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    @torch.compiler.disable  # the exchange's sizes are read on the host: compiled blocks break around it
    def run(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (T k, E): this rank's token-slots grouped by (global) expert, ``counts`` (n,) of them per expert ->
        the experts' outputs, same rows."""
        n_local = counts.numel() // self.size
        send_counts = counts.view(self.size, n_local)  # (ep, n_local): to rank i, per expert of rank i
        recv_counts = torch.empty_like(send_counts)  # (ep, n_local): from rank i, per local expert
        dist.all_to_all_single(recv_counts.view(-1), send_counts.reshape(-1), group=self.group)
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        got = all_to_all(x, send, recv, self.group)  # (R, E): per source rank, grouped by local expert
        expert = torch.arange(n_local, device=x.device).repeat(self.size)  # the local expert of each block
        order = torch.repeat_interleave(expert, recv_counts.reshape(-1)).argsort(stable=True)  # by expert
        out = experts(got[order], recv_counts.sum(0))  # (R, E) grouped by local expert
        back = torch.empty_like(out).index_copy_(0, order, out)  # (R, E) per source rank again
        return all_to_all(back, recv, send, self.group)  # (T k, E)


def apply_expert_parallel(model: nn.Module, ep_mesh, ep_tp_mesh=None) -> None:
    """Shard the experts of every MoE block of ``model`` (a model or a pipeline stage) over ``ep_mesh`` and
    give the blocks the ep group. ``ep_tp_mesh`` (parallel.etp = tp): the (ep, tp) mesh the experts are then
    sharded over, by expert and by hidden width. Call on the meta device, after TP, before FSDP2."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from loom.models.common.moe import moe_modules
    from loom.parallel.tensor_parallel import shard_experts

    ep = ExpertParallel(ep_mesh.get_group(), ep_mesh.size())
    for moe in moe_modules(model):
        if ep_tp_mesh is not None:
            shard_experts(moe.experts, ep_tp_mesh, placements_before=(Shard(0),))
        else:
            for name in ("w1", "w2", "w3"):
                p = getattr(moe.experts, name)
                setattr(moe.experts, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]),
                                                        requires_grad=p.requires_grad))
        moe.expert_parallel = ep


def expert_params(parts: list[nn.Module]) -> list[nn.Parameter]:
    """The expert weights of every MoE block of ``parts``."""
    from loom.models.common.moe import moe_modules

    return [p for part in parts for moe in moe_modules(part) for p in moe.experts.parameters()]

