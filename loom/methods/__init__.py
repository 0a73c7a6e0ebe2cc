"""Training methods, one module each (loom.methods.<name>: its objective, data, heads, rules and run). ``METHODS``
is the one place that maps a ``training.objective`` name to its method: its module (imported on demand: GRPO and
PPO bring loom.rl) and the config sections it reads. The resolver is handed the chosen method's rules here
(``check_config``, ``resolve``)."""

from __future__ import annotations

from loom.config.sections import Config
from loom.methods.base import Method
from loom.methods.registry import METHODS, method, method_of, rules_of, sections_unused
from loom.resolve import Run
from loom.resolve import check_config as _check_config
from loom.resolve import resolve as _resolve

__all__ = [
    "METHODS",
    "Method",
    "check_config",
    "method",
    "method_of",
    "resolve",
    "rules_of",
    "sections_unused",
]


def check_config(cfg: Config) -> None:
    """loom.resolve.check_config with the chosen method's rules."""
    _check_config(cfg, rules_of(cfg))


def resolve(cfg: Config, world_size: int, tokenizer=None, **kwargs) -> Run:
    """loom.resolve.resolve with the chosen method's rules."""
    return _resolve(cfg, world_size, tokenizer, rules=rules_of(cfg), **kwargs)
