"""The rules of loom's gradient copy for FSDP2 (``parallel.fsdp_grad_copy``: loom.parallel.grad_copy), handed to the
resolver (loom.resolve); apart from it so the resolver imports no FSDP2."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config
from loom.parallel.dims import ParallelDims

FIELD = "parallel.fsdp_grad_copy"


def check_grad_copy_layout(cfg: Config, dims: ParallelDims) -> None:
    """The kernel replaces FSDP2's copy: a layout without FSDP2 has none."""
    if cfg.parallel.fsdp_grad_copy == "triton" and not dims.fsdp_applied:
        raise ConfigError(
            FIELD,
            "triton",
            f"replaces FSDP2's gradient copy, and this layout runs no FSDP2 (dp_shard {dims.dp_shard} x cp "
            f"{dims.cp} on {dims.world_size} ranks): allowed torch here",
        )


RULES = RuleSet("fsdp_grad_copy", layout=check_grad_copy_layout)
