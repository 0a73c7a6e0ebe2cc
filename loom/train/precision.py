"""Compute precision: autocast (or FSDP2's policy) over fp32 master weights; fp16 dynamic loss scaling."""

from __future__ import annotations

import contextlib
import math

import torch


def autocast_context(dtype: torch.dtype, device: torch.device, fsdp_casts: bool):
    """Autocast unless fp32, or FSDP2 already runs the forward in the compute dtype."""
    if dtype == torch.float32 or fsdp_casts:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class LossScaler:
    """Dynamic loss scaling for float16. The scale is the same on every rank (decisions use the
    global grad norm), an overflowing step is skipped and counted."""

    def __init__(self, enabled: bool, init_scale: float, window: int):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.window = window
        self.good_steps = 0
        self.skipped = 0

    def update(self, grad_norm: float) -> bool:
        """Call with the (scaled) global grad norm; returns whether the optimizer may step."""
        if not self.enabled:
            return math.isfinite(grad_norm)
        if not math.isfinite(grad_norm):
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2
            self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, s: dict) -> None:
        self.scale, self.good_steps, self.skipped = float(s["scale"]), int(s["good_steps"]), int(s["skipped"])
