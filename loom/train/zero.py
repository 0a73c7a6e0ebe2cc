"""ZeRO-1 (``parallel.zero = 1``): DDP replicas that each keep the optimizer state of their own parameters.

DDP all-reduces the gradients as it does at stage 0, so every replica holds the whole averaged gradient: the global
norm, clipping and the non-finite check read it unchanged. Each replica then steps only the parameters it owns (a
partition by whole parameter, balanced by size), and every owner broadcasts its updated parameters to the others.
Each parameter is stepped by one rank from the gradient a single process would see, so the result does not depend
on the number of replicas (the update of a parameter is the same computation as at stage 0, on one rank). The
optimizer holds plain tensors of whole parameters, keyed by their names as at every stage: checkpoints reshard
between stages through DCP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def partition(sizes: list[int], n: int) -> list[int]:
    """The owner (0 .. n-1) of each of ``sizes`` parameters: largest first, each to the least loaded rank
    (ties to the lower rank), so every rank holds about 1/n of the elements, and every rank decides the same."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class OptimizerShard:
    """Which of ``params`` (every trainable parameter, in the same order on every replica) this rank steps, and
    the broadcast that hands each owner's updated parameters to the others over ``mesh`` (the dp_replicate axis)."""

    def __init__(self, params: list[torch.nn.Parameter], mesh=None):
        self.params = params
        self.group = mesh.get_group() if mesh is not None else None
        self.n = mesh.size() if mesh is not None else 1
        rank = mesh.get_local_rank() if mesh is not None else 0
        self.owner = partition([p.numel() for p in params], self.n)
        self._mine = {id(p) for p, o in zip(params, self.owner) if o == rank}
        self.rank = rank
        if params and not self._mine:
            raise ValueError(
                f"parallel.zero = 1: {len(params)} parameters for {self.n} replicas leave rank {rank} "
                "none to step"
            )

    def keeps(self, p: torch.nn.Parameter) -> bool:
        return id(p) in self._mine

    @torch.no_grad()
    def broadcast(self) -> None:
        """Each owner's parameters to every replica: one flat broadcast per owner and dtype."""
        if self.n == 1:
            return
        for r in range(self.n):
            by_dtype: dict = {}
            for p, o in zip(self.params, self.owner):
                if o == r:
                    by_dtype.setdefault(p.dtype, []).append(p)
            for tensors in by_dtype.values():
                flat = _flatten_dense_tensors([p.detach() for p in tensors])  # (sum of numels,)
                dist.broadcast(flat, group=self.group, group_src=r)
                if r != self.rank:
                    for p, t in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                        p.copy_(t)

    def state_bytes(self, optimizers) -> int:
        """Bytes of the optimizer state tensors this rank holds (the test of 1/n per rank counts them)."""
        return sum(
            t.numel() * t.element_size()
            for opt in optimizers
            for state in opt.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
