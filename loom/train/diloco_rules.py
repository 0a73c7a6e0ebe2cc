"""The rules of DiLoCo (``parallel.diloco_*``, loom.train.diloco), handed to the resolver (loom.resolve); apart from
loom.train.diloco so that checking a config imports no torch."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config


def check_diloco(cfg: Config) -> None:
    """DiLoCo (loom.train.diloco): groups along dp_replicate that average their weights every H steps."""
    p = cfg.parallel
    if p.diloco_overlap_steps and not p.diloco_inner_steps:
        raise ConfigError(
            "parallel.diloco_overlap_steps",
            p.diloco_overlap_steps,
            "0 without DiLoCo (parallel.diloco_inner_steps = 0)",
        )
    if not p.diloco_inner_steps:
        return
    field, h = "parallel.diloco_inner_steps", p.diloco_inner_steps
    if p.dp_replicate < 2:
        raise ConfigError(field, h, "needs parallel.dp_replicate >= 2 (the replica groups that train apart)")
    for key, value, bad, why in (
        ("parallel.ep", p.ep, p.ep > 1, "expert gradients are reduced over dp_replicate inside FSDP2"),
        ("parallel.cpu_offload", True, p.cpu_offload, "the outer all-reduce runs on the training device"),
        ("metrics.noise_scale", True, cfg.metrics.noise_scale, "its large batch is the all-reduced gradient"),
        ("parallel.fault_tolerance", True, p.fault_tolerance, "torchft's replica groups reduce every step"),
    ):
        if bad:
            raise ConfigError(field, h, f"not with {key} = {value} ({why})")
    if p.diloco_fragments > h:
        raise ConfigError(
            "parallel.diloco_fragments",
            p.diloco_fragments,
            f"at most parallel.diloco_inner_steps = {h} (each fragment synchronizes once per H steps)",
        )
    if p.diloco_overlap_steps >= h:
        raise ConfigError(
            "parallel.diloco_overlap_steps",
            p.diloco_overlap_steps,
            f"below parallel.diloco_inner_steps = {h} (a fragment's reduction is applied before the "
            "fragment is reduced again)",
        )


RULES = RuleSet("DiLoCo", config=check_diloco)
