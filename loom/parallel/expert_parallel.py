"""Mixture-of-experts blocks under loom's parallel layouts: ``MoEParallel``, the object each block's ``MoE.parallel``
becomes, and expert parallelism (the experts split over the ``ep`` mesh axis, tokens sent to them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loom.metrics.nvtx import nvtx_range
from loom.models.common.moe import MoE, inverse_permutation, moe_modules, permute
from loom.parallel.collectives import gather_rows, reduce_scatter_rows


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows of ``x`` exchanged over ``group`` (``send[i]`` to rank i, ``recv[i]`` from it) by the functional
    all-to-all, whose output op-level activation checkpointing saves (``_SAVE_OPS``): its recomputation in backward
    replays the exchange instead of sending the tokens again."""
    out = torch.ops._c10d_functional.all_to_all_single(x.contiguous(), recv, send, group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` (R, E) exchanged over ``group``: ``send[i]`` rows go to rank i, ``recv[i]`` come from it;
    NVTX range ``name`` around the exchange (``name.backward`` around the backward's) under metrics.nvtx."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group, name: str) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.name = send, recv, group, name
        with nvtx_range(name):
            return exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with nvtx_range(f"{ctx.name}.backward"):
            return exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None


def all_to_all(
    x: torch.Tensor, send: list[int], recv: list[int], group, name: str = "ep.all_to_all"
) -> torch.Tensor:
    return _AllToAll.apply(x, send, recv, group, name)


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """A MoE parameter as the plain tensor this rank computes with: a DTensor's local shard (under expert
    parallelism this rank's experts, under expert tensor parallelism its width slice). A placement Replicate
    means ranks that run different tokens (tensor parallelism's sequence slices: the router, and the experts when
    neither ep nor etp shards them): the local gradient is then Partial there, and DTensor sums it over them, as
    for sequence-parallel norms."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(w, DTensor):  # (not hasattr: under torch.compile that missed DTensor parameters)
        return w
    if not any(isinstance(p, Replicate) for p in w.placements):
        return w.to_local()
    return w.to_local(grad_placements=[Partial() if isinstance(p, Replicate) else p for p in w.placements])


class ExpertTensorParallel:
    """The tp group of MoE blocks whose experts are sharded over tp by hidden width (parallel.etp = tp): every tp
    rank runs the whole group's tokens through its width slice, so the token rows are gathered before the experts
    (rows in tp-rank order) and the partial outputs summed and scattered back after them: one all-gather and one
    reduce-scatter, each the other's backward (``loom.parallel.collectives``)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(T, ...) -> (size T, ...), rows in rank order; integer tensors carry no gradient."""
        return gather_rows(x, self.group, self.size)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """(size T, ...) partial sums -> (T, ...): the sum over the ranks of this rank's rows."""
        return reduce_scatter_rows(x, self.group, self.size)


class ExpertParallel:
    """Runs a MoE block's experts across the ep group. ``ep`` ranks each hold ``n_experts / ep`` experts (their
    stacked weights DTensors sharded on dim 0 over ``ep``, so checkpoints reshard to any layout); after routing,
    each rank sends every token-slot to the rank holding its expert, runs its local experts on what every rank
    sent (grouped by expert), and the outputs travel back the same way (each exchange's backward is the reverse
    one). The expert-gradient factor this needs: ``ParallelDims.expert_grad_factor``.

    ``exchange`` (parallel.ep_exchange): 'uneven' sends each rank's rows exactly, in an all-to-all sized on the
    host (one wait for the device per block); 'padded' sends a fixed block of C = T k rows (all of this rank's
    token-slots, the worst case) to every rank, real rows first, so nothing is read on the host, at ep times the
    bytes. Both assume every ep rank routes the same number of slots T k (loom's batches are fixed-shape)."""

    # split lists kept for recomputations (tiny tensors): past this, the oldest go (a recomputation that finds
    # none waits for the device again)
    KEPT = 1024

    def __init__(self, group, size: int, exchange: str = "uneven"):
        assert exchange in ("uneven", "padded"), exchange
        self.group, self.size, self.padded = group, size, exchange == "padded"
        # storage of a training forward's received counts -> (that tensor, send, recv): op-level activation
        # checkpointing replays the counts exchange in its recomputation (the same storage), which then reads its
        # split lists here instead of waiting for the device; holding the tensor keeps its storage from reuse
        self._splits: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        self.host_waits = 0  # how often the host has waited for split counts (tests, diagnostics)

    def host_splits(
        self, send_counts: torch.Tensor, recv_counts: torch.Tensor
    ) -> tuple[list[int], list[int]]:
        """(send, recv) row counts per rank, read on the host: one wait for the device, none in a recomputation
        that replays this forward's counts exchange."""
        key = recv_counts.untyped_storage().data_ptr()
        kept = self._splits.pop(key, None)
        if kept is not None:
            return kept[1], kept[2]
        send, recv = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        self.host_waits += 1
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:  # a forward, not in backward
            self._splits[key] = (recv_counts, send, recv)
            while len(self._splits) > self.KEPT:
                self._splits.pop(next(iter(self._splits)))
        return send, recv

    def run(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor, local=None) -> torch.Tensor:
        """x (T k, E): this rank's token-slots grouped by (global) expert, ``counts`` (n,) of them per expert ->
        the experts' outputs, same rows. ``local``: passed on to ``experts`` (``MoEParallel.local``)."""
        n_local = counts.numel() // self.size
        send_counts = counts.view(self.size, n_local)  # (ep, n_local): to rank i, per expert of rank i
        with nvtx_range("ep.counts"):
            equal = [n_local] * self.size
            # (ep, n_local): from rank i, per local expert
            recv_counts = exchange(send_counts.reshape(-1), equal, equal, self.group).view(self.size, n_local)
        if self.padded:
            return self._run_padded(experts, x, send_counts, recv_counts, local)
        return self._run_uneven(experts, x, send_counts, recv_counts, local)

    @torch.compiler.disable  # the exchange's sizes are read on the host: compiled blocks break around it
    def _run_uneven(self, experts, x, send_counts, recv_counts, local) -> torch.Tensor:
        send, recv = self.host_splits(send_counts, recv_counts)
        got = all_to_all(x, send, recv, self.group, "ep.dispatch")  # (R, E): per source rank, by local expert
        n_local = send_counts.shape[1]
        expert = torch.arange(n_local, device=x.device).repeat(self.size)  # the local expert of each block
        order = torch.repeat_interleave(expert, recv_counts.reshape(-1)).argsort(stable=True)  # by expert
        inverse = inverse_permutation(order)
        # (R, E) grouped by local expert
        out = experts(permute(got, order, inverse), recv_counts.sum(0), local)
        back = permute(out, inverse, order)  # (R, E) per source rank again
        return all_to_all(back, recv, send, self.group, "ep.combine")  # (T k, E)

    def _run_padded(self, experts, x, send_counts, recv_counts, local) -> torch.Tensor:
        """The uneven exchange's math with every size fixed on the host: blocks of C = T k rows per rank (the
        most this rank can send to one), real rows first; the pad rows are zeros going out, are sorted after
        every expert's rows (``Experts`` leaves rows past its counts unspecified) and are never read back."""
        cap, n_local = x.shape[0], send_counts.shape[1]  # C, experts per rank
        sent = send_counts.sum(1)  # (ep,) rows to each rank
        ends = sent.cumsum(0)  # (ep,) end of the rows to each rank in x
        slot = torch.arange(cap, device=x.device)
        dest = torch.searchsorted(ends, slot, right=True)  # (C,) the rank each slot goes to
        pos = dest * cap + slot - (ends - sent)[dest]  # (C,) its row in the padded send buffer
        out_buf = x.new_zeros(self.size * cap, x.shape[1]).index_copy(0, pos, x)  # (ep C, E)
        equal = [cap] * self.size
        got = all_to_all(out_buf, equal, equal, self.group, "ep.dispatch")  # (ep C, E): block r from rank r
        # the local expert of each received row, n_local (after all of them) for the pad rows
        row = torch.arange(cap, device=x.device)
        bounds = recv_counts.cumsum(1)  # (ep, n_local): ends of each expert's rows in each block
        expert = torch.searchsorted(bounds, row.expand(self.size, cap).contiguous(), right=True)  # (ep, C)
        order = expert.reshape(-1).argsort(stable=True)  # (ep C,) real rows by local expert, then the pads
        inverse = inverse_permutation(order)
        # (ep C, E), rows past the counts unspecified
        out = experts(permute(got, order, inverse), recv_counts.sum(0), local)
        real = (expert < n_local).reshape(-1, 1)  # (ep C, 1)
        # (ep C, E) per source rank again, the pad rows zeros
        back = torch.where(real, permute(out, inverse, order), 0)
        done = all_to_all(back, equal, equal, self.group, "ep.combine")  # (ep C, E): block r from rank r
        return done[pos]  # (T k, E)


class MoEParallel:
    """``MoE.parallel`` under loom's parallelisms (the interface of ``loom.models.common.moe.LocalExperts``); one
    object shared by the MoE blocks of a model part, filled in by the steps of the composition order
    (``loom.parallel.parallelize``):

    * ``sequence_shards``: (group, size) of the ranks that split each sequence with this one: tensor parallelism's
      sequence slices (``apply_tp``), context parallelism (``apply_context_parallel``). The balance loss's expert
      counts are summed over them (one small all-reduce each, no gradient; again when recomputed), and each rank
      adds its own tokens' share of the mean router probability, so the ranks' terms add up to the whole
      sequence's loss and each rank's router gets exactly its tokens' gradient.
    * ``sequence_slice``: (group, size) of tensor parallelism (``apply_tp``), whose ranks hold equal consecutive
      slices of every sequence of the model's input, in rank order: ``local_tokens`` cuts per-token tensors so.
    * ``etp``: ``ExpertTensorParallel`` when the experts are sharded over tp by hidden width (``apply_tp``).
    * ``ep``: ``ExpertParallel`` when the experts are split over the ep ranks (``apply_expert_parallel``).
    * DTensor parameters (tp, ep, etp) run as their local shards (``local_weight``)."""

    def __init__(self):
        self.sequence_shards: tuple = ()
        self.sequence_slice: tuple | None = None
        self.etp: ExpertTensorParallel | None = None
        self.ep: ExpertParallel | None = None

    def local(self, w: torch.Tensor) -> torch.Tensor:
        return local_weight(w)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.etp is None else self.etp.gather(x)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.etp is None else self.etp.reduce_scatter(x)

    def run(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep is None:
            return experts(x, counts, self.local)
        return self.ep.run(experts, x, counts, self.local)

    def local_tokens(self, mask: torch.Tensor) -> torch.Tensor:
        if self.sequence_slice is None:
            return mask
        group, size = self.sequence_slice
        return mask.chunk(size, dim=1)[dist.get_rank(group)]  # (B, S / tp, ...)

    def whole_sequence(self, counts: torch.Tensor, seq: int) -> tuple[torch.Tensor, int]:
        from torch.distributed import _functional_collectives as fc

        for group, size in self.sequence_shards:
            counts = fc.all_reduce(counts, "sum", group)
            seq = seq * size
        return counts, seq


def moe_parallel(model: nn.Module) -> MoEParallel | None:
    """The ``MoEParallel`` shared by the MoE blocks of ``model`` (a model or a pipeline stage), installed on the
    first call; None without MoE blocks."""
    blocks = moe_modules(model)
    if not blocks:
        return None
    if not isinstance(blocks[0].parallel, MoEParallel):
        shared = MoEParallel()
        for moe in blocks:
            moe.parallel = shared
    return blocks[0].parallel


def exchanges_tokens(moe: MoE) -> bool:
    """Whether ``moe`` runs its experts over expert parallelism: a compiled block then breaks its graph, around the
    uneven exchange (sized on the host) or, with the padded one (traced), at the FSDP2 hooks of the experts, which
    FSDP2 wraps on their own mesh inside the block."""
    return isinstance(moe.parallel, MoEParallel) and moe.parallel.ep is not None


def shard_experts(experts: nn.Module, mesh, placements_before: tuple = ()) -> None:
    """Expert weights as DTensors sharded by their hidden width over the last axis of ``mesh``: w1, w3 (n, E, H)
    on H, w2 (n, H, E) on H. ``placements_before``: the placements on ``mesh``'s other axes (expert parallelism:
    ``(Shard(0),)``, which experts)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for name, dim in (("w1", 2), ("w3", 2), ("w2", 1)):
        p = getattr(experts, name)
        setattr(
            experts,
            name,
            nn.Parameter(
                distribute_tensor(p.data, mesh, [*placements_before, Shard(dim)]),
                requires_grad=p.requires_grad,
            ),
        )


def apply_expert_parallel(model: nn.Module, ep_mesh, ep_tp_mesh=None, exchange: str = "uneven") -> None:
    """Shard the experts of every MoE block of ``model`` (a model or a pipeline stage) over ``ep_mesh`` and
    give the blocks the ep group. ``ep_tp_mesh`` (parallel.etp = tp): the (ep, tp) mesh the experts are then
    sharded over, by expert and by hidden width. ``exchange``: parallel.ep_exchange (``ExpertParallel``). Call on
    the meta device, after TP, before FSDP2."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = ExpertParallel(ep_mesh.get_group(), ep_mesh.size(), exchange)
    for moe in moe_modules(model):
        if ep_tp_mesh is not None:
            shard_experts(moe.experts, ep_tp_mesh, placements_before=(Shard(0),))
        else:
            for name in ("w1", "w2", "w3"):
                p = getattr(moe.experts, name)
                setattr(
                    moe.experts,
                    name,
                    nn.Parameter(
                        distribute_tensor(p.data, ep_mesh, [Shard(0)]), requires_grad=p.requires_grad
                    ),
                )
    par = moe_parallel(model)
    if par is not None:
        par.ep = ep


def expert_params(parts: list[nn.Module]) -> list[nn.Parameter]:
    """The expert weights of every MoE block of ``parts``."""
    return [p for part in parts for moe in moe_modules(part) for p in moe.experts.parameters()]
