"""PPO (``training.objective ppo``): a value function on the policy and GAE over rollouts sampled as GRPO's are
(loom.rl.ppo_objective), its losses pure functions (loom.rl.ppo); its objective, its rules (loom.methods.rollouts
and below) and its run, a driver that reads top to bottom (``drive``)."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from loom.config.errors import ConfigError
from loom.config.sections import Config
from loom.methods.base import ROLLOUTS_NOTE, Method, PlanExtras
from loom.methods.rollouts import grpo_loss_unused, rollout_rules, runner, step_through
from loom.numerics import IGNORE
from loom.rl.grpo import kl_k3
from loom.rl.ppo import policy_losses, value_losses
from loom.rl.ppo_objective import PpoBatch, PpoRollouts, attach_critic, attach_value_head, forward_with_values
from loom.rl.rollout import RolloutBatch, policy_forward, token_logps
from loom.train.objective import Objective

if TYPE_CHECKING:
    from loom.train.loop import Loop


class ProximalPolicy(Objective):
    """PPO over the rollouts' micro-batches (``build_loader``; ``prepare`` binds them to the built model): per
    completion token the clipped policy loss + ppo.vf_coef x the clipped value loss (+ ppo.kl_coef x the k3 KL to
    the reference with ppo.kl_penalty loss), summed; the count is completion tokens, so a step's loss is the mean
    per token of the global mini-batch whatever the layout. During the warm-up, cross-entropy on the worked
    examples' answers."""

    equal_widths = False  # rollouts: each rank pads its rows to its own longest

    loss_in_forward = (
        True  # the loss needs values, advantages and rollout-time log-probabilities beside the logits
    )
    STATS = ("ppo/policy_loss", "ppo/value_loss", "ppo/clipfrac", "ppo/value_clipfrac", "ppo/approx_kl")
    # the console line's fields (loom.metrics.logger.ConsoleField) and `loom report`'s panels of this method: the
    # sampled rollouts' mean reward and its parts (the embedded task's exact_answer is their accuracy), the greedy
    # accuracy of the evaluation hook (loom.rl.arithmetic:greedy_accuracy), the KL to the reference where computed
    console = (
        ("warm-up", "grpo/warmup", "flag"),
        ("reward", "reward", ".3f"),
        ("acc", "rewards/exact_answer", ".3f"),
        ("", "rewards/*", ".3f"),
        ("eval acc", "eval/accuracy", ".3f"),
        ("kl", "ppo/rollout_kl", ".4f"),
    )
    panels = (
        ("reward", ("reward", "rewards/*"), "mean over the rollouts"),
        ("accuracy", ("rewards/exact_answer", "eval/accuracy"), "exact match (sampled; greedy at evals)"),
        ("KL to the reference", ("ppo/rollout_kl",), "per completion token"),
    )

    def __init__(self, cfg):
        self.cfg, self.g, self.p = cfg, cfg.grpo, cfg.ppo
        self._stats: dict[str, torch.Tensor] = {}
        self.rollouts: PpoRollouts | None = None

    def attach(self, model: nn.Module) -> None:
        (attach_critic if self.p.critic == "model" else attach_value_head)(model)

    @contextlib.contextmanager
    def heads_hidden(self, parts: list[nn.Module]):
        """The parts without their value function for a while: model.init_from loads the policy's weights by the
        policy's names (the folder holds no value head; it keeps its seeded init, a critic its copy at PPO's start)."""
        hidden = [
            (part, name, part._modules.pop(name))
            for part in parts
            for name in ("value_head", "critic")
            if name in part._modules
        ]
        try:
            yield
        finally:
            for part, name, module in hidden:
                part._modules[name] = module

    def build_loader(self, engine) -> PpoRollouts:
        """The objective's own data, its rollouts (the engine asks before building the model)."""
        self.rollouts = PpoRollouts(self.cfg, engine.tokenizer, engine.dims.dp_rank(), engine.dims.dp_size)
        return self.rollouts

    def prepare(self, engine) -> None:
        self.rollouts.bind(engine, self)

    def count(self, mb: RolloutBatch) -> torch.Tensor:
        return (mb.labels != IGNORE).sum()

    def forward(self, model, mb: PpoBatch, positions: torch.Tensor | None) -> torch.Tensor:
        g, p = self.g, self.p
        mask = (mb.labels != IGNORE).float()  # (B, S) the completion tokens
        # (B, S, V), (B, S)
        logits, values = policy_forward(model, mb.inputs, mb.labels, positions, forward_with_values)
        # the value head joins with weight 0: DDP expects a gradient for every trained parameter
        if mb.warmup:
            return -(token_logps(logits, mb.labels) * mask).sum() + 0.0 * values.sum()
        logps = token_logps(logits, mb.labels, g.temperature)  # (B, S)
        pg, pg_clipped = policy_losses(logps, mb.old_logps, mb.advantages, p.cliprange)
        vf, vf_clipped = value_losses(values, mb.old_values, mb.returns, p.cliprange_value)
        losses = pg + p.vf_coef * vf
        kl = None
        if mb.ref_token_logps is not None:
            kl = kl_k3(logps, mb.ref_token_logps)
            losses = losses + p.kl_coef * kl
        with torch.no_grad():
            approx_kl = 0.5 * (logps - mb.old_logps) ** 2
            for name, value in tuple(zip(self.STATS, (pg, vf, pg_clipped, vf_clipped, approx_kl))) + (
                (("kl", kl),) if kl is not None else ()
            ):
                self._stats[name] = self._stats.get(name, 0) + (value.float() * mask).sum()
        return (losses * mask).sum()

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("PPO computes its loss in forward (pipeline parallelism is refused)")

    def step_stats(self) -> dict[str, torch.Tensor]:
        stats, self._stats = self._stats, {}
        return stats

    def record(self) -> dict[str, float]:
        """The last step's rollout figures (global)."""
        return dict(self.rollouts.stats) if self.rollouts is not None else {}


def rules(cfg) -> None:
    """The rollouts' rules and GRPO's loss fields unset; the critic and KL choices that do not combine."""
    grpo_loss_unused(cfg)
    rollout_rules(cfg)
    if cfg.ppo.critic == "model" and cfg.lora.base_dtype == "nf4":
        raise ConfigError(
            "ppo.critic",
            "model",
            "not with lora.base_dtype nf4 (the critic copies the base weights): allowed head",
        )
    if cfg.ppo.kl_penalty == "loss" and cfg.ppo.kl_estimator != "k1":
        raise ConfigError(
            "ppo.kl_estimator",
            cfg.ppo.kl_estimator,
            "applies to the KL in the rewards: with "
            "ppo.kl_penalty loss the loss term is k3 (leave the estimator at k1)",
        )


def drive(loop: Loop) -> list[dict]:
    """PPO's run on a built loop, top to bottom: per step the warm-up's worked examples, or the next mini-batch of
    the held global batch of rollouts; a new batch (ppo.mini_batches steps' worth) once the last has fed its
    ppo.epochs x ppo.mini_batches steps: sampled by the generator on the engine-synced policy, scored by the reward
    functions, reward model and judge, the rollout-time log-probabilities and values and the reference's
    log-probabilities under the engine's forward context, gathered whole on every rank, its per-token rewards, GAE
    advantages and returns; the LR scaled by grpo.lr_ratio, the engine's step; around each step the loop's cadence
    (loom.train.loop.Running: settle, roll back, validate, log, save, stop)."""
    rollouts, engine, g = loop.objective.rollouts, loop.engine, loop.cfg.grpo

    def batches() -> list[PpoBatch]:
        """This step's micro-batches (a step skipped after a rollback takes them too, unused)."""
        if rollouts.begin_step() <= rollouts.warmup:  # supervised, on worked examples
            return rollouts.end_step(rollouts.warmup_batches())
        if not rollouts.plan:
            rows, prompts = rollouts.prompts()
            rollouts.sync()  # the generator on the policy's current weights
            t0 = time.perf_counter()
            outs = rollouts.sample(prompts)
            t1 = time.perf_counter()
            scores, per, names = rollouts.score(rows, prompts, outs)
            t2 = time.perf_counter()
            local, truncated = rollouts.to_rows(prompts, outs)
            old_logps, values, ref_logps = rollouts.forwards(local)
            t3 = time.perf_counter()
            lengths = [len(o.token_ids) for o in outs]
            batch = rollouts.gather(
                local.inputs, local.labels, old_logps, values, ref_logps, scores, per, truncated, lengths
            )
            rollouts.gae_advantages(batch)  # the same on every rank: the batch is global
            rollouts.hold_batch(batch)
            judged = rollouts.judge.unparsed if rollouts.judge is not None else 0.0
            w = rollouts.weights
            rollouts.set_ppo_stats(batch, names, (t1 - t0, t2 - t1, t3 - t2, w.seconds, w.bytes, judged))
        else:
            rollouts.reuse()
        mbs = rollouts.mini_batch(*rollouts.plan.pop(0))
        engine.scale_lr(g.lr_ratio)  # this step's LR: the schedule's times grpo.lr_ratio
        return rollouts.end_step(mbs)

    return step_through(loop, batches)


def plan(cfg: Config) -> PlanExtras:
    """For the planner: the KL reference (a frozen copy, none under LoRA: adapters off) and ppo.critic model (a
    second model of the policy's shape, trained beside it)."""
    p = cfg.ppo
    frozen = int(p.kl_coef > 0 and not cfg.lora.rank)
    rows = (
        cfg.training.global_batch_size * p.mini_batches
    )  # one batch of rollouts, ppo.mini_batches steps' worth
    return PlanExtras(frozen=frozen, trained=int(p.critic == "model"), note=ROLLOUTS_NOTE, rollout_rows=rows)


METHOD = Method(
    "ppo",
    ProximalPolicy,
    ProximalPolicy,
    rules=rules,
    run=runner(drive),
    drive=drive,
    plan=plan,
)
