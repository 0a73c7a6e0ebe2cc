"""The reward model (``training.objective reward``): a scalar head on the model (loom.infer.reward's score head)
trained on preference pairs (DPO's data, loom.data.dpo) with the Bradley-Terry loss; its rules; its run (the
loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.config.errors import ConfigError
from loom.data.loader import MicroBatch
from loom.infer.reward import attach_score_head, last_token_scores
from loom.methods.base import Method, pair_rules
from loom.train.objective import Objective


def pair_lengths(mb: MicroBatch) -> torch.Tensor:
    """The tokens of each row of a pair micro-batch (loom.data.dpo.pair_batch marks padding as document 1)."""
    return (mb.document_ids == 0).sum(dim=1)


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, center: float = 0.0) -> torch.Tensor:
    """Per-pair loss (B,): -log sigmoid(r_chosen - r_rejected), plus TRL's ``center_rewards_coefficient`` term
    ``center x (r_chosen + r_rejected)^2`` (it keeps rewards centred on 0) when ``center`` > 0."""
    losses = -F.logsigmoid(chosen - rejected)
    if center:
        losses = losses + center * (chosen + rejected) ** 2
    return losses


class RewardModeling(Objective):
    """The Bradley-Terry objective over micro-batches of pairs (loom.data.dpo: rows chosen 0..B-1, then rejected
    0..B-1). The count is pairs, so a step's loss is the mean over the global batch's pairs whatever the layout and
    accumulation (as DPO's). Statistics per pair: accuracy (chosen above rejected), margin, mean rewards."""

    loss_in_forward = True  # the loss reads one position per row: forward returns it
    data = "dpo"  # DPO's preference pairs (loom.data.dpo)
    rows_per_example = 2  # two rows an example (loom.data.dpo: 2 x micro_batch_size)
    rejected = (
        "code"  # the embedded pairs' rejected answers: a model trained from its seed learns the echoed code
    )
    # DPO's names (its rewards are implicit, these the head's): the progress line and dashboards read both alike
    STATS = ("rewards/accuracy", "rewards/margins", "rewards/chosen", "rewards/rejected")
    # the console line's fields (loom.metrics.logger.ConsoleField) and `loom report`'s panels of this method
    console = (
        ("val acc", "val_rewards/accuracy", ".3f"),
        ("acc", "rewards/accuracy", ".3f"),
        ("margin", "rewards/margins", ".3f"),
    )
    panels = (
        ("pair accuracy", ("rewards/accuracy", "val_rewards/accuracy"), "chosen above rejected"),
        ("rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins"), "score head"),
    )

    def __init__(self, center: float = 0.0):
        self.center = center
        self._stats: dict[str, torch.Tensor] = {}

    def count(self, mb: MicroBatch) -> torch.Tensor:
        return torch.tensor(mb.inputs.shape[0] // 2, device=mb.inputs.device)

    def rewards(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        """Each row's reward (2B,), fp32."""
        return last_token_scores(model(mb.inputs, positions), pair_lengths(mb))  # model: (2B, S, 1)

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        return self.pair_loss(self.rewards(model, mb, positions))

    def pair_loss(self, rewards: torch.Tensor) -> torch.Tensor:
        """The summed loss of the pairs from their rows' rewards (2B,); accumulates the statistics."""
        chosen, rejected = rewards.chunk(2)  # (B,) each
        with torch.no_grad():
            c, r = chosen.detach(), rejected.detach()
            for name, value in zip(self.STATS, ((c > r).float(), c - r, c, r)):
                self._stats[name] = self._stats.get(name, 0) + value.sum()
        return bradley_terry(chosen, rejected, self.center).sum()

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the reward objective computes its loss in forward (pipelines are refused)")

    def step_stats(self) -> dict[str, torch.Tensor]:
        stats, self._stats = self._stats, {}
        return stats

    def replace_head(self, model: torch.nn.Module) -> None:
        attach_score_head(model)  # the trainable score head in place of the LM head


def objective(cfg) -> RewardModeling:
    return RewardModeling(cfg.reward.center_coefficient)


def rules(cfg) -> None:
    """The layouts a reward model does not take yet: a pair's reward is one position of the last stage's output
    (pipeline), of one context-parallel chunk, and the score head's single output row cannot be split over
    tensor-parallel ranks."""
    pair_rules(cfg)
    p = cfg.parallel
    for key, value in (("parallel.pp", p.pp), ("parallel.cp", p.cp), ("parallel.tp", p.tp)):
        if value > 1:
            raise ConfigError(key, value, "not supported with training.objective reward yet: allowed 1")
    t = cfg.training
    if t.eval_hook or t.eval_tasks:
        field = "training.eval_hook" if t.eval_hook else "training.eval_tasks"
        raise ConfigError(
            field,
            t.eval_hook or t.eval_tasks,
            "not with training.objective reward (a reward model "
            "has no LM head to generate or score text with): validation reports val_rewards/*",
        )


METHOD = Method("reward", RewardModeling, objective, rules=rules)
