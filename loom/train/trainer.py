"""``Trainer(cfg).fit()`` is the whole job: the loop (loom.train.loop) around the engine (loom.train.engine), for the
method ``training.objective`` names (loom.methods) unless an objective is handed in."""

from __future__ import annotations

from loom.config.sections import Config
from loom.runtime.env import DistEnv
from loom.train.engine import count_params
from loom.train.loop import Loop
from loom.train.objective import Objective

__all__ = ["Trainer", "count_params"]


class Trainer(Loop):
    """The loop for ``objective`` (default: that of the method the config names), with that method's rules."""

    def __init__(self, cfg: Config, env: DistEnv | None = None, objective: Objective | None = None):
        from loom.methods import (
            method_of,
            rules_of,
        )  # the registry sits above loom.train (tests/unit/test_layers.py)

        super().__init__(cfg, objective or method_of(cfg).objective(cfg), env, rules_of(cfg))
        self.method = method_of(cfg)

    def fit(self) -> list[dict]:
        """The method's run on this loop: the loop's own ``fit``, or its driver (GRPO, PPO)."""
        return self.method.drive(self)
