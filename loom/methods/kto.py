"""Kahneman-Tversky optimization (``training.objective kto``): TRL's KTOTrainer loss (sigmoid) on unpaired
desirable / undesirable completions (loom.data.kto), with its KL estimate from mismatched prompt / completion pairs,
against DPO's reference (cached, adapters off, or a frozen copy: loom.methods.dpo's machinery); its rules; its run
(the loop)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.config.errors import ConfigError
from loom.config.sections import APPLIED, MUST_MATCH, Config, opt
from loom.data.loader import MicroBatch
from loom.methods.base import Method, PlanExtras, pair_rules
from loom.methods.dpo import DirectPreference
from loom.parallel.tensor_parallel import loss_parallel_context


@dataclass
class KtoConfig:
    """Kahneman-Tversky optimization (training.objective kto; docs/finetuning.md): TRL's KTOTrainer loss."""

    beta: float = opt(
        0.1,
        "the strength of the pull towards the reference: rewards are beta x (policy - reference) "
        "log-probabilities of a completion",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, "the loss and rewards from the next step"),
    )
    desirable_weight: float = opt(
        1.0,
        "the weight of a desirable (label true) example's loss",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, "the loss from the next step"),
    )
    undesirable_weight: float = opt(
        1.0,
        "the weight of an undesirable (label false) example's loss",
        min=0.0,
        min_exclusive=True,
        resume=(APPLIED, "the loss from the next step"),
    )
    reference: str = opt(
        "cached",
        "the reference model's log-probabilities, as dpo.reference: 'cached' = one pass of the "
        "initial model before the first step, kept in the run dir; 'adapters_off' = the policy "
        "with its LoRA adapters off (needs lora.rank > 0); 'copy' = a frozen copy of the initial "
        "policy (not with LoRA)",
        choices=("cached", "adapters_off", "copy"),
        resume=(MUST_MATCH, "what the policy is compared against"),
    )


# the config sections this method declares (its line in loom.config.methods.METHODS names them)
SECTIONS = {"kto": KtoConfig}


def kto_losses(
    logratios: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """Per example (B,), from the policy - reference log-ratios of the completions (B,), their labels (B,) and the
    KL estimate (a detached scalar): desirable_weight x (1 - sigmoid(beta (logratio - kl))) for a desirable one,
    undesirable_weight x (1 - sigmoid(beta (kl - logratio))) for an undesirable one (TRL's loss_type 'kto')."""
    chosen = desirable_weight * (1 - F.sigmoid(beta * (logratios - kl)))
    rejected = undesirable_weight * (1 - F.sigmoid(beta * (kl - logratios)))
    return torch.where(desirable, chosen, rejected)


def half(mb: MicroBatch, which: int) -> MicroBatch:
    """The completion rows (``which`` 0) or the mismatched KL rows (1) of a KTO micro-batch (loom.data.dpo's
    pair_batch: rows 0..B-1, then B..2B-1)."""
    b = mb.inputs.shape[0] // 2
    rows = slice(which * b, (which + 1) * b)
    return MicroBatch(
        mb.inputs[rows],
        mb.labels[rows],
        mb.positions[rows],
        mb.document_ids[rows],
        None if mb.ref_logps is None else mb.ref_logps[rows],
        mb.desirable,
    )


class KahnemanTversky(DirectPreference):
    """KTO over micro-batches of examples (each a completion row and a KL row). Before a step, ``begin`` estimates
    the KL as TRL does, mean(policy - reference log-probabilities of the mismatched completions) clamped at 0 and
    detached, but over the whole global batch (TRL: over one micro-batch on every process), so a step's loss is the
    same whatever the layout and accumulation; it also counts the global desirable and undesirable examples, whose
    mean rewards and log-probabilities are logged as TRL logs them. The count is examples: a step's loss is the
    mean of the examples' weighted losses (TRL's nanmean)."""

    data = "kto"  # unpaired examples (loom.data.kto), stored as sequence pairs
    rows_per_example = 2  # two rows an example (loom.data.dpo: 2 x micro_batch_size)
    STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
    console = (("kl", "kl", ".3f"), ("margin", "rewards/margins", ".3f"))
    panels = (
        ("implicit rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins"), "beta x log-ratio"),
        ("KL estimate", ("kl",), "mismatched pairs, policy against reference"),
    )

    def __init__(
        self,
        beta: float,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        reference: str = "cached",
    ):
        super().__init__(beta, "sigmoid", reference)
        self.weights = (desirable_weight, undesirable_weight)
        self.kl = torch.zeros(())
        self._per = (torch.ones(()), torch.ones(()))  # global examples / global desirable, / undesirable
        self._engine = None

    def prepare(self, engine) -> None:
        """DPO's reference (loom.methods.dpo: the cached pass over both rows of every example, or the copy); the
        engine is kept for the KL pass of ``begin``."""
        super().prepare(engine)
        self._engine = engine

    def begin(self, mbs: list[MicroBatch], data_sum) -> None:
        """The step's KL estimate and global label counts, from every micro-batch of every data-parallel rank."""
        engine = self._engine
        assert engine is not None, "KTO: prepare(engine) runs before the first step"
        local = torch.zeros(
            4, dtype=torch.float32, device=engine.device
        )  # KL sum, examples, desirable, other
        with torch.no_grad(), loss_parallel_context(engine.loss_parallel):
            for mb in mbs:
                kl_rows = half(mb, 1)
                positions = engine.positions(kl_rows)
                with engine.autocast():
                    ref = self.reference_logps(engine.module, kl_rows, positions)
                    policy = self.logps(engine.module, kl_rows, positions)[0]
                d = mb.desirable.to(local.device)
                local += torch.stack(
                    [
                        (policy - ref.to(policy.dtype)).float().sum(),
                        torch.tensor(float(len(d)), device=local.device),
                        d.sum().float(),
                        (~d).sum().float(),
                    ]
                )
        total = data_sum(local)
        self.kl = (total[0] / total[1].clamp(min=1)).clamp(min=0)
        self._per = (total[1] / total[2].clamp(min=1), total[1] / total[3].clamp(min=1))

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        rows = half(mb, 0)
        positions = None if positions is None else positions[: rows.inputs.shape[0]]
        ref = self.reference_logps(model, rows, positions)
        policy = self.logps(model, rows, positions)[0]
        return self.example_loss(policy, ref.to(policy.dtype), rows.desirable.to(policy.device))

    def example_loss(self, policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor) -> torch.Tensor:
        """The summed loss of the examples from their completions' log-probabilities (B,) under the policy and the
        reference and their labels (B,); accumulates the statistics."""
        kl = self.kl.to(policy.device)
        logratios = policy.float() - ref.float()
        losses = kto_losses(logratios, desirable, kl, self.beta, *self.weights)
        with torch.no_grad():
            rewards = self.beta * logratios.detach()
            per_c, per_r = (p.to(policy.device) for p in self._per)
            c, r = (
                desirable.float() * per_c,
                (~desirable).float() * per_r,
            )  # to means over each kind, once / N
            lp = policy.detach().float()
            values = {
                "rewards/chosen": (rewards * c).sum(),
                "rewards/rejected": (rewards * r).sum(),
                "rewards/margins": (rewards * (c - r)).sum(),
                "logps/chosen": (lp * c).sum(),
                "logps/rejected": (lp * r).sum(),
                "kl": kl * len(desirable),
            }
            for name, value in values.items():
                self._stats[name] = self._stats.get(name, 0) + value
        return losses.sum()


def objective(cfg: Config) -> KahnemanTversky:
    k = cfg.kto
    return KahnemanTversky(k.beta, k.desirable_weight, k.undesirable_weight, k.reference)


def rules(cfg: Config) -> None:
    """DPO's: the reference kto.reference names must be there; no pipeline or context parallelism (an example's
    log-probabilities are summed before the loss); the logits are needed."""
    pair_rules(cfg)
    k, p = cfg.kto, cfg.parallel
    if k.reference == "copy" and cfg.lora.rank:
        raise ConfigError(
            "kto.reference",
            "copy",
            "not with LoRA (lora.rank > 0), as TRL: allowed adapters_off | cached",
        )
    if k.reference == "adapters_off" and not cfg.lora.rank:
        raise ConfigError(
            "kto.reference", "adapters_off", "needs LoRA (lora.rank > 0): allowed cached without it"
        )
    for key, value in (("parallel.pp", p.pp), ("parallel.cp", p.cp)):
        if value > 1:
            raise ConfigError(key, value, "not supported with training.objective kto yet: allowed 1")
    if cfg.model.fused_loss == "true":
        raise ConfigError(
            "model.fused_loss",
            True,
            "training.objective kto needs the logits (per-token log-probabilities): allowed auto | false",
        )


METHOD = Method(
    "kto",
    KahnemanTversky,
    objective,
    rules=rules,
    plan=lambda cfg: PlanExtras(frozen=int(cfg.kto.reference == "copy")),
)
