"""The rules of FSDP2 units of several blocks (``parallel.fsdp_unit_blocks``: loom.parallel.data_parallel groups
them), handed to the resolver (loom.resolve)."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config
from loom.parallel.dims import ParallelDims

FIELD = "parallel.fsdp_unit_blocks"


def check_units_layout(cfg: Config, dims: ParallelDims) -> None:
    """Units group FSDP2's blocks: a layout without FSDP2 has none, and under expert parallelism each block's
    experts are a unit of their own, prefetched with their block."""
    k = cfg.parallel.fsdp_unit_blocks
    if k == 1:
        return
    if not dims.fsdp_applied:
        raise ConfigError(
            FIELD,
            k,
            f"groups FSDP2's blocks, and this layout runs no FSDP2 (dp_shard {dims.dp_shard} x cp {dims.cp} on "
            f"{dims.world_size} ranks): allowed 1 here",
        )
    if dims.ep_enabled:
        raise ConfigError(
            FIELD, k, f"not with expert parallelism (ep {dims.ep}: each block's experts are a unit): allowed 1"
        )


RULES = RuleSet("fsdp_units", layout=check_units_layout)
