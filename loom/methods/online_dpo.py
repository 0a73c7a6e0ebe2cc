"""Online DPO (``training.objective online_dpo``): per prompt two completions sampled by loom's engine on the live
policy (loom.rl.rollout, as GRPO's rollouts), ranked by the reward functions, reward model and judge GRPO supports
(the higher the chosen, the first on a tie; optionally a penalty on completions without an EOS), then DPO's loss on
the pair against a reference (a frozen copy of the policy as online DPO starts, or the policy with its LoRA adapters
off): TRL's OnlineDPOTrainer (1.16, trl.experimental.online_dpo), its loss and logged figures checked against its own
code by tests/unit/test_online_dpo.py. The pair loss is DPO's (loom.methods.dpo.DirectPreference.pair_loss: sigmoid,
or IPO on summed log-ratios as TRL's online trainer has it). Its run is a driver that reads top to bottom (``drive``).

A step's rows are training.global_batch_size completions (half as many prompts, 2 each); a micro-batch holds whole
pairs, its chosen rows first. The count is pairs, so a step's loss is the mean over the global batch's pairs
whatever the layout."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loom.config.errors import ConfigError
from loom.config.sections import APPLIED, GrpoConfig, opt
from loom.methods.base import ROLLOUTS_NOTE, Method, PlanExtras
from loom.methods.dpo import DirectPreference
from loom.methods.rloo import rollout_logps
from loom.methods.rollouts import rollout_rules, runner, step_through
from loom.numerics import IGNORE
from loom.rl.rollout import RolloutBatch, Rollouts, policy_forward, token_logps

if TYPE_CHECKING:
    from loom.train.loop import Loop


@dataclass
class OnlineDpoConfig:
    """Online DPO (training.objective online_dpo; docs/rl.md): its sampling, rewards and warm-up are [grpo]'s (two
    completions per prompt); these are its loss's."""

    beta: float = opt(
        0.1,
        "the strength of the pull towards the reference: rewards are beta x (policy - reference) "
        "log-probabilities of a completion",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, "the loss and rewards from the next step"),
    )
    loss: str = opt(
        "sigmoid",
        "'sigmoid' = DPO's -log sigmoid(beta x margin); 'ipo' = (margin - 1 / (2 beta))^2 on the summed "
        "log-ratios, as TRL's online trainer",
        choices=("sigmoid", "ipo"),
        resume=(APPLIED, "the loss from the next step"),
    )
    missing_eos_penalty: float = opt(
        0.0,
        "subtracted from the reward of a completion without an EOS (cut at grpo.max_new_tokens) before the "
        "pair is ranked; 0 = off",
        min=0.0,
        resume=(APPLIED, "the ranking from the next step"),
    )


SECTIONS = {"online_dpo": OnlineDpoConfig}  # --online_dpo.beta, [online_dpo]


# [grpo]'s fields that are GRPO's loss or group and mean nothing here (online DPO samples 2 per prompt, one step each)
UNUSED_GRPO_FIELDS = (
    "group_size",
    "epsilon",
    "epsilon_high",
    "beta",
    "iterations",
    "loss_type",
    "scale_rewards",
    "mask_truncated",
)


@dataclass
class PairRollouts(RolloutBatch):
    """A micro-batch of P pairs: rows 0..P-1 the chosen completions, P..2P-1 the rejected ones (their prompts in
    the same order); ``ref_token_logps`` the reference's per token; ``scores`` each row's reward (2P,)."""

    scores: torch.Tensor | None = None


def pair_order(rewards: torch.Tensor, pairs_per_micro: int) -> tuple[list[int], torch.Tensor]:
    """Rows laid out as pairs (2p, 2p + 1: one prompt's two completions) with their rewards (2N,) -> (the row order
    that puts each micro-batch's ``pairs_per_micro`` chosen rows, then its rejected rows, together; whether each
    pair's first completion is the chosen one (N,) bool: a reward at least the second's, as TRL's ``>=``)."""
    first, second = rewards[0::2], rewards[1::2]
    first_chosen = first >= second
    order = []
    for start in range(0, len(first), pairs_per_micro):
        pairs = range(start, min(start + pairs_per_micro, len(first)))
        chosen = [2 * p + (0 if first_chosen[p] else 1) for p in pairs]
        order += chosen + [2 * p + (1 if first_chosen[p] else 0) for p in pairs]
    return order, first_chosen


def paired(cfg):
    """The config the rollouts read: two completions per prompt (grpo.group_size 2)."""
    return dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, group_size=2))


class OnlinePreference(DirectPreference):
    """Online DPO over pairs sampled each step (``build_loader`` makes the rollouts, ``prepare`` binds them to the
    built model and takes the reference): per pair DPO's loss on the policy's and the reference's summed
    log-probabilities of the chosen and rejected completions (raw logits, as TRL's online trainer), plus TRL's
    logged figures; during the warm-up, cross-entropy on the worked examples' answers (count: answer tokens)."""

    equal_widths = False  # rollouts: each rank pads its rows to its own longest

    data = "lm"  # nothing prepared: its data are the rollouts (``build_loader``)
    STATS = DirectPreference.STATS + (
        "logps/chosen",
        "logps/rejected",
        "objective/kl",
        "objective/entropy",
        "objective/non_score_reward",
        "objective/rlhf_reward",
        "objective/scores",
        "objective/scores_margin",
    )
    console = (
        ("warm-up", "grpo/warmup", "flag"),
        ("reward", "reward", ".3f"),
        ("acc", "rewards/exact_answer", ".3f"),
        ("eval acc", "eval/accuracy", ".3f"),
        ("pref acc", "rewards/accuracy", ".3f"),
        ("margin", "rewards/margins", ".3f"),
        ("kl", "objective/kl", ".4f"),
    )
    panels = (
        (
            "reward",
            ("reward", "objective/scores"),
            "mean over the rollouts (scores: less the missing-EOS penalty)",
        ),
        ("accuracy", ("rewards/exact_answer", "eval/accuracy"), "exact match (sampled; greedy at evals)"),
        ("implicit rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins"), "beta x log-ratio"),
        ("KL to the reference", ("objective/kl",), "summed over a completion's tokens"),
    )

    def __init__(self, cfg):
        o = cfg.online_dpo
        super().__init__(o.beta, o.loss, "rollouts")
        self.cfg, self.g = cfg, cfg.grpo
        self.rollouts: Rollouts | None = None

    def build_loader(self, engine) -> Rollouts:
        """The objective's own data, its rollouts (the engine asks before building the model)."""
        self.rollouts = Rollouts(
            paired(self.cfg), engine.tokenizer, engine.dims.dp_rank(), engine.dims.dp_size
        )
        return self.rollouts

    def prepare(self, engine) -> None:
        """The rollouts on the built model; the reference: a frozen copy in the policy's layout (set to the policy
        as online DPO starts, after the warm-up), or under LoRA none (the policy with its adapters off)."""
        self.rollouts.bind(engine, self)
        if not self.cfg.lora.rank:
            self.rollouts.reference, self.rollouts._reference_set = engine.frozen_copy(), False

    def count(self, mb: RolloutBatch) -> torch.Tensor:
        if mb.warmup:
            return (mb.labels != IGNORE).sum()
        return torch.tensor(float(mb.labels.shape[0] // 2), device=mb.labels.device)

    def forward(self, model, mb: PairRollouts, positions: torch.Tensor | None) -> torch.Tensor:
        mask = (mb.labels != IGNORE).float()  # (2P, S) the completion tokens
        logits = policy_forward(model, mb.inputs, mb.labels, positions)  # (2P, S, V)
        if mb.warmup:
            return -(token_logps(logits, mb.labels) * mask).sum()
        logps = token_logps(logits, mb.labels) * mask  # (2P, S)
        return self.pairs_loss(logps, mb.ref_token_logps.to(logps.device) * mask, mb.scores.to(logps.device))

    def pairs_loss(self, logps: torch.Tensor, ref_logps: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The summed loss of P pairs from per-token log-probabilities (2P, S) of the policy and the reference (0
        off the completions; rows chosen 0..P-1, rejected P..2P-1) and the rows' rewards (2P,): DPO's pair loss on
        the summed log-probabilities (IPO unnormalized by length: counts of 1, as TRL's online trainer); TRL's
        figures summed over the pairs (the engine divides by the global count of pairs)."""
        policy, ref = logps.sum(dim=1), ref_logps.sum(dim=1)  # (2P,)
        loss = self.pair_loss(policy, ref.to(policy.dtype), torch.ones_like(policy))
        with torch.no_grad():
            kl = (logps.detach() - ref_logps).sum(dim=1).float()  # (2P,) per completion
            lp, s = policy.detach().float(), scores.float()
            chosen, rejected = lp.chunk(2)
            s_chosen, s_rejected = s.chunk(2)
            pair = lambda t: t.view(2, -1).sum(0) / 2  # a pair's mean over its two completions (P,)
            non_score = -self.beta * kl
            values = {
                "logps/chosen": chosen.sum(),
                "logps/rejected": rejected.sum(),
                "objective/kl": pair(kl).sum(),
                "objective/entropy": pair(-lp).sum(),
                "objective/non_score_reward": pair(non_score).sum(),
                "objective/rlhf_reward": pair(s + non_score).sum(),
                "objective/scores": pair(s).sum(),
                "objective/scores_margin": (s_chosen - s_rejected).sum(),
            }
            for name, value in values.items():
                self._stats[name] = self._stats.get(name, 0) + value
        return loss

    def record(self) -> dict[str, float]:
        """The last step's rollout figures (global): rewards, lengths, EOS share, throughput, the time split."""
        return dict(self.rollouts.stats) if self.rollouts is not None else {}


def objective(cfg) -> OnlinePreference:
    return OnlinePreference(cfg)


def drive(loop: Loop) -> list[dict]:
    """Online DPO's run on a built loop, top to bottom: per step the warm-up's worked examples, or two new
    completions per prompt (sampled by the generator on the engine-synced policy, scored by the reward functions,
    reward model and judge, less online_dpo.missing_eos_penalty where a completion has no EOS), each pair ranked and
    its rows laid out chosen first per micro-batch, the reference's log-probabilities under the engine's forward
    context; the LR scaled by grpo.lr_ratio, the engine's step; around each step the loop's cadence
    (loom.train.loop.Running)."""
    objective, engine, g = loop.objective, loop.engine, loop.cfg.grpo
    rollouts, o = objective.rollouts, loop.cfg.online_dpo

    def batches() -> list[PairRollouts]:
        """This step's micro-batches (a step skipped after a rollback takes them too, unused)."""
        if rollouts.begin_step() <= rollouts.warmup:  # supervised, on worked examples
            return rollouts.end_step(rollouts.warmup_batches())
        rows, prompts = rollouts.prompts()  # each prompt twice
        rollouts.sync()  # the generator on the policy's current weights
        t0 = time.perf_counter()
        outs = rollouts.sample(prompts)
        t1 = time.perf_counter()
        total, per, names = rollouts.score(rows, prompts, outs)
        _, sums, std = rollouts.advantages(total)  # the global reward figures, as the sources scored them
        eos = torch.tensor([rollouts.tokenizer.eos_id in o_.token_ids for o_ in outs])
        if o.missing_eos_penalty:  # the ranking's scores (TRL's objective/scores)
            total = total - o.missing_eos_penalty * (~eos).float()
        t2 = time.perf_counter()
        order, _ = pair_order(total, rollouts.micro // 2)
        mbs, truncated = rollouts.to_batches(
            [prompts[i] for i in order], [outs[i] for i in order], torch.zeros(len(outs))
        )
        scores = total[order]
        refs = rollout_logps(rollouts, mbs, False, True, 1.0)  # raw logits, as TRL's online trainer
        mbs = [
            PairRollouts(
                **{f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)},
                scores=scores[i * rollouts.micro : (i + 1) * rollouts.micro],
            )
            for i, mb in enumerate(mbs)
        ]
        for mb, (_, ref) in zip(mbs, refs):
            mb.ref_token_logps = ref
        t3 = time.perf_counter()
        seconds = (t1 - t0, t2 - t1, t3 - t2, rollouts.weights.seconds)
        rollouts.set_stats(mbs, total, per, names, sums, std, truncated, outs, seconds)
        glob = engine.dims.data_sum(torch.tensor([float(eos.sum()), float(len(eos))], device=engine.device))
        rollouts.stats["val/contain_eos_token"] = float(glob[0] / glob[1])
        engine.scale_lr(g.lr_ratio)  # this step's LR: the schedule's times grpo.lr_ratio
        return rollouts.end_step(rollouts.hold(mbs))

    return step_through(loop, batches)


def rules(cfg) -> None:
    """The rollouts' rules; GRPO's loss and group fields mean nothing here (two completions per prompt, DPO's
    loss); a micro-batch holds whole pairs."""
    rollout_rules(cfg)
    defaults = GrpoConfig()
    for key in UNUSED_GRPO_FIELDS:
        if getattr(cfg.grpo, key) != getattr(defaults, key):
            raise ConfigError(
                f"grpo.{key}",
                getattr(cfg.grpo, key),
                "GRPO's loss or group: not used by training.objective online_dpo (two completions per prompt, "
                "DPO's loss: [online_dpo])",
            )
    t = cfg.training
    if t.micro_batch_size % 2:
        raise ConfigError(
            "training.micro_batch_size",
            t.micro_batch_size,
            "an even number of completions under training.objective online_dpo (a micro-batch holds whole pairs)",
        )


METHOD = Method(
    "online_dpo",
    OnlinePreference,
    objective,
    rules=rules,
    run=runner(drive),
    drive=drive,
    plan=lambda cfg: PlanExtras(
        frozen=int(not cfg.lora.rank), note=ROLLOUTS_NOTE, rollout_rows=cfg.training.global_batch_size
    ),
)
