"""Step hooks: the optional features that join every training step (DiLoCo, torchft's replica groups, the
gradient noise scale, a mixture of experts' balance statistics, stragglers, preemption). Each lives in its feature's
module as a ``StepHook`` (the runtime's features, below loom.train, through an adapter here that holds them);
loom.train.engine.step_hooks picks them from the config in one list, and the engine and the loop call every hook at
each point below, in list order, instead of asking which features are on."""

from __future__ import annotations

import contextlib
import gc
import json
import os

import torch

from loom.runtime.guard import PREEMPTED, Preemption, StopVote
from loom.runtime.stragglers import Stragglers


class StepHook:
    """Every point a hook may join, each a no-op here. The engine's step: ``before_count`` → ``reduce`` (every
    global sum) → ``grad_scale`` → ``before_step`` → ``run_step`` → ``after_backward`` → ``commits`` →
    ``observe_norm`` → ``agree`` → ``after_update`` → ``step_out``. The loop: ``begin``, ``quorum``, ``data_wait``,
    ``stops``, ``record``, ``interval``, ``stopped``, ``describe``, ``finish``, ``close``; checkpoints: ``replica``, ``state_dict``, ``check_resume``, ``extra_state``, ``loaded``,
    ``resumed``."""

    may_abort = (
        False  # a step may end without an update (``commits`` false): the loop keeps its data position
    )
    replica = None  # the state a checkpoint holds beside the model's (loom.checkpoint.manager ``replica``)

    # ---- the step (loom.train.engine) ----------------------------------------------------------------------------
    def before_count(self, local: torch.Tensor) -> None:
        """This rank's count of the step's units, before it is summed over the data-parallel ranks."""

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (summed over the data-parallel ranks) summed further, e.g. over replica groups."""
        return t

    def grad_scale(self, scale: torch.Tensor, loss_scale: float) -> torch.Tensor:
        """The factor each micro-batch's summed loss is multiplied by before backward."""
        return scale

    def before_step(self, loss_scale: float) -> None:
        """Just before the micro-batches run."""

    def run_step(self, steps, mbs: list, grad_scale: torch.Tensor, loss_scale: float):
        """The step's forward and backward run by this hook (a StepResult), or None to leave it to ``steps``."""
        return None

    def after_backward(self, params: list[torch.Tensor]) -> None:
        """Every gradient is complete on this rank."""

    def commits(self) -> bool:
        """Whether the step may update the weights (false: every rank discards its gradients)."""
        return True

    def observe_norm(self, norm: torch.Tensor, denominator: torch.Tensor) -> None:
        """The step's global gradient norm (loss scale removed) and its global count."""

    def agree(self, applies: torch.Tensor) -> torch.Tensor:
        """Whether the update applies, agreed over whatever this hook spans."""
        return applies

    def after_update(self, step: int) -> None:
        """After the optimizer step of ``step`` (applied or not) and zero_grad."""

    def step_out(self, applies: torch.Tensor, shape_inference: bool, device: torch.device) -> dict:
        """Figures of the step for its output (the loop logs them)."""
        return {}

    # ---- the loop (loom.train.loop) ------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """Training starts (or resumes) at ``step``."""

    def quorum(self) -> None:
        """Before a step reads its data (a peer's state may be loaded here)."""

    def data_wait(self) -> contextlib.AbstractContextManager:
        """Around the wait for a step's data (its loader's batches, or a driver's rollouts)."""
        return contextlib.nullcontext()

    def stops(self) -> bool:
        """After a step: whether the run saves it and exits (every rank answers the same, at the same step)."""
        return False

    def record(self) -> dict:
        """Fields of a logged record."""
        return {}

    def interval(self, step: int, seconds: float) -> dict:
        """Fields of a logged record that measure the ``seconds`` since the last one (every rank calls it)."""
        return {}

    def stopped(self, step: int) -> None:
        """The run saved ``step`` for a stop that ``stops`` asked for, and exits."""

    def describe(self) -> list[str]:
        """Lines of the start-up banner."""
        return []

    def finish(self) -> None:
        """Training ended: work still in flight completes."""

    def close(self) -> None:
        """The run stops (after an error too)."""

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self, step: int) -> dict:
        """Entries of the trainer state a checkpoint saves."""
        return {}

    def check_resume(self, folder: str) -> None:
        """Before any weight of ``folder`` is read."""

    def extra_state(self) -> dict:
        """Entries a checkpoint holds beside the model and optimizer state (DCP: each rank its own tensors, read
        back into the same tensors before ``loaded``)."""
        return {}

    def loaded(self, with_state: bool) -> None:
        """A checkpoint's weights are loaded (``with_state``: and its trainer state)."""

    def resumed(self, step: int) -> None:
        """A checkpoint's trainer state is loaded at ``step``."""


class FaultToleranceHook(StepHook):
    """parallel.fault_tolerance (loom.runtime.fault_tolerance.ReplicaGroups; kept there, below the trainer, with
    the rest of torchft's code): per step the replica groups' quorum, their sums, the commit vote; a recovering peer
    gets this group's weights, optimizer state and the loop's state."""

    may_abort = True

    def __init__(self, groups, parallel):
        self.groups, self.parallel = groups, parallel

    @classmethod
    def build(cls, parallel, engine, owner) -> FaultToleranceHook:
        from loom.runtime.fault_tolerance import ReplicaGroups

        return cls(
            ReplicaGroups(
                parallel,
                rank=engine.env.rank,
                world_size=engine.env.world_size,
                device=engine.device,
                parts=engine.parts,
                optimizers=engine.optimizer.optimizers,
                trainer_state=owner.state_dict,
                load_trainer_state=owner.load_state_dict,
            ),
            parallel,
        )

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.groups.sum_(t)

    def after_backward(self, params: list[torch.Tensor]) -> None:
        # each group's gradient is its tokens' share of the global mean: summed over the groups
        self.groups.sum_grads(params, self.parallel.ddp_bucket_mb)

    def commits(self) -> bool:
        return self.groups.should_commit()

    def begin(self, step: int) -> None:
        self.groups.set_step(step)  # the lighthouse compares the groups' steps: a group behind recovers

    def quorum(self) -> None:
        self.groups.start_step()

    def record(self) -> dict:
        return {"replica_groups": self.groups.participants}

    def describe(self) -> list[str]:
        from loom.runtime.fault_tolerance import lighthouse_address

        p = self.parallel
        return [
            f"fault tolerance: replica group {p.ft_replica_id} of {p.ft_replica_groups} (torchft, lighthouse "
            f"{lighthouse_address(p)}); the groups split each global batch"
        ]

    def close(self) -> None:
        self.groups.shutdown()


class StragglersHook(StepHook):
    """metrics.straggler_fraction (loom.runtime.stragglers.Stragglers, kept there, below the trainer, with the rest
    of the per-rank timing): each rank's data wait, and at every logged step the ranks' figures gathered (one
    all_gather) and the stragglers named."""

    def __init__(self, stragglers: Stragglers):
        self.stragglers = stragglers

    @classmethod
    def build(cls, engine, fraction: float) -> StragglersHook:
        return cls(Stragglers(engine.env, fraction, engine.run_dir, engine.device, group=engine.health.group))

    def begin(self, step: int) -> None:
        self.stragglers.start(step)

    def data_wait(self) -> contextlib.AbstractContextManager:
        return self.stragglers.data_wait()

    def interval(self, step: int, seconds: float) -> dict:
        return self.stragglers.interval(step, seconds)


class PreemptionHook(StepHook):
    """checkpoint.preempt_grace_s (loom.runtime.guard.Preemption and StopVote, kept there with the rest of what
    stops a run on purpose): SIGTERM / SIGINT or the launcher's death ask the run to stop; the ranks agree at the
    end of a step (a vote on a gloo group of its own), save it, and rank 0 writes ``preempted.json`` for the
    launcher."""

    def __init__(self, grace_s: float, env, run_dir: str):
        self.grace_s, self.env, self.run_dir = grace_s, env, run_dir
        self.vote = StopVote(torch.distributed.new_group(backend="gloo") if env.world_size > 1 else None)
        self.preemption: Preemption | None = None  # the signal handlers, installed while training runs

    def begin(self, step: int) -> None:
        self.preemption = Preemption(self.grace_s, rank=self.env.rank)

    def stops(self) -> bool:
        return self.vote.agreed(self.preemption.requested)  # every step: schedulers give 30 s

    def stopped(self, step: int) -> None:
        if self.env.is_main:
            with open(os.path.join(self.run_dir, PREEMPTED), "w") as fh:
                json.dump({"step": step, "reason": self.preemption.reason}, fh)
            print(f"{self.preemption.reason or 'stop request'}: saved step {step}, exiting", flush=True)

    def finish(self) -> None:
        self.vote.close(wait=True)  # the vote in flight (every rank started it) ends before the group may go

    def close(self) -> None:
        self.vote.close(wait=False)  # after an error: not waited for
        if self.preemption is not None:
            self.preemption.restore()


class GarbageCollection(StepHook):
    """training.gc_every: Python's automatic garbage collection off while training runs, the young generations
    collected every ``every`` steps (every generation each 10th time) on every rank at the same step. An automatic
    collection starts whenever a rank's allocations cross a threshold, so one rank pauses mid-step and the others
    wait for it in the next collective; collections at the same step on every rank cost the same time and no
    waiting."""

    def __init__(self, every: int):
        self.every, self.was_enabled, self.collections, self.first = every, gc.isenabled(), 0, 1

    def begin(self, step: int) -> None:
        # the young generations only: a full collection walks every object of the process (0.2 s at 350k
        # objects, seconds in a large one), and with collection off every object created from here on stays young
        gc.collect(1)
        gc.disable()
        self.first = step + 1

    def after_update(self, step: int) -> None:
        if step == self.first:  # the first step's compilation left its graphs and example tensors: at once
            gc.collect(1)
        elif step % self.every == 0:
            self.collections += 1
            gc.collect(2 if self.collections % 10 == 0 else 1)

    def close(self) -> None:
        if self.was_enabled:  # the Python API's caller gets its process back as it was
            gc.enable()
