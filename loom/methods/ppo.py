"""PPO (``training.objective ppo``): a value function on the policy and GAE over rollouts sampled as GRPO's are
(loom.rl.ppo_objective), its losses pure functions (loom.rl.ppo); its objective and its rules (loom.methods.rollouts
and below)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from loom.config.errors import ConfigError
from loom.methods.base import Method
from loom.methods.rollouts import grpo_loss_unused, rollout_rules
from loom.numerics import IGNORE
from loom.rl.grpo import kl_k3
from loom.rl.ppo import policy_losses, value_losses
from loom.rl.ppo_objective import PpoBatch, PpoRollouts, attach_critic, attach_value_head, forward_with_values
from loom.rl.rollout import RolloutBatch, policy_forward, token_logps
from loom.train.objective import Objective


class ProximalPolicy(Objective):
    """PPO over the rollout loader's micro-batches (``build_loader``; ``prepare`` binds it to the built model): per
    completion token the clipped policy loss + ppo.vf_coef x the clipped value loss (+ ppo.kl_coef x the k3 KL to
    the reference with ppo.kl_penalty loss), summed; the count is completion tokens, so a step's loss is the mean
    per token of the global mini-batch whatever the layout. During the warm-up, cross-entropy on the worked
    examples' answers."""

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
        self.loader: PpoRollouts | None = None

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
        self.loader = PpoRollouts(self.cfg, engine.tokenizer, engine.dims.dp_rank(), engine.dims.dp_size)
        return self.loader

    def prepare(self, engine) -> None:
        self.loader.bind(engine, self)

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
        return dict(self.loader.stats) if self.loader is not None else {}


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


METHOD = Method("ppo", ProximalPolicy, ProximalPolicy, rules=rules)
