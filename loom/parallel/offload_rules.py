"""The rules of CPU offloading (``parallel.cpu_offload``: FSDP2's shards on the host, loom.parallel.parallelize),
handed to the resolver (loom.resolve)."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config
from loom.parallel.dims import ParallelDims


def check_offload(cfg: Config, dims: ParallelDims) -> None:
    """parallel.cpu_offload runs FSDP2 with its shards on the host, on one rank too (a 1-rank mesh): not where
    the model is replicated without sharding (DDP keeps its state on the device; sharding over the same ranks
    holds less on the host); a method's own refusal is among its rules (loom.methods)."""
    p = cfg.parallel
    if not p.cpu_offload:
        return
    if dims.ddp_enabled:
        raise ConfigError(
            "parallel.cpu_offload",
            True,
            f"needs FSDP2 (parallel.dp_shard x cp > 1, or one rank): "
            f"parallel.dp_replicate = {dims.dp_replicate} with dp_shard = 1 replicates the model with "
            "DDP; shard over those ranks instead (parallel.dp_shard)",
        )


RULES = RuleSet("CPU offload", layout=check_offload)
