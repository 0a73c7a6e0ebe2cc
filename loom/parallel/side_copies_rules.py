"""The rules of FSDP2's copies off the compute stream (``parallel.fsdp_side_copies``: loom.parallel.side_copies),
handed to the resolver (loom.resolve); apart from it so the resolver imports no FSDP2."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config
from loom.parallel.dims import ParallelDims

FIELD = "parallel.fsdp_side_copies"


def check_side_copies_layout(cfg: Config, dims: ParallelDims) -> None:
    """It moves FSDP2's copies: a layout without FSDP2 has none."""
    kind = cfg.parallel.fsdp_side_copies
    if kind != "none" and not dims.fsdp_applied:
        raise ConfigError(
            FIELD,
            kind,
            f"moves FSDP2's copies, and this layout runs no FSDP2 (dp_shard {dims.dp_shard} x cp {dims.cp} on "
            f"{dims.world_size} ranks): allowed none here",
        )


RULES = RuleSet("fsdp_side_copies", layout=check_side_copies_layout)
