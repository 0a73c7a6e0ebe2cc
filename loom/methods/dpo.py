"""Direct preference optimization (``training.objective dpo``): the DPO loss over preference pairs (loom.data.dpo)
against a reference (cached log-probabilities, the policy with its adapters off, or a frozen copy); its rules; its
run (the loop)."""

from __future__ import annotations

import hashlib
import os

import torch
import torch.nn.functional as F

from loom.checkpoint.manager import content_fingerprint
from loom.config.errors import ConfigError, UserError
from loom.config.sections import Config
from loom.data.loader import MicroBatch
from loom.methods.base import Method, PlanExtras, pair_rules
from loom.models.common.lora import adapters_disabled
from loom.numerics import IGNORE
from loom.parallel.tensor_parallel import loss_parallel_context, to_local_loss
from loom.train.objective import Objective, release_gathered


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-probability of its labelled tokens, fp32 (N,), and their count (N,). logits: (N, S, V)
    (or vocab-sharded under loss parallel); labels: (N, S), IGNORE where a token is not the completion's."""
    n, s = labels.shape
    nll = F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return -to_local_loss(nll).view(n, s).sum(dim=1), (labels != IGNORE).sum(dim=1)


class DirectPreference(Objective):
    """DPO over micro-batches of pairs (loom.data.dpo: rows chosen 0..B-1, then rejected 0..B-1). Per pair, the
    policy's and the reference's summed log-probabilities of the chosen (pc, rc) and rejected (pr, rr) completions
    give the loss, as TRL's DPOTrainer computes it: 'sigmoid' -log sigmoid(beta ((pc - rc) - (pr - rr))); 'ipo'
    (((pc - rc) / |chosen| - (pr - rr) / |rejected|) - 1 / (2 beta))^2, log-ratios averaged over each completion's
    tokens. The count is pairs, so a step's loss is the mean over the global batch's pairs whatever the layout.

    ``reference``: 'cached' = the micro-batch's ``ref_logps`` (the initial model's, computed before the first step);
    'adapters_off' = the policy itself with its LoRA adapters off, under no_grad; 'copy' = a frozen copy of the
    initial policy (``reference_model``, built by ``prepare`` in the policy's layout), under no_grad."""

    loss_in_forward = True  # the loss needs the reference beside the logits: forward returns it
    data = "dpo"  # preference pairs (loom.data.dpo)
    rows_per_example = 2  # two rows an example (loom.data.dpo: 2 x micro_batch_size)
    STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy")

    # the console line's fields (loom.metrics.logger.ConsoleField) and `loom report`'s panels of this method
    console = (
        ("val acc", "val_rewards/accuracy", ".3f"),
        ("acc", "rewards/accuracy", ".3f"),
        ("margin", "rewards/margins", ".3f"),
    )
    panels = (
        ("preference accuracy", ("rewards/accuracy", "val_rewards/accuracy"), "chosen above rejected"),
        ("implicit rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins"), "beta x log-ratio"),
    )

    def __init__(self, beta: float, loss: str = "sigmoid", reference: str = "cached"):
        self.beta, self.kind, self.reference = beta, loss, reference
        self._stats: dict[str, torch.Tensor] = {}
        self.reference_model: torch.nn.Module | None = None  # dpo.reference copy: set by prepare

    def count(self, mb: MicroBatch) -> torch.Tensor:
        return torch.tensor(mb.inputs.shape[0] // 2, device=mb.inputs.device)

    def prepare(self, engine) -> None:
        """dpo.reference cached: the initial model's log-probabilities of every pair (training and validation), from
        one no-grad pass before the first step (the model before any checkpoint is loaded), kept in the run dir and
        read back by later runs in it (a resume); the loader hands them out with each micro-batch. Each pair is
        computed on one data-parallel rank, and a sum over the ranks gives every rank all of them. dpo.reference
        copy: the frozen copy of the initial policy (the engine's ``frozen_copy``)."""
        cfg, loader = engine.cfg, engine.loader
        if self.reference == "copy":
            self.reference_model = engine.frozen_copy()
            return
        if self.reference != "cached":
            return
        src, device = loader.source, engine.device
        # keyed by the initial weights' content, not their path: another model exported to the same folder (the
        # usual workflow) is another reference
        weights = engine.env.share_from_main(
            [
                content_fingerprint(p) if p and os.path.exists(p) else ""
                for p in (cfg.model.init_from, cfg.lora.init_from)
            ]
            if engine.env.is_main
            else None
        )
        key = hashlib.blake2b(
            repr(
                (
                    os.path.abspath(src.tokens.path),
                    src.seq_len,
                    cfg.run.seed,
                    cfg.model.flavor,
                    cfg.model.init_from,
                    cfg.model.n_layers,
                    cfg.model.vocab_size,
                    cfg.lora.rank,
                    cfg.lora.init_from,
                    weights,
                )
            ).encode(),
            digest_size=8,
        ).hexdigest()
        path = os.path.join(engine.run_dir, "dpo_reference", f"reference-{key}.pt")
        # rank 0 reads the cache and hands it to every rank (they agree on computing it or not); a file that
        # cannot be read (cut short by a crash) is computed again, not a traceback
        ref = engine.env.share_from_main(_read_reference(path, len(src.kept)) if engine.env.is_main else None)
        if ref is None:
            ref = torch.zeros(len(src.kept), 2, device=device)
            for part in engine.parts:
                part.eval()
            with torch.no_grad(), loss_parallel_context(engine.loss_parallel):
                for mb, ids in loader.reference_batches():
                    mb = engine.local_tokens(mb)
                    with engine.autocast():
                        logps = self.logps(engine.module, mb, engine.positions(mb))[0]
                    mine = ids >= 0
                    ref[ids[mine].to(device)] = logps.view(2, -1).T[mine.to(device)].float()
            for part in engine.parts:
                part.train()
            ref = engine.dims.data_sum(ref).cpu()  # every pair computed on exactly one data-parallel rank
            if engine.env.is_main:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                try:
                    with open(path + ".tmp", "wb") as fh:
                        torch.save(ref, fh)
                        fh.flush()
                        os.fsync(fh.fileno())  # durable before the rename makes it the cache
                    os.replace(path + ".tmp", path)
                except (OSError, RuntimeError) as err:  # torch.save wraps a full disk in a RuntimeError
                    if os.path.exists(path + ".tmp"):
                        os.remove(path + ".tmp")
                    raise UserError(
                        f"dpo.reference cached: writing {path} failed ({err}): it needs about "
                        f"{ref.numel() * ref.element_size():,} bytes; nothing partial was kept"
                    ) from None
            engine.env.barrier()
        loader.reference = ref

    def logps(
        self, model, mb: MicroBatch, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probability sums (2B,), completion token counts (2B,)) of the micro-batch's rows under ``model``."""
        return sequence_logps(model(mb.inputs, positions), mb.labels)

    def reference_logps(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        """The reference's log-probability sums of the micro-batch's rows (no gradient): the cached ones it carries,
        the policy ``model`` with its adapters off, or the frozen copy (KTO calls this too)."""
        if self.reference == "adapters_off":
            with torch.no_grad(), adapters_disabled(model):
                return self.logps(model, mb, positions)[0]
        if self.reference == "copy":
            assert self.reference_model is not None, (
                "dpo.reference copy: prepare(engine) builds the reference model"
            )
            with torch.no_grad():
                ref = self.logps(self.reference_model, mb, positions)[0]
            release_gathered(self.reference_model)
            return ref
        assert mb.ref_logps is not None, (
            "dpo.reference cached: the loader hands out no reference log-probabilities"
        )
        return mb.ref_logps

    def forward(self, model, mb: MicroBatch, positions: torch.Tensor | None) -> torch.Tensor:
        ref = self.reference_logps(model, mb, positions)
        policy, counts = self.logps(model, mb, positions)
        return self.pair_loss(policy, ref.to(policy.dtype), counts)

    def pair_loss(self, policy: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The summed loss of the pairs from rows' log-probabilities (2B,) of the policy and the reference and their
        completion token counts; accumulates the reward statistics."""
        chosen, rejected = (policy - ref).chunk(2)  # log-ratios (B,) each
        if self.kind == "ipo":
            n_chosen, n_rejected = counts.to(policy.dtype).clamp(min=1).chunk(2)
            losses = (chosen / n_chosen - rejected / n_rejected - 1 / (2 * self.beta)) ** 2
        else:
            losses = -F.logsigmoid(self.beta * (chosen - rejected))
        with torch.no_grad():
            r_chosen, r_rejected = self.beta * chosen.detach(), self.beta * rejected.detach()
            for name, value in zip(
                self.STATS,
                (r_chosen, r_rejected, r_chosen - r_rejected, (r_chosen > r_rejected).to(policy.dtype)),
            ):
                self._stats[name] = self._stats.get(name, 0) + value.sum()
        return losses.sum()

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "DPO computes its loss in forward (a pipeline stage cannot: refused by the config)"
        )

    def step_stats(self) -> dict[str, torch.Tensor]:
        stats, self._stats = self._stats, {}
        return stats


def objective(cfg: Config) -> DirectPreference:
    return DirectPreference(cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.reference)


def rules(cfg: Config) -> None:
    """The reference [dpo] names must be there; the layouts a pair's loss cannot be split over yet (a pair's
    log-probabilities are summed before the loss, which is not linear in them: pipeline stages and context-parallel
    chunks would each hold part of the sum)."""
    pair_rules(cfg)
    dpo, p = cfg.dpo, cfg.parallel
    if dpo.reference == "copy" and cfg.lora.rank:
        raise ConfigError(
            "dpo.reference",
            "copy",
            "not with LoRA (lora.rank > 0), as TRL: allowed adapters_off (the "
            "base is the reference, no second copy) | cached",
        )
    if dpo.reference == "adapters_off" and not cfg.lora.rank:
        raise ConfigError(
            "dpo.reference", "adapters_off", "needs LoRA (lora.rank > 0): allowed cached without it"
        )
    for key, value in (("parallel.pp", p.pp), ("parallel.cp", p.cp)):
        if value > 1:
            raise ConfigError(key, value, "not supported with training.objective dpo yet: allowed 1")
    if cfg.model.fused_loss == "true":
        raise ConfigError(
            "model.fused_loss",
            True,
            "training.objective dpo needs the logits (per-token log-probabilities): allowed auto | false",
        )


METHOD = Method(
    "dpo",
    DirectPreference,
    objective,
    rules=rules,
    plan=lambda cfg: PlanExtras(frozen=int(cfg.dpo.reference == "copy")),
)


def _read_reference(path: str, pairs: int) -> torch.Tensor | None:
    """The cached reference log-probabilities at ``path`` ((pairs, 2) float32), None where there is none to reuse:
    no file, another shape, or a file that cannot be read (said in one line: it is computed again)."""
    if not os.path.isfile(path):
        return None
    try:
        ref = torch.load(path, weights_only=True)
    except Exception as err:  # a cut-short zip: RuntimeError; other damage: pickle or OS errors
        print(
            f"dpo.reference cached: {path} cannot be read ({str(err).split('.')[0]}): computing it again",
            flush=True,
        )
        return None
    if not isinstance(ref, torch.Tensor) or ref.shape != (pairs, 2):
        return None
    print(
        f"dpo.reference cached: reusing {path} (computed for the same initial weights, by content, and the same "
        "pairs)",
        flush=True,
    )
    return ref
