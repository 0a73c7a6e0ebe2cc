"""GRPO (``training.objective grpo``): group-relative policy optimization on rollouts sampled by loom's inference
engine on the live policy (loom.rl.rollout). Its run is a driver that reads top to bottom (``drive``): per step
sample → score → log-probabilities → the engine's step, in the loop's cadence. Its objective: GRPO's token loss (a pure function, loom.rl.grpo)
summed over each micro-batch's completion tokens as ``grpo.loss_type`` says, divided by the step by the global
count, so a step is the same whatever the layout; during the warm-up, cross-entropy on the worked examples'
answers (count: answer tokens). Its rules: loom.methods.rollouts."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from loom.config.errors import ConfigError
from loom.methods.base import Method
from loom.methods.rollouts import reference_plan, rollout_rules, runner, step_through
from loom.numerics import IGNORE
from loom.rl.async_sampler import AsyncSampler, ProcessSampler, check_layout
from loom.rl.grpo import loss_count, loss_sum, token_losses
from loom.rl.rollout import RolloutBatch, Rollouts, policy_forward, token_logps
from loom.train.objective import Objective

if TYPE_CHECKING:
    from loom.train.loop import Loop


class GroupRelative(Objective):
    """GRPO over rollouts made each step by the engine on the live policy (``build_loader`` makes the rollouts, the
    engine keeps them as the run's data; ``prepare`` binds them to the built model). ``cfg``: the whole config (its
    [grpo] section and the run's sizes)."""

    equal_widths = False  # rollouts: each rank pads its rows to its own longest

    loss_in_forward = (
        True  # the loss needs the advantages and old / reference log-probabilities beside the logits
    )

    # the console line's fields (loom.metrics.logger.ConsoleField) and `loom report`'s panels of this method: the
    # sampled rollouts' mean reward and its parts (the embedded task's exact_answer is their accuracy), the greedy
    # accuracy of the evaluation hook (loom.rl.arithmetic:greedy_accuracy), the KL to the reference where computed
    console = (
        ("warm-up", "grpo/warmup", "flag"),
        ("reward", "reward", ".3f"),
        ("acc", "rewards/exact_answer", ".3f"),
        ("", "rewards/*", ".3f"),
        ("eval acc", "eval/accuracy", ".3f"),
        ("kl", "kl", ".4f"),
        ("is", "is_weight", ".3f"),  # asynchronous GRPO's mean importance weight
    )
    panels = (
        ("reward", ("reward", "rewards/*"), "mean over the rollouts"),
        ("accuracy", ("rewards/exact_answer", "eval/accuracy"), "exact match (sampled; greedy at evals)"),
        ("KL to the reference", ("kl",), "per completion token"),
    )

    def __init__(self, cfg):
        self.cfg, self.g = cfg, cfg.grpo
        self._stats: dict[str, torch.Tensor] = {}
        self.rollouts: Rollouts | None = None
        self.global_tokens = self.global_count = 1.0  # of the current rollouts: set by them

    def build_loader(self, engine) -> Rollouts:
        """The objective's own data, its rollouts (the engine asks before building the model)."""
        self.rollouts = Rollouts(self.cfg, engine.tokenizer, engine.dims.dp_rank(), engine.dims.dp_size)
        return self.rollouts

    def prepare(self, engine) -> None:
        self.rollouts.bind(engine, self)

    def count(self, mb: RolloutBatch) -> torch.Tensor:
        mask = mb.labels != IGNORE
        if mb.warmup:
            return mask.sum()
        return loss_count(mask, self.g.loss_type, self.g.max_new_tokens)

    def forward(self, model, mb: RolloutBatch, positions: torch.Tensor | None) -> torch.Tensor:
        g = self.g
        mask = (mb.labels != IGNORE).float()  # (B, S) the completion tokens
        logits = policy_forward(model, mb.inputs, mb.labels, positions)  # (B, S, V)
        if mb.warmup:
            return -(token_logps(logits, mb.labels) * mask).sum()
        logps = token_logps(logits, mb.labels, g.temperature)  # (B, S)
        old = mb.old_logps if mb.old_logps is not None else logps.detach()
        weight = None  # asynchronous GRPO: a stale snapshot sampled the rows; truncated importance weights
        if mb.sampler_logps is not None:
            weight = torch.exp(old - mb.sampler_logps.to(old.device)).clamp(max=g.is_cap) * mask
        losses, kl, low, high = token_losses(
            logps,
            old,
            mb.advantages.float(),
            g.epsilon,
            g.epsilon_high or g.epsilon,
            mb.ref_token_logps,
            g.beta,
            weight,
        )
        with torch.no_grad():
            # the trainer divides each statistic by the global count: scaled so that gives a mean per token
            per_token = self.global_count / max(self.global_tokens, 1.0)
            for name, value in (
                (("clip_ratio/low", low), ("clip_ratio/high", high))
                + ((("kl", kl),) if kl is not None else ())
                + ((("is_weight", weight),) if weight is not None else ())
            ):
                self._stats[name] = self._stats.get(name, 0) + (value.float() * mask).sum() * per_token
        return loss_sum(losses, mask, g.loss_type)

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("GRPO computes its loss in forward (pipeline parallelism is refused)")

    def step_stats(self) -> dict[str, torch.Tensor]:
        stats, self._stats = self._stats, {}
        return stats

    def record(self) -> dict[str, float]:
        """The last step's rollout figures (global): rewards, lengths, throughput, the time split."""
        return dict(self.rollouts.stats) if self.rollouts is not None else {}


def drive(loop: Loop) -> list[dict]:
    """GRPO's run on a built loop, top to bottom: per step the warm-up's worked examples, or a new batch of
    rollouts (sampled by the generator on the engine-synced policy, scored by the reward functions, reward model
    and judge, their group-relative advantages, the rollout-time and reference log-probabilities under the
    engine's forward context) used for grpo.iterations steps, the LR scaled by grpo.lr_ratio, the engine's step;
    around each step the loop's cadence (loom.train.loop.Running: settle, roll back, validate, log, save, stop)."""
    rollouts, engine, g = loop.objective.rollouts, loop.engine, loop.cfg.grpo
    ahead: list[AsyncSampler] = []  # grpo.max_staleness > 0: the sampler, from the first GRPO step
    if g.max_staleness:
        check_layout(engine, g)  # before the warm-up's steps

    def batches() -> list[RolloutBatch]:
        """This step's micro-batches (a step skipped after a rollback takes them too, unused)."""
        if rollouts.begin_step() <= rollouts.warmup:  # supervised, on worked examples
            return rollouts.end_step(rollouts.warmup_batches())
        if g.max_staleness:
            if not ahead:
                ahead.append(start_sampler(loop))
            mbs = sampled_ahead(rollouts, ahead[0])
        elif rollouts.spent(g.iterations):
            rows, prompts = rollouts.prompts()
            rollouts.sync()  # the generator on the policy's current weights
            t0 = time.perf_counter()
            outs = rollouts.sample(prompts)
            t1 = time.perf_counter()
            total, per, names = rollouts.score(rows, prompts, outs)
            advantages, sums, std = rollouts.advantages(total)
            t2 = time.perf_counter()
            mbs, truncated = rollouts.to_batches(prompts, outs, advantages)
            rollouts.logps(mbs)  # the rollout-time policy's and the reference's, where the loss needs them
            t3 = time.perf_counter()
            seconds = (t1 - t0, t2 - t1, t3 - t2, rollouts.weights.seconds)
            rollouts.set_stats(mbs, total, per, names, sums, std, truncated, outs, seconds)
            mbs = rollouts.hold(mbs)
        else:
            mbs = rollouts.reuse()
        engine.scale_lr(g.lr_ratio)  # this step's LR: the schedule's times grpo.lr_ratio
        return rollouts.end_step(mbs)

    try:
        return step_through(loop, batches)
    finally:
        for sampler in ahead:
            sampler.close()


def start_sampler(loop: Loop) -> AsyncSampler:
    """Asynchronous GRPO's sampler (a thread, or with grpo.sampler_process a process), at the first GRPO step. A
    run resumed past that step is refused in one line: the batches in flight at its checkpoint came from weights the
    checkpoint does not hold."""
    rollouts, g = loop.objective.rollouts, loop.cfg.grpo
    if rollouts.step > rollouts.warmup + 1:
        raise ConfigError(
            "grpo.max_staleness",
            g.max_staleness,
            f"0 to resume this run at step {rollouts.step} (the rollouts in flight at its checkpoint were sampled "
            "from weights it does not hold): resume with --grpo.max_staleness 0, or start over",
        )
    kind = ProcessSampler if g.sampler_process else AsyncSampler  # in a process of its own, or on a thread
    return kind(rollouts, g.max_staleness, loop.cfg.training.steps)


def sampled_ahead(rollouts: Rollouts, sampler: AsyncSampler) -> list[RolloutBatch]:
    """This step's batch from the sampler (sampled on a snapshot of the weights up to grpo.max_staleness steps
    old), scored, its advantages and micro-batches made here, each row with the snapshot's log-probabilities."""
    s = sampler.take(rollouts.step)
    t1 = time.perf_counter()
    total, per, names = rollouts.score(s.rows, s.prompts, s.outs)
    advantages, sums, std = rollouts.advantages(total)
    t2 = time.perf_counter()
    mbs, truncated = rollouts.to_batches(s.prompts, s.outs, advantages)
    for mb, logps in zip(mbs, s.sampler_logps, strict=True):
        mb.sampler_logps = logps
    rollouts.logps(mbs)  # the reference's, where the loss needs them (grpo.iterations is 1)
    t3 = time.perf_counter()
    seconds = (s.seconds, t2 - t1, t3 - t2, sampler.weights.seconds)
    rollouts.set_stats(mbs, total, per, names, sums, std, truncated, s.outs, seconds)
    rollouts.stats.update(
        {
            "async/staleness": float(rollouts.step - 1 - s.version),  # optimizer steps behind the policy
            "async/wait_s": sampler.wait_s,  # the trainer's wait for this batch
            "weight_sync_bytes": float(sampler.weights.bytes),
        }
    )
    return rollouts.hold(mbs)


METHOD = Method(
    "grpo",
    GroupRelative,
    GroupRelative,
    rules=rollout_rules,
    run=runner(drive),
    drive=drive,
    plan=reference_plan,
)
