"""Compute precision: autocast (or FSDP2's policy) over fp32 master weights; fp16 dynamic loss scaling."""

from __future__ import annotations

import contextlib
import math

import torch

from loom.train.hooks import StepHook


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


class Float8Scales(StepHook):
    """training.float8_all_gather: every float8 weight's scale computed once its weights are final for the next
    forward (after each update, a checkpoint's load, a recovering peer's state), in one pass and one all-reduce,
    instead of one all-reduce per weight inside every FSDP2 all-gather of the step (the same scale: the weight's
    global amax; after an update, from the amaxes loom's AdamW wrote in its step where it tracks them); each FSDP2
    unit's shards are then cast to float8 with it at the unit's first gather, in one
    compiled call, which each gather of the step reuses (loom.models.common.float8.cast_shards). The casts are freed
    once the gradients are complete, before the weights change."""

    def __init__(self, parts: list, after_quorum: bool, optimizer=None):
        self.parts, self.after_quorum, self.optimizer = parts, after_quorum, optimizer
        self.from_optimizer = False  # whether the last refresh took the amaxes the optimizer's step wrote

    def refresh(self, updated: bool = False) -> None:
        """The scales and casts; ``updated`` (right after the optimizer's step): from the amaxes that step wrote
        where the optimizer tracks them (loom's AdamW), without another pass over the weights."""
        from loom.models.common.float8 import precompute_scales

        taken = []

        def amaxes(weights):
            amax = self.optimizer.take_amax(weights) if updated and self.optimizer is not None else None
            taken.append(amax is not None)
            return amax

        for part in self.parts:
            precompute_scales(part, amaxes)
        self.from_optimizer = bool(taken) and all(taken)

    def begin(self, step: int) -> None:
        if self.optimizer is not None:
            from loom.models.common.float8 import _gathered_float8_weights

            self.optimizer.track_amax([w for part in self.parts for w in _gathered_float8_weights(part)])
        self.refresh()

    def after_backward(self, params: list) -> None:
        from loom.models.common.float8 import drop_casts

        for part in self.parts:
            drop_casts(part)

    def quorum(self) -> None:
        if self.after_quorum:  # torchft: a recovering group may have just received a peer's weights
            self.refresh()

    def after_update(self, step: int) -> None:
        self.refresh(updated=True)

    def loaded(self, with_state: bool) -> None:
        self.refresh()
