"""Reward functions: Python callables named ``module:function``, called once per batch of completions as
``fn(prompts=[...], completions=[...], completion_ids=[...], **fields)`` where ``fields`` holds every other field of
the prompt rows (one value per completion, e.g. the embedded task's ``answer``), returning one float per
completion (the calling convention of TRL's reward functions, so theirs work here). Several are combined as a
weighted sum; each one's mean and std are logged."""

from __future__ import annotations

import importlib

import torch

from loom.config.errors import ConfigError


def load_function(spec: str, field: str = "grpo.rewards"):
    """The callable ``spec`` ('package.module:function') names."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(field, spec, "'module:function' (e.g. loom.rl.arithmetic:exact_answer)")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(field, spec, f"an importable 'module:function' ({type(err).__name__}: {err})") from None
    if not callable(fn):
        raise ConfigError(field, spec, "a callable")
    return fn


class Rewards:
    """Reward functions with weights: ``score`` gives the weighted sum per completion and each function's own."""

    def __init__(self, specs: list[str], weights: list[float] | None = None, extra: tuple = ()):
        """``extra``: (name, callable, weight) sources beside the named functions (the judge: loom.rl.judge)."""
        weights = list(weights) if weights else [1.0] * len(specs)
        if not specs and not extra:
            raise ConfigError("grpo.rewards", "", "at least one 'module:function'")
        if len(weights) != len(specs):
            raise ConfigError("grpo.reward_weights", weights, f"one weight per reward function ({len(specs)})")
        self.functions = [load_function(s) for s in specs] + [fn for _, fn, _ in extra]
        self.names = [s.partition(":")[2] for s in specs] + [name for name, _, _ in extra]
        self.weights = torch.tensor(weights + [w for _, _, w in extra], dtype=torch.float32)

    def score(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
              fields: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted total (N,), each function's rewards (N, K)) of N completions, fp32 on the CPU."""
        per = torch.zeros(len(completions), len(self.functions))
        for k, (fn, name) in enumerate(zip(self.functions, self.names)):
            out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
            values = [float(v) for v in out]
            if len(values) != len(completions):
                raise ValueError(f"reward function {name} returned {len(values)} rewards for {len(completions)} "
                                 "completions (one per completion)")
            per[:, k] = torch.tensor(values)
        return per @ self.weights, per
