"""GRPO (``training.objective grpo``): group-relative policy optimization on rollouts sampled by loom's inference
engine on the live policy (loom.rl.rollout). Its objective: GRPO's token loss (a pure function, loom.rl.grpo)
summed over each micro-batch's completion tokens as ``grpo.loss_type`` says, divided by the step by the global
count, so a step is the same whatever the layout; during the warm-up, cross-entropy on the worked examples'
answers (count: answer tokens). Its rules: loom.methods.rollouts."""

from __future__ import annotations

import torch

from loom.methods.base import Method
from loom.methods.rollouts import rollout_rules
from loom.numerics import IGNORE
from loom.rl.grpo import loss_count, loss_sum, token_losses
from loom.rl.rollout import RolloutBatch, RolloutLoader, policy_forward, token_logps
from loom.train.objective import Objective


class GroupRelative(Objective):
    """GRPO over rollouts made each step by the engine on the live policy (``build_loader``, then ``prepare``
    binds the loader to the built model). ``cfg``: the whole config (its [grpo] section and the run's sizes)."""

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
    )
    panels = (
        ("reward", ("reward", "rewards/*"), "mean over the rollouts"),
        ("accuracy", ("rewards/exact_answer", "eval/accuracy"), "exact match (sampled; greedy at evals)"),
        ("KL to the reference", ("kl",), "per completion token"),
    )

    def __init__(self, cfg):
        self.cfg, self.g = cfg, cfg.grpo
        self._stats: dict[str, torch.Tensor] = {}
        self.loader: RolloutLoader | None = None
        self.global_tokens = self.global_count = 1.0  # of the current rollouts: set by the loader

    def build_loader(self, engine) -> RolloutLoader:
        """The objective's own data (the engine asks before building the model)."""
        self.loader = RolloutLoader(self.cfg, engine.tokenizer, engine.dims.dp_rank(), engine.dims.dp_size)
        return self.loader

    def prepare(self, engine) -> None:
        self.loader.bind(engine, self)

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
        losses, kl, low, high = token_losses(
            logps,
            old,
            mb.advantages.float(),
            g.epsilon,
            g.epsilon_high or g.epsilon,
            mb.ref_token_logps,
            g.beta,
        )
        with torch.no_grad():
            # the trainer divides each statistic by the global count: scaled so that gives a mean per token
            per_token = self.global_count / max(self.global_tokens, 1.0)
            for name, value in (("clip_ratio/low", low), ("clip_ratio/high", high)) + (
                (("kl", kl),) if kl is not None else ()
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
        return dict(self.loader.stats) if self.loader is not None else {}


METHOD = Method("grpo", GroupRelative, GroupRelative, rules=rollout_rules)
