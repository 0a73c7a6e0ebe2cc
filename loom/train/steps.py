"""Step strategies: how a step's micro-batches run forward and backward on this rank. ``LocalStep`` runs them one
after another through the whole model (gradient accumulation); ``PipelineStep`` runs them through a pipeline
schedule over this rank's stages; under ``pp_schedule = pipedream_2bw`` (1-step-delayed weights) ``DelayedLocalStep``
(one rank: the rule's reference) and ``TwoBWStep`` (a stream with no flush between steps). The trainer picks one at build time and calls only this interface; the
objective (loom.train.objective) says what the loss of a micro-batch is."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.config.errors import ConfigError
from loom.data.loader import MicroBatch
from loom.metrics.nvtx import nvtx_range
from loom.parallel.pipedream import TwoBWPipeline, WeightVersions
from loom.parallel.pipeline import (
    TWO_BW,
    V_SHAPED,
    BusyClock,
    build_schedule,
    forward_chain,
    last_stage_inputs,
    theoretical_bubble,
)
from loom.parallel.tensor_parallel import loss_parallel_context, to_local_loss
from loom.train.grads import TiedEmbeddingGrads, global_grad_norm, unique_params
from loom.train.hooks import StepHook
from loom.train.objective import Objective


@dataclass
class StepResult:
    loss_sum: (
        torch.Tensor
    )  # this data-parallel rank's summed loss over the step's micro-batches (every pp rank)
    shape_inference: bool = (
        False  # the run also ran each stage on placeholder inputs (a pipeline's first run)
    )


@dataclass
class StepContext:
    """What both strategies share: the parallel dims, the device, the step's autocast, whether the loss is
    vocab-parallel, whether the model takes per-document positions, and the profiler's phases."""

    dims: object
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager]
    loss_parallel: bool
    documents: bool
    profiler: object
    cuda_graphs: bool = False

    def positions(self, mb: MicroBatch) -> torch.Tensor | None:
        return mb.positions if self.documents else None

    def new_pass(self) -> None:
        """Before each micro-batch's forward under training.cuda_graphs: the graphs' outputs of the pass before
        are no longer read, so their memory may be replayed over."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()


class LocalStep:
    """Each micro-batch forward and backward in turn through the whole model; gradients accumulate (DDP reduces
    them only after the last)."""

    def __init__(self, module, parts, objective: Objective, ctx: StepContext):
        self.module, self.parts, self.objective, self.ctx = module, parts, objective, ctx
        self.params = unique_params(parts)

    def _loss(self, mb: MicroBatch) -> torch.Tensor:
        """The summed loss of one micro-batch (under ``loss_parallel_context`` with TP)."""
        with self.ctx.autocast():
            out = self.objective.forward(self.module, mb, self.ctx.positions(mb))
        return to_local_loss(out if self.objective.loss_in_forward else self.objective.loss(out, mb.labels))

    def step(self, mbs: list[MicroBatch], grad_scale: torch.Tensor) -> StepResult:
        loss_sum = torch.zeros((), device=self.ctx.device)
        profiler = self.ctx.profiler
        for i, mb in enumerate(mbs):
            self.ctx.new_pass()
            with (
                self._no_sync(last=i == len(mbs) - 1),
                loss_parallel_context(self.ctx.loss_parallel),
                nvtx_range(f"microbatch {i}"),
            ):
                with profiler.phase("forward"):
                    loss = self._loss(mb)
                with profiler.phase("backward"):
                    self._backward(loss * grad_scale)
            loss_sum += loss.detach()
        return StepResult(loss_sum)

    def _backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``. Under training.cuda_graphs the gradients land where the graphs wrote them and are
        added to the tensors kept between steps (loom.train.engine) with one multi-tensor add, before the next
        replay writes over that memory: autograd's own accumulation onto the kept tensors launched one add per
        parameter from the host (448 a step at LoRA 8B, the GPU waiting on them at the end of each backward)."""
        if not self.ctx.cuda_graphs:
            loss.backward()
            return
        trainable = [p for p in self.params if p.requires_grad]
        kept = [p.grad for p in trainable]
        for p in trainable:
            p.grad = None
        try:
            loss.backward()
            landed = [p.grad for p in trainable]
        finally:
            for p, k in zip(trainable, kept):
                p.grad = k
        pairs = [(k, g) for k, g in zip(kept, landed) if g is not None and k is not None]
        if pairs:
            torch._foreach_add_([k for k, _ in pairs], [g for _, g in pairs])
        for p, k, g in zip(trainable, kept, landed):
            if k is None and g is not None:  # nothing kept for it: a copy out of the graphs' memory
                p.grad = g.clone()

    def _no_sync(self, last: bool):
        dims = self.ctx.dims
        if dims.ddp_enabled and not dims.replicate_with_fsdp and not last:
            return self.module.no_sync()
        return contextlib.nullcontext()

    @torch.no_grad()
    def evaluate(self, mbs: list[MicroBatch]) -> torch.Tensor:
        """The summed loss of ``mbs`` (forward only)."""
        total = torch.zeros((), device=self.ctx.device)
        for mb in mbs:
            self.ctx.new_pass()
            with loss_parallel_context(self.ctx.loss_parallel):
                total += self._loss(mb)
        return total

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(self.params)

    def stage_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the pipeline stages: this rank holds them all."""
        return t

    def describe(self, accum: int) -> list[str]:
        return []

    def record(self) -> dict:
        return {}


class _ScaledLoss:
    """A pipeline's loss_fn: the objective's summed loss times ``scale`` (the micro-batch's share of the step's
    gradient while training, 1 while evaluating)."""

    def __init__(self, objective: Objective):
        self.objective, self.scale = objective, 1.0

    def __call__(self, outputs: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(outputs, tuple):
            # the last stage's outputs and its own loss terms (multi-token prediction's)
            outputs, extra = outputs
            return to_local_loss(self.objective.loss(outputs, labels) + extra) * self.scale
        return to_local_loss(self.objective.loss(outputs, labels)) * self.scale


class PipelineStep:
    """One schedule run over the step's micro-batches (the accumulation count) through this rank's stages."""

    def __init__(self, plan, parts, modules, objective: Objective, ctx: StepContext, accum: int):
        self.plan, self.parts, self.modules, self.ctx, self.accum = plan, parts, modules, ctx, accum
        self.group = ctx.dims["pp"].get_group()
        self.busy = BusyClock(ctx.device)
        self.loss_fn = _ScaledLoss(objective)
        self.schedule = build_schedule(plan, modules, self.group, ctx.device, accum, self.loss_fn, self.busy)
        self.tied = TiedEmbeddingGrads(parts, plan, ctx.dims)
        self.norm_params = self.tied.params_counted_once(parts)
        self.ran = False  # whether the schedule ran in this process (its first run infers shapes)
        self.steps = 1  # steps of the run (the bubble of a schedule that flushes once per run)

    def step(self, mbs: list[MicroBatch], grad_scale: torch.Tensor) -> StepResult:
        self.loss_fn.scale = grad_scale
        self.busy.start()
        with self.ctx.profiler.phase("forward_backward"):
            # the last stage's outputs are not merged into one: only the losses are read
            losses = self._run(self.schedule.step, mbs, return_outputs=False)
        self.busy.stop()
        self.tied.sync()
        loss_sum = stage_loss_sum(losses, grad_scale, self.ctx.device, self.group)
        first, self.ran = not self.ran, True
        return StepResult(loss_sum, shape_inference=first)

    def _run(self, run, mbs: list[MicroBatch], **options) -> list[torch.Tensor]:
        """``run`` (the schedule's step or eval, with ``options``) over ``mbs`` joined into (M x B, S), which the
        schedule cuts back into M micro-batches; returns the last stage's loss_fn outputs (empty elsewhere)."""
        labels = torch.cat([mb.labels for mb in mbs])
        inputs = torch.cat([mb.inputs for mb in mbs])
        # per-document positions go to every stage as a keyword (the schedule cuts it like the inputs): each
        # stage's attention masks its documents and RoPE restarts per document; and what the last stage's forward
        # reads beside the hidden states (multi-token prediction's token ids and labels)
        kwargs = {"positions": torch.cat([mb.positions for mb in mbs])} if self.ctx.documents else {}
        kwargs.update(last_stage_inputs(self.parts[0].args, inputs, labels))
        losses: list[torch.Tensor] = []
        with self.ctx.autocast(), loss_parallel_context(self.ctx.loss_parallel):
            if self.plan.has_first:
                run(inputs, target=labels, losses=losses, **options, **kwargs)
            else:
                run(target=labels, losses=losses, **options, **kwargs)
        return losses

    @torch.no_grad()
    def evaluate(self, mbs: list[MicroBatch]) -> torch.Tensor:
        """Forward-only schedule runs over ``accum`` micro-batches at a time (the config check makes their count a
        multiple), or for V-shaped schedules one micro-batch at a time through ``forward_chain``; the summed loss
        of this data-parallel rank, on every pp rank."""
        total = torch.zeros((), device=self.ctx.device)
        self.loss_fn.scale = 1.0
        timed = len(self.busy.spans)
        if self.plan.schedule in V_SHAPED + (
            TWO_BW,
        ):  # torch's forward-only run of these fails, 2BW has none
            for mb in mbs:
                with self.ctx.autocast(), loss_parallel_context(self.ctx.loss_parallel):
                    out = forward_chain(
                        self.plan, self.parts, self.group, mb.inputs, self.ctx.device, self.ctx.positions(mb)
                    )
                    if out is not None:
                        total += self.loss_fn(out, mb.labels)
        else:
            for i in range(0, len(mbs), self.accum):
                losses = self._run(self.schedule.eval, mbs[i : i + self.accum])
                if losses:
                    total += torch.stack(losses).sum()
        del self.busy.spans[timed:]  # the logged idle fraction is the training step's
        dist.all_reduce(total, group=self.group)  # only the last stage holds it
        return total

    def grad_norm(self) -> torch.Tensor:
        # each stage's share, tied weight once
        sq = global_grad_norm(self.norm_params).to(self.ctx.device) ** 2
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt()

    def stage_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the pipeline ranks, each of which holds some of the stages."""
        dist.all_reduce(t, group=self.group)
        return t

    def describe(self, accum: int) -> list[str]:
        p = self.plan
        try:
            bubble = f"{100 * theoretical_bubble(p.schedule, p.pp, accum, p.per_rank, self.steps):.1f}%"
        except (ImportError, AttributeError, RuntimeError, ValueError) as err:  # private torch API moved
            bubble = f"unknown ({type(err).__name__}: {err})"
        return [
            f"pipeline: {p.schedule}, pp={p.pp}, {p.per_rank} stage(s) per rank, {accum} micro-batches: "
            f"theoretical bubble {bubble} (idle / total, F=1 B=2"
            + (
                f", over the run's {self.steps} steps: no flush between them)"
                if p.schedule == TWO_BW
                else ")"
            ),
            f"pipeline split: {p.describe()}",
        ]

    def record(self) -> dict:
        """Each pp rank's idle fraction in the last step (rank order), measured, for the log."""
        t = torch.tensor([self.busy.idle_fraction()], device=self.ctx.device)
        out = [torch.zeros_like(t) for _ in range(self.ctx.dims.pp)]
        dist.all_gather(out, t, group=self.group)
        return {"pp_idle": [round(float(x), 4) for x in out]}


# ---- pipedream_2bw --------------------------------------------------------------------------------------------------


class DelayedLocalStep(LocalStep):
    """``LocalStep`` on 1-step-delayed weights (loom.parallel.pipedream's rule): each step's micro-batches compute
    with the weights one update behind the optimizer's, whose update their gradient then makes. On one rank this
    is what pipedream_2bw computes on any number of stages: its single-process reference."""

    def __init__(self, module, parts, objective: Objective, ctx: StepContext):
        super().__init__(module, parts, objective, ctx)
        self.versions = WeightVersions(parts)

    def step(self, mbs: list[MicroBatch], grad_scale: torch.Tensor) -> StepResult:
        self.versions.begin()
        with self.versions.using("current"):
            result = super().step(mbs, grad_scale)
        self.versions.finish()
        return result


class TwoBWStep(PipelineStep):
    """pipedream_2bw over this rank's one stage (``TwoBWPipeline``): the step's micro-batches on the current
    weight version, then the next step's first ones on the newest (``upcoming``: the engine sets it to a function
    returning the next step's micro-batches, or None at the run's last step). Validation runs stage by stage on
    the newest weights (``forward_chain``)."""

    def __init__(self, plan, parts, modules, objective: Objective, ctx: StepContext, accum: int):
        self.plan, self.parts, self.modules, self.ctx, self.accum = plan, parts, modules, ctx, accum
        self.group = ctx.dims["pp"].get_group()
        self.busy = BusyClock(ctx.device)
        self.loss_fn = _ScaledLoss(objective)
        self.versions = WeightVersions(parts)
        self.pipeline = TwoBWPipeline(plan, self.versions, self.group, ctx.device, self.busy)
        self.tied = TiedEmbeddingGrads(parts, plan, ctx.dims)
        self.norm_params = self.tied.params_counted_once(parts)
        self.steps = 1
        self.upcoming: Callable[[], list[MicroBatch] | None] = lambda: None

    def step(self, mbs: list[MicroBatch], grad_scale: torch.Tensor) -> StepResult:
        self.loss_fn.scale = grad_scale
        upcoming = self.upcoming()
        self.versions.begin()
        self.busy.start()
        with (
            self.ctx.profiler.phase("forward_backward"),
            self.ctx.autocast(),
            loss_parallel_context(self.ctx.loss_parallel),
        ):
            losses = self.pipeline.step(
                self._triples(mbs), self._triples(upcoming) if upcoming is not None else None, self.loss_fn
            )
        self.busy.stop()
        self.versions.finish()
        self.tied.sync()
        loss_sum = stage_loss_sum(losses, grad_scale, self.ctx.device, self.group)
        return StepResult(loss_sum)

    def _triples(self, mbs: list[MicroBatch]) -> list[tuple]:
        return [(mb.inputs, mb.labels, self.ctx.positions(mb)) for mb in mbs]


STASH_KEY = "pipedream_2bw_stash"  # a checkpoint's entry of the older weight version


class TwoBWCheckpoint(StepHook):
    """pipedream_2bw's checkpoints (any pp): beside the newest weights and the optimizer state, the older version the
    next step computes with (``WeightVersions.stash``), so a resumed run continues as the uninterrupted one. A
    checkpoint without it (written under another schedule) is refused: the delayed rule would restart there."""

    def __init__(self, versions: WeightVersions):
        self.versions = versions

    def check_resume(self, folder: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(folder).read_metadata().state_dict_metadata
        if not any(k.startswith(STASH_KEY + ".") for k in keys):
            raise ConfigError(
                "parallel.pp_schedule",
                TWO_BW,
                f"cannot resume from {folder}: written without pipedream_2bw, it lacks the older weight version "
                "the next step computes with; start afresh (checkpoint.resume = none) or keep that run's schedule",
            )

    def extra_state(self) -> dict:
        return {STASH_KEY: self.versions.stash()}

    def loaded(self, with_state: bool) -> None:
        if with_state:
            self.versions.loaded()


def stage_loss_sum(losses: list, grad_scale: torch.Tensor, device, group) -> torch.Tensor:
    """A pipeline step's unscaled loss sum on every stage: only the last stage holds its micro-batches' losses."""
    loss_sum = torch.stack(losses).sum().detach() / grad_scale if losses else torch.zeros((), device=device)
    dist.all_reduce(loss_sum, group=group)
    return loss_sum
