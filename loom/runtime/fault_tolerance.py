"""Fault-tolerant replica groups through torchft (``parallel.fault_tolerance``).

Each replica group is a job of its own (its ranks, process group and run dir); torchft's lighthouse forms a quorum
of the groups alive at each step. The groups' gradients are summed over the quorum, the optimizer steps only where
the quorum agrees the step went through (``should_commit``), and a group that (re)starts behind the others loads a
live peer's weights, optimizer and trainer state before its step (torchft's live recovery). While a group is down
the others go on with their share of each global batch; the down group's share of those steps is not trained on.

Rank r of one group reduces with rank r of every other group, so every group runs the same layout. The quorum is
synchronous (formed before the step's data is read), so a recovered group takes part in the very step it joins.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from loom.config.errors import UserError, require
from loom.config.sections import ParallelConfig

if TYPE_CHECKING:  # torch is imported where it is used: loom.resolve reads this module's light helpers
    import torch
    from torch import nn


def replica_groups(parallel: ParallelConfig) -> int:
    """How many replica groups share each global batch (1 without fault tolerance)."""
    return parallel.ft_replica_groups if parallel.fault_tolerance else 1


def data_shard(parallel: ParallelConfig, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """(rank, size) of this rank among the data-parallel ranks of every replica group: group g's ranks come after
    group g - 1's, so the groups together read what one job of all their ranks would."""
    return (
        parallel.ft_replica_id * dp_size + dp_rank if parallel.fault_tolerance else dp_rank,
        replica_groups(parallel) * dp_size,
    )


def lighthouse_address(parallel: ParallelConfig) -> str:
    """The lighthouse's address: parallel.ft_lighthouse, else TORCHFT_LIGHTHOUSE ('' where neither is set)."""
    return parallel.ft_lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")


def _shipped(state: dict) -> dict:
    """A state dict with each DTensor replaced by this rank's shard (the peer's rank r rebuilds it on its mesh)."""
    import torch

    from loom.parallel.shards import local_tensor

    return {k: local_tensor(v).detach() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _rebuilt(template: dict, received: dict, what: str) -> dict:
    """``received`` (shards) laid out as ``template`` (this rank's own state dict): a shard becomes a DTensor
    wherever the template holds one."""
    from torch.distributed.tensor import DTensor

    if set(template) != set(received):
        missing = sorted(set(template) ^ set(received))[:3]
        raise UserError(
            f"parallel.fault_tolerance: the peer replica group's {what} differs from this group's (e.g. "
            f"{missing}): every replica group must run the same model, LoRA and layout"
        )
    out = {}
    for k, t in template.items():
        v = received[k]
        if isinstance(t, DTensor):
            v = DTensor.from_local(
                v.to(t.to_local().device), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
            )
        out[k] = v
    return out


class ReplicaGroups:
    """torchft's Manager for this replica group. Per step: ``start_step`` (quorum; a group behind the others
    recovers here), ``sum_`` for the step's global sums, ``sum_grads`` after backward, ``should_commit`` before the
    optimizer step. ``trainer_state`` / ``load_trainer_state`` carry what is not weights or optimizer state (step,
    data position, LR schedule, loss scale) to a recovering peer."""

    def __init__(
        self,
        parallel: ParallelConfig,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        trainer_state: Callable[[], dict],
        load_trainer_state: Callable[[dict], None],
    ):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
        ft = require("torchft", "ft", purpose="parallel.fault_tolerance")
        self.parts, self.optimizers, self.rank = parts, optimizers, rank
        self.trainer_state, self.load_trainer_state = trainer_state, load_trainer_state
        self.replica_id = parallel.ft_replica_id
        timeout = timedelta(seconds=parallel.ft_timeout_s)
        self._store, store_addr, store_port = _group_store(world_size)
        # gloo for host tensors (CPU runs, offloaded gradients); NCCL for gradients on the GPU
        on_host = device.type == "cpu" or parallel.cpu_offload or parallel.backend == "gloo"
        pg = ft.ProcessGroupGloo(timeout=timeout) if on_host else ft.ProcessGroupNCCL(timeout=timeout)
        self.manager = ft.Manager(
            pg=pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=parallel.ft_min_replicas,
            # every group draws the same weights from run.seed (loom's init does not depend on the layout): no
            # transfer at step 0, which would also have DCP give the sender's empty optimizer a step of its own
            init_sync=False,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse_address(parallel),
            replica_id=f"loom_{parallel.ft_replica_id}",
        )

    # ---- the step -------------------------------------------------------------------
    def start_step(self) -> None:
        """Join this step's quorum (blocks until the lighthouse forms it); a group behind the quorum's newest step
        loads a peer's state here, before the step's data is read."""
        self.manager.start_quorum()

    @property
    def participants(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed in place over the replica groups of the quorum (an error is recorded by the manager: the step
        is then not committed)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        return t

    def sum_grads(self, params: list[torch.Tensor], bucket_mb: float = 25.0) -> None:
        """Every gradient (this rank's shard of it) summed over the replica groups, in flat buckets per dtype and
        device. Each group's gradient is already its tokens' share of the global mean, so the sum is the mean."""
        import torch
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        from loom.parallel.shards import local_tensor

        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        limit = bucket_mb * 2**20
        buckets: dict[tuple, list[list[torch.Tensor]]] = {}
        for g in grads:
            lists = buckets.setdefault((g.dtype, g.device), [[]])
            held = sum(x.numel() * x.element_size() for x in lists[-1])
            if lists[-1] and held + g.numel() * g.element_size() > limit:
                lists.append([])
            lists[-1].append(g)
        with torch.no_grad():
            for lists in buckets.values():
                for bucket in lists:
                    flat = self.sum_(_flatten_dense_tensors(bucket))
                    for g, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                        g.copy_(summed)

    def should_commit(self) -> bool:
        """Whether every group of the quorum finished this step's collectives (same answer on every rank of every
        group): the optimizer steps only where it is true."""
        return self.manager.should_commit()

    def set_step(self, step: int) -> None:
        """The manager's step after a resume from a checkpoint: the lighthouse compares the groups by it."""
        self.manager.load_state_dict({**self.manager.state_dict(), "step": step})

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # ---- live recovery ---------------------------------------------------------------
    def _state(self) -> dict:
        """What a recovering peer loads: this rank's weight and optimizer shards, and the trainer's state."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        opts = _options()
        # an optimizer that has not stepped yet has no state to send (DCP would initialize it with a step)
        return {
            "model": [_shipped(get_model_state_dict(p, options=opts)) for p in self.parts],
            "optimizer": [
                _shipped(get_optimizer_state_dict(p, o, options=opts)) if o.state else None
                for p, o in zip(self.parts, self.optimizers)
            ],
            "trainer": self.trainer_state(),
        }

    def _load(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = _options()
        for part, opt, model_sd, optim_sd in zip(
            self.parts, self.optimizers, state["model"], state["optimizer"]
        ):
            set_model_state_dict(
                part, _rebuilt(get_model_state_dict(part, options=opts), model_sd, "model"), options=opts
            )
            if optim_sd is not None:
                template = get_optimizer_state_dict(
                    part, opt, options=opts
                )  # initializes a fresh optimizer's state
                set_optimizer_state_dict(
                    part, opt, _rebuilt(template, optim_sd, "optimizer state"), options=opts
                )
        self.load_trainer_state(state["trainer"])
        if self.rank == 0:
            print(
                f"replica group {self.replica_id}: recovered step {state['trainer']['step']} from a live replica "
                "group (torchft)",
                flush=True,
            )


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _group_store(world_size: int):
    """(store kept alive, address, port) of a TCPStore this group's ranks share. A group of several ranks has one
    already (torchrun's, at MASTER_ADDR:MASTER_PORT); a one-rank group hosts its own. The address is handed to the
    other groups (the quorum's cross-group process group meets there): it must be reachable from their hosts."""
    if world_size > 1:
        return None, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    from torch.distributed import TCPStore

    host = os.environ.get("MASTER_ADDR") or socket.gethostname()
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return store, host, store.port
