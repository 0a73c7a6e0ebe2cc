"""What a feature hands the resolver (loom.resolve): its rules, each a function that raises a ConfigError naming
the field, grouped by what they need to see."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RuleSet:
    """A feature's rules: ``config`` over the config alone (checked before torch is imported), ``layout`` with the
    parallel degrees (cfg, ParallelDims), ``machine`` with the device type the run trains on (what must be installed
    there), ``device`` with this machine's device (the CLI's check, once before any worker starts)."""

    name: str
    config: Callable | None = None
    layout: Callable | None = None
    machine: Callable | None = None
    device: Callable | None = None
