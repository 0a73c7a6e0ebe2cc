"""The rules of offloading, handed to the resolver (loom.resolve): CPU offload (``parallel.cpu_offload``: FSDP2's
shards on the host, loom.parallel.parallelize), activation offload (``training.activation_offload``:
loom.parallel.activation_offload) and NVMe offload of the optimizer state (``optimizer.offload``:
loom.train.nvme_offload)."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config
from loom.parallel.dims import ParallelDims

FIELD = "training.activation_offload"
MAX_BLOCKS = (
    1 << 30
)  # the config alone does not know the model's depth: indices are checked against it at build


def offloaded_blocks(spec: str, n_layers: int) -> list[int]:
    """The block indices ``training.activation_offload`` selects: none, all, or a comma list of indices below
    ``n_layers`` (a ConfigError naming the field otherwise)."""
    text = spec.strip().lower()
    if text in ("none", ""):
        return []
    if text == "all":
        return list(range(n_layers))
    span = f" 0..{n_layers - 1}" if n_layers < MAX_BLOCKS else ""
    allowed = f"allowed none | all | a comma list of block indices{span} (e.g. 0,1,2)"
    try:
        picked = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(FIELD, spec, allowed) from None
    if any(i < 0 or i >= n_layers for i in picked) or len(set(picked)) != len(picked):
        raise ConfigError(FIELD, spec, allowed + ", each once")
    return sorted(picked)


def check_offload_config(cfg: Config) -> None:
    """training.activation_offload's form and what it does not compose with; optimizer.offload nvme steps AdamW."""
    t = cfg.training
    if t.activation_offload.strip().lower() == "all" or offloaded_blocks(t.activation_offload, MAX_BLOCKS):
        if t.compile:
            raise ConfigError(
                FIELD,
                t.activation_offload,
                "not with training.compile: torch.compile traces each block with its hooks, and the saved-tensor "
                "hooks' host copies are Python side effects it cannot trace (fullgraph breaks); offload without "
                "compile, or compile without offload",
            )
    o = cfg.optimizer
    if o.offload == "nvme" and o.name != "adamw":
        raise ConfigError(
            "optimizer.offload",
            o.offload,
            f"steps AdamW's two moments from files; optimizer.name {o.name} keeps other state: use adamw, or "
            "optimizer.offload none",
        )


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


RULES = RuleSet("offload", config=check_offload_config, layout=check_offload)
