"""The rules of ZeRO-1 (``parallel.zero = 1``, loom.train.zero), handed to the resolver (loom.resolve); apart from
loom.train.zero so that checking a config imports no torch."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config
from loom.parallel.dims import ParallelDims


def check_zero(cfg: Config, dims: ParallelDims) -> None:
    """ZeRO-1 (loom.train.zero) shards the optimizer over DDP replicas of whole, plain-tensor models: not where
    FSDP2 replicates instead (tp, pp), nor with expert parallelism, DiLoCo or offloading."""
    p = cfg.parallel
    if p.zero != 1:
        return
    for field, value, on in (
        ("parallel.tp", p.tp, p.tp > 1),
        ("parallel.pp", p.pp, p.pp > 1),
        ("parallel.ep", p.ep, p.ep > 1),
        ("parallel.cpu_offload", True, p.cpu_offload),
        ("parallel.diloco_inner_steps", p.diloco_inner_steps, p.diloco_inner_steps > 0),
        ("parallel.fault_tolerance", True, p.fault_tolerance),
    ):
        if on:
            raise ConfigError(
                field,
                value,
                "not with parallel.zero = 1 (the optimizer sharded over DDP replicas); "
                "use zero 2 or 3 (FSDP2)",
            )


RULES = RuleSet("ZeRO-1", layout=check_zero)
