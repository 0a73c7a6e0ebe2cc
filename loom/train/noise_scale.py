"""The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", Appendix A.1), estimated during training from two gradient norms of every step.

A gradient over B samples has E|G_B|² = |G|² + tr(Σ) / B. Two batch sizes B_small < B_big give unbiased
estimates of both terms; each is smoothed (an exponential moving average) before their ratio is taken, as the
paper does, because the ratio of two noisy estimates is biased.

Which gradients are seen: the step's gradient (every micro-batch on every rank, B_big = the step's global count)
is the one the clipping norm already measures. The small one is the first micro-batch's, read after its backward:
under DDP (``no_sync`` until the last micro-batch) it is each rank's own micro-batch, B_small = its count, and
the ranks' estimates are averaged; under FSDP2 (and HSDP, TP, one process) the gradients are reduced in each
micro-batch's backward, so it is the first micro-batch of every data-parallel rank together, B_small = their
summed count. Either way it needs accumulation (>= 2 micro-batches per step); the one extra cost is that
gradient norm (and a 2-element all-reduce). Units are the objective's (tokens for language modelling)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from loom.train.hooks import StepHook


def unbiased_terms(small_sq, big_sq, b_small, b_big):
    """(|G|², tr(Σ)) from |G_small|², |G_big|² at batch sizes b_small < b_big (the paper's equations A.2, A.3)."""
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


class NoiseScale:
    """Moving averages of the two terms (device tensors: updating never syncs the host); ``value()`` is their
    ratio, B_simple. A step with a non-finite norm leaves the averages as they were."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.g2 = self.trace = None

    @torch.no_grad()
    def update(self, small_sq, big_sq, b_small, b_big) -> None:
        small_sq, big_sq, b_small, b_big = (
            torch.as_tensor(x, dtype=torch.float64) for x in (small_sq, big_sq, b_small, b_big)
        )
        g2, trace = unbiased_terms(small_sq, big_sq, b_small, b_big)
        if self.g2 is None:
            self.g2, self.trace = torch.zeros_like(g2), torch.zeros_like(trace)
            self.weight = torch.zeros_like(
                g2
            )  # the averages' total weight (their bias, which the ratio cancels)
        ok = torch.isfinite(g2) & torch.isfinite(trace) & (0 < b_small) & (b_small < b_big)
        for name, new in (("g2", g2), ("trace", trace), ("weight", torch.ones_like(g2))):
            old = getattr(self, name)
            setattr(self, name, torch.where(ok, self.decay * old + (1 - self.decay) * new, old))

    def value(self) -> float | None:
        """B_simple from the averages; None before the first finite update, and while either average is <= 0 (each
        term's estimate can be negative; early on, their averages too)."""
        if self.g2 is None or float(self.weight) == 0 or float(self.g2) <= 0 or float(self.trace) <= 0:
            return None
        return float(self.trace / self.g2)


@dataclass
class NoiseScaleProbe(StepHook):
    """Runs a step's micro-batches through a step strategy in two parts, the first micro-batch alone, and reads
    the gradient norm in between (docstring of this module). ``local``: pure DDP, whose first micro-batch's
    gradient is this rank's own (its reduction waits for the last micro-batch)."""

    steps: object  # the LocalStep: step(mbs, grad_scale), grad_norm(), module
    dims: object
    count: object  # the objective's count(mb)
    local: bool
    estimator: NoiseScale

    @classmethod
    def build(cls, steps, dims, objective) -> NoiseScaleProbe:
        local = dims.ddp_enabled and not dims.replicate_with_fsdp
        return cls(steps, dims, objective.count, local, NoiseScale())

    def run_step(self, steps, mbs: list, grad_scale: torch.Tensor, loss_scale: float):
        return self.step(mbs, grad_scale, loss_scale)

    def observe_norm(self, norm: torch.Tensor, denominator: torch.Tensor) -> None:
        self.observe(norm, denominator)

    def record(self) -> dict:
        return {"noise_scale": self.value()}

    def step(self, mbs: list, grad_scale: torch.Tensor, loss_scale: float):
        """``steps.step`` over ``mbs``, noting the first micro-batch's gradient norm; returns its StepResult."""
        with self._no_sync():  # under DDP the first micro-batch must not reduce (it is not the step's last)
            first = self.steps.step(mbs[:1], grad_scale)
        # |A_1|: this micro-batch times grad_scale
        norm = self.steps.grad_norm().to(torch.float64) / loss_scale
        count = self.count(mbs[0]).to(device=norm.device, dtype=torch.float64)
        rest = self.steps.step(mbs[1:], grad_scale)
        self._pending = (norm, count)
        first.loss_sum = first.loss_sum + rest.loss_sum
        return first

    @torch.no_grad()
    def observe(self, step_norm: torch.Tensor, denominator: torch.Tensor) -> None:
        """After the step: ``step_norm`` = |G_big| (the step's mean gradient), ``denominator`` = B_big."""
        norm, count = self._pending
        b_big = denominator.to(norm.device, torch.float64)
        ranks = self.dims.dp_size * self.dims.cp
        if self.local:
            # A_1 = grad_scale x (this rank's summed gradient) = ranks / B_big x sum: its mean is A_1 B_big / (ranks b)
            small_sq = (norm * b_big / (ranks * count.clamp(min=1))) ** 2
            # the ranks' mean estimate and size
            both = self.dims.data_sum(torch.stack([small_sq, count])) / ranks
            small_sq, b_small = both[0], both[1]
        else:  # reduced in backward: A_1 = (every rank's first micro-batch summed) / B_big
            b_small = self.dims.data_sum(count.clone())
            small_sq = (norm * b_big / b_small.clamp(min=1)) ** 2
        self.estimator.update(small_sq, step_norm.to(norm.device, torch.float64) ** 2, b_small, b_big)

    def _no_sync(self):
        return self.steps.module.no_sync() if self.local else contextlib.nullcontext()

    def value(self) -> float | None:
        return self.estimator.value()
