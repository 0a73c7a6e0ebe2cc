"""Learning-rate schedules: linear warmup, then cosine, linear, warmup-stable-decay or constant.

``lr_factor(step)`` multiplies the peak LR of optimizer step ``step`` (0-based, ``0 .. total - 1``):

* warmup: ``(step + 1) / (warmup + 1)`` for ``step < warmup``, so the first step does not run at LR 0
  and step ``warmup`` is the first at the peak;
* cosine / linear: from the peak at step ``warmup`` down to ``min_lr_ratio`` x peak at the last step;
* wsd: the peak until the last ``decay_fraction`` of the steps, then linear down to ``min_lr_ratio`` x
  peak at the last step;
* constant: the peak after warmup (``min_lr_ratio`` unused).
"""

from __future__ import annotations

import math

from loom.config.sections import OptimizerConfig


def lr_factor(step: int, total: int, cfg: OptimizerConfig) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based) of ``total`` steps."""
    warm = cfg.warmup_steps
    if step < warm:
        return (step + 1) / (warm + 1)
    if cfg.schedule == "constant":
        return 1.0
    lo = cfg.min_lr_ratio
    last = total - 1
    if cfg.schedule == "wsd":
        # stable at the peak, then decay_steps steps that end at the floor on the last step
        decay_steps = max(1, int(total * cfg.decay_fraction))
        done = step - (total - decay_steps) + 1  # decay steps taken, counting this one
        if done <= 0:
            return 1.0
        return lo + (1 - lo) * (1 - min(1.0, done / decay_steps))
    progress = 1.0 if last <= warm else min(1.0, (step - warm) / (last - warm))
    if cfg.schedule == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return lo + (1 - lo) * (1 - progress)
    raise ValueError(f"unknown schedule {cfg.schedule!r}")


def build_scheduler(optimizer, total_steps: int, cfg: OptimizerConfig):
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))


class SchedulerParts:
    """The same LR schedule on every part's optimizer (``OptimizerParts``); one state, saved once."""

    def __init__(self, optimizers, total_steps: int, cfg: OptimizerConfig):
        self.schedulers = [build_scheduler(opt, total_steps, cfg) for opt in optimizers.optimizers]
        self.total_steps, self.cfg = total_steps, cfg

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Take the checkpoint's position in the schedule (``last_epoch``: the optimizer steps taken) and nothing
        else: the peak LR, the schedule and its length are this run's config, so a resumed run with another
        ``optimizer.lr`` / ``schedule`` / ``training.steps`` follows the new schedule from its next step
        (LambdaLR's state would bring back the old ``base_lrs``; the optimizer's the old group LR)."""
        for s in self.schedulers:
            s.load_state_dict(state)
            s.base_lrs = [self.cfg.lr for _ in s.base_lrs]
            for group in s.optimizer.param_groups:
                group["initial_lr"] = self.cfg.lr
        self._set_lr()

    def unstep(self) -> None:
        """Take back the last ``step``: an update the device skipped (non-finite), learnt on the host a step late."""
        for s in self.schedulers:
            s.last_epoch -= 1
        self._set_lr()

    def _set_lr(self) -> None:
        """Every group's LR at the schedulers' position (what LambdaLR.step computes)."""
        for s in self.schedulers:
            lr = self.cfg.lr * lr_factor(s.last_epoch, self.total_steps, self.cfg)
            for group in s.optimizer.param_groups:
                group["lr"] = lr
            s._last_lr = [lr for _ in s.optimizer.param_groups]
