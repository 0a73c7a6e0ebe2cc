"""The registry's use: ``METHODS`` (loom.config.methods: each ``training.objective`` name, its method's module and
the config sections it reads) to the method of a config, and the rules the resolver is handed for it (``rules_of``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from loom.config.errors import ConfigError
from loom.config.methods import METHODS
from loom.config.sections import Config
from loom.methods.base import Method


def method(name: str) -> Method:
    """The method ``training.objective`` = ``name`` names."""
    return importlib.import_module(METHODS[name][0]).METHOD


def method_of(cfg: Config) -> Method:
    """The method of a config (its ``training.objective``)."""
    return method(cfg.training.objective)


def sections_unused(cfg: Config) -> None:
    """The sections of the methods not chosen hold their defaults: a run that sets them has most likely forgotten
    the objective (``dpo.beta`` under lm does nothing)."""
    mine = METHODS[cfg.training.objective][1]
    owners: dict[str, list[str]] = {}
    for name, (_, sections) in METHODS.items():
        for section in sections:
            owners.setdefault(section, []).append(name)
    for section, names in owners.items():
        if section in mine or section not in vars(cfg):  # a declared section never read holds its defaults
            continue
        values, defaults = getattr(cfg, section), type(getattr(cfg, section))()
        for key, default in vars(defaults).items():
            if getattr(values, key) != default:
                raise ConfigError(
                    f"{section}.{key}",
                    getattr(values, key),
                    f"used by training.objective {' or '.join(names)} only",
                )


def rules_of(cfg: Config) -> tuple[Callable[[Config], None], ...]:
    """The rules the resolver is handed for ``cfg``: its method's, then the other methods' sections unused."""
    return method_of(cfg).rules, sections_unused
