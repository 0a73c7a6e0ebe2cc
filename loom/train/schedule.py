"""Learning-rate schedules: linear warmup, then cosine, linear, warmup-stable-decay or constant."""

from __future__ import annotations

import math

from loom.config.sections import OptimizerConfig


def lr_factor(step: int, total: int, cfg: OptimizerConfig) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based)."""
    warm = cfg.warmup_steps
    if step < warm:
        return (step + 1) / (warm + 1)
    lo = cfg.min_lr_ratio
    span = max(1, total - warm)
    progress = min(1.0, (step - warm) / span)
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return lo + (1 - lo) * (1 - progress)
    # wsd: stable at the peak, then linear decay over the last decay_fraction of the steps
    decay_steps = max(1, int(total * cfg.decay_fraction))
    decay_start = total - decay_steps
    if step < decay_start:
        return 1.0
    return lo + (1 - lo) * (1 - (step - decay_start) / decay_steps)


def build_scheduler(optimizer, total_steps: int, cfg: OptimizerConfig):
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))
