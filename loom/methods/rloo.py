"""RLOO (``training.objective rloo``): REINFORCE with a leave-one-out baseline over k = grpo.group_size completions
per prompt, sampled and scored as GRPO's are (loom.rl.rollout: the engine on the live policy, the reward functions,
reward model and judge), with TRL's RLOOTrainer's math: each completion's advantage is its reward minus the mean of
its k - 1 siblings' (optionally normalized over the global batch), a KL penalty to the reference enters the reward
as beta x the completion's summed k1 log-ratio (rollout-time policy against reference), and the loss is the clipped
importance ratio of whole sequences (summed token log-probabilities), averaged over completions. Its run is a driver
that reads top to bottom (``drive``); its math pure functions here, checked against TRL's code by
tests/unit/test_rloo.py.

A step's loss is the sum over its completions divided by the global count of completions, so it is the same whatever
the layout; the normalization of the advantages takes the global batch's mean and std."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loom.config.errors import ConfigError
from loom.config.sections import APPLIED, opt
from loom.methods.base import Method
from loom.methods.grpo import GroupRelative
from loom.methods.rollouts import reference_plan, rollout_rules, runner, step_through
from loom.numerics import IGNORE
from loom.rl.rollout import (
    RolloutBatch,
    Rollouts,
    policy_forward,
    reference_logps,
    set_reference,
    token_logps,
)
from loom.train.objective import Objective

if TYPE_CHECKING:
    from loom.train.loop import Loop


@dataclass
class RlooConfig:
    """RLOO (training.objective rloo; docs/rl.md): its rollouts, rewards, warm-up and clip range are [grpo]'s
    (group_size = k, epsilon / epsilon_high, beta as the KL penalty in the reward, iterations); these are its own."""

    normalize_advantages: bool = opt(
        False,
        "the leave-one-out advantages less their mean over the global batch, over their std (TRL's "
        "normalize_advantages)",
        resume=(APPLIED, "the advantages from the next step"),
    )
    reward_clip: str = opt(
        "",
        "'min,max': the summed rewards clipped to this range before the KL penalty and the baseline (TRL's "
        "reward_clip_range), e.g. '-1,1'; '' = off",
        resume=(APPLIED, "the advantages from the next step"),
    )


SECTIONS = {"rloo": RlooConfig}  # --rloo.normalize_advantages, [rloo]


STD_EPS = 1e-4  # added to the std before dividing, as TRL does


def leave_one_out_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """Rewards (N,) laid out as N / k groups of consecutive completions of one prompt -> each reward minus the mean
    of the other k - 1 of its group (N,) fp32."""
    groups = rewards.float().view(-1, k)  # (P, k)
    baselines = (groups.sum(dim=1, keepdim=True) - groups) / (k - 1)
    return (groups - baselines).view(-1)


def normalized(advantages: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """(advantages - mean) / (std + 1e-4): TRL's normalize_advantages, with the global batch's mean and unbiased
    std (one process: the batch's own)."""
    return (advantages - mean) / (std + STD_EPS)


def sequence_kl(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's summed k1 estimate of KL(policy || reference), logp - ref_logp over its tokens (can be
    negative per token: TRL's RLOO, after the RLOO paper). (B, T) each -> (B,) fp32."""
    return ((old_logps.float() - ref_logps.float()) * mask).sum(dim=-1)


def sequence_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipped surrogate per completion: -min(ratio A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) A) with
    ratio = exp(logp - old_logp) of whole sequences (summed token log-probabilities). (B,) each -> (loss (B,),
    clipped low (B,) bool, clipped high (B,) bool), TRL's clip_ratio/low and /high."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return loss, low, high


def rloo_advantages(
    rewards: torch.Tensor,
    k: int,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
    normalize: bool = False,
    clip: tuple[float, float] | None = None,
    data_sum=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's RLOO advantages of this rank's rewards (N,) (whole groups of k): clipped to ``clip`` (if any), less beta
    x each completion's summed KL (N,), leave-one-out, then (``normalize``) less the global mean over the global
    std; ``data_sum(t)`` sums over the data-parallel ranks (None: one process). -> (advantages (N,), the groups
    whose penalized rewards have a std of zero (P,) bool: TRL's frac_reward_zero_std)."""
    rewards = rewards.float()
    if clip is not None:
        rewards = rewards.clamp(min=clip[0], max=clip[1])
    if beta != 0.0:
        rewards = rewards - beta * kl.float()
    groups = rewards.view(-1, k)
    std = groups.std(dim=1)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    advantages = leave_one_out_advantages(rewards, k)
    if normalize:
        local = torch.stack(
            [
                advantages.double().sum(),
                (advantages.double() ** 2).sum(),
                torch.tensor(float(len(advantages))),
            ]
        )
        total, squares, n = (data_sum(local) if data_sum is not None else local).unbind()
        mean = total / n
        std = ((squares - n * mean**2) / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
        advantages = normalized(advantages, mean.float(), std.float())
    return advantages, zero_std


class LeaveOneOut(Objective):
    """RLOO over rollouts made each step by the engine on the live policy (``build_loader`` makes them;
    ``prepare`` binds them to the built model): per completion the clipped sequence-level surrogate with its
    leave-one-out advantage, summed; the count is completions (TRL's mean over them). During the warm-up,
    cross-entropy on the worked examples' answers (count: answer tokens). ``cfg``: the whole config ([grpo]'s
    sampling, rewards, warm-up, epsilon / epsilon_high, beta, iterations; [rloo]'s normalization and clip)."""

    equal_widths = False  # rollouts: each rank pads its rows to its own longest

    loss_in_forward = (
        True  # the loss needs the advantages and rollout-time log-probabilities beside the logits
    )
    STATS = ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region")

    # the console line's fields and `loom report`'s panels: GRPO's, its KL measured as RLOO's (k1, rollout policy)
    console = GroupRelative.console
    panels = (
        *GroupRelative.panels[:2],
        ("KL to the reference", ("kl",), "per completion token (k1, rollout-time policy)"),
    )

    def __init__(self, cfg):
        self.cfg, self.g = cfg, cfg.grpo
        self._stats: dict[str, torch.Tensor] = {}
        self.rollouts: Rollouts | None = None

    def build_loader(self, engine) -> Rollouts:
        """The objective's own data, its rollouts (the engine asks before building the model)."""
        self.rollouts = Rollouts(self.cfg, engine.tokenizer, engine.dims.dp_rank(), engine.dims.dp_size)
        return self.rollouts

    def prepare(self, engine) -> None:
        self.rollouts.bind(engine, self)

    def count(self, mb: RolloutBatch) -> torch.Tensor:
        if mb.warmup:
            return (mb.labels != IGNORE).sum()
        return torch.tensor(float(mb.labels.shape[0]), device=mb.labels.device)

    def forward(self, model, mb: RolloutBatch, positions: torch.Tensor | None) -> torch.Tensor:
        g = self.g
        mask = (mb.labels != IGNORE).float()  # (B, S) the completion tokens
        logits = policy_forward(model, mb.inputs, mb.labels, positions)  # (B, S, V)
        if mb.warmup:
            return -(token_logps(logits, mb.labels) * mask).sum()
        logps = (token_logps(logits, mb.labels, g.temperature) * mask).sum(dim=1)  # (B,)
        old = (mb.old_logps * mask).sum(dim=1) if mb.old_logps is not None else logps.detach()
        losses, low, high = sequence_losses(
            logps, old, mb.advantages.float(), g.epsilon, g.epsilon_high or g.epsilon
        )
        with torch.no_grad():  # summed over completions: the trainer divides by the global count (a fraction)
            for name, value in zip(self.STATS, (low, high, low | high)):
                self._stats[name] = self._stats.get(name, 0) + value.float().sum()
        return losses.sum()

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("RLOO computes its loss in forward (pipeline parallelism is refused)")

    def step_stats(self) -> dict[str, torch.Tensor]:
        stats, self._stats = self._stats, {}
        return stats

    def record(self) -> dict[str, float]:
        """The last step's rollout figures (global): rewards, KL, lengths, throughput, the time split."""
        return dict(self.rollouts.stats) if self.rollouts is not None else {}


@torch.no_grad()
def rollout_logps(
    rollouts: Rollouts, batches: list[RolloutBatch], policy: bool, reference: bool, temperature
):
    """Per micro-batch, the rollout-time policy's token log-probabilities (``policy``) and the reference's
    (``reference``: the frozen copy taken as RL starts, or the policy with its LoRA adapters off), each (B, S) on the
    host, 0 off the labels; one no-grad forward each under the engine's forward context. -> [(policy or None,
    reference or None)] per micro-batch."""
    engine = rollouts.engine
    if reference and rollouts.reference is not None and not rollouts._reference_set:
        set_reference(rollouts)  # the policy as RL starts (after the warm-up); a resumed run reads it back
        rollouts._reference_set = True
    model = engine.parts[0]
    model.eval()
    out = []
    try:
        for mb in batches:
            inputs, labels = mb.inputs.to(engine.device), mb.labels.to(engine.device)
            with engine.forward_context():
                mine = token_logps(model(inputs), labels, temperature).cpu() if policy else None
                ref = (
                    reference_logps(model, rollouts.reference, inputs, labels, temperature)
                    if reference
                    else None
                )
            out.append((mine, ref))
    finally:
        model.train()
    return out


def drive(loop: Loop) -> list[dict]:
    """RLOO's run on a built loop, top to bottom: per step the warm-up's worked examples, or a new batch of
    rollouts (sampled by the generator on the engine-synced policy, scored by the reward functions, reward model and
    judge; with beta > 0 the rollout-time and reference log-probabilities and each completion's summed KL, taken
    off its reward; the leave-one-out advantages) used for grpo.iterations steps, the LR scaled by grpo.lr_ratio,
    the engine's step; around each step the loop's cadence (loom.train.loop.Running)."""
    objective, engine, g = loop.objective, loop.engine, loop.cfg.grpo
    rollouts, r = objective.rollouts, loop.cfg.rloo

    def batches() -> list[RolloutBatch]:
        """This step's micro-batches (a step skipped after a rollback takes them too, unused)."""
        if rollouts.begin_step() <= rollouts.warmup:  # supervised, on worked examples
            return rollouts.end_step(rollouts.warmup_batches())
        if rollouts.spent(g.iterations):
            rows, prompts = rollouts.prompts()
            rollouts.sync()  # the generator on the policy's current weights
            t0 = time.perf_counter()
            outs = rollouts.sample(prompts)
            t1 = time.perf_counter()
            total, per, names = rollouts.score(rows, prompts, outs)
            _, sums, std = rollouts.advantages(total)  # the global reward figures (GRPO's advantages unused)
            t2 = time.perf_counter()
            mbs, truncated = rollouts.to_batches(prompts, outs, torch.zeros(len(outs)))
            kl = tokens = None
            if g.beta > 0 or g.iterations > 1:
                pairs = rollout_logps(rollouts, mbs, True, g.beta > 0, g.temperature)
                if g.iterations > 1:  # later steps' ratios are against them
                    for mb, (old, _) in zip(mbs, pairs):
                        mb.old_logps = old
                if g.beta > 0:
                    masks = [(mb.labels != IGNORE).float() for mb in mbs]
                    kl = torch.cat([sequence_kl(o, ref, m) for (o, ref), m in zip(pairs, masks)])
                    tokens = sum(m.sum() for m in masks)
            clip = reward_clip(r)
            advantages, zero_std = rloo_advantages(
                total,
                g.group_size,
                kl,
                g.beta,
                r.normalize_advantages,
                clip,
                lambda t: engine.dims.data_sum(t.to(engine.device)).cpu(),  # NCCL sums device tensors
            )
            for i, mb in enumerate(mbs):
                mb.advantages = advantages[i * rollouts.micro : (i + 1) * rollouts.micro]
            t3 = time.perf_counter()
            seconds = (t1 - t0, t2 - t1, t3 - t2, rollouts.weights.seconds)
            rollouts.set_stats(mbs, total, per, names, sums, std, truncated, outs, seconds)
            figures = [zero_std.float().sum(), torch.tensor(float(len(zero_std)))]
            if kl is not None:
                figures += [kl.sum(), tokens]
            glob = engine.dims.data_sum(torch.stack(figures).double().to(engine.device)).cpu()
            rollouts.stats["frac_reward_zero_std"] = float(glob[0] / glob[1])
            if kl is not None:  # per completion token over the global batch, as TRL logs it
                rollouts.stats["kl"] = float(glob[2] / glob[3].clamp(min=1))
            mbs = rollouts.hold(mbs)
        else:
            mbs = rollouts.reuse()
        engine.scale_lr(g.lr_ratio)  # this step's LR: the schedule's times grpo.lr_ratio
        return rollouts.end_step(mbs)

    return step_through(loop, batches)


def rules(cfg) -> None:
    """The rollouts' rules; GRPO's own normalizations mean nothing to RLOO; [rloo]'s clip range in order."""
    rollout_rules(cfg)
    from loom.config.sections import GrpoConfig

    for key in ("loss_type", "scale_rewards"):
        if getattr(cfg.grpo, key) != getattr(GrpoConfig(), key):
            raise ConfigError(
                f"grpo.{key}",
                getattr(cfg.grpo, key),
                "GRPO's normalization: not used by training.objective rloo (leave-one-out baseline, mean over "
                "completions; rloo.normalize_advantages)",
            )
    reward_clip(cfg.rloo)


def reward_clip(r) -> tuple[float, float] | None:
    """[rloo]'s clip range of the summed rewards (TRL's reward_clip_range), None where it is off ('')."""
    if not r.reward_clip.strip():
        return None
    try:
        low, high = (float(v) for v in r.reward_clip.split(","))
    except ValueError:
        low = high = math.nan
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ConfigError("rloo.reward_clip", r.reward_clip, "'min,max' with min <= max (e.g. '-1,1'), or ''")
    return low, high


METHOD = Method(
    "rloo",
    LeaveOneOut,
    LeaveOneOut,
    rules=rules,
    run=runner(drive),
    drive=drive,
    plan=reference_plan,
)
