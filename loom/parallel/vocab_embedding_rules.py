"""The rules of the vocabulary-split embedding (``parallel.fsdp_embedding``: loom.parallel.vocab_embedding), handed
to the resolver (loom.resolve); ``vocab_applies`` also decides ``auto``. Apart from the module so the resolver
imports no DTensor."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config, ParallelConfig
from loom.parallel.dims import ParallelDims

FIELD = "parallel.fsdp_embedding"


def vocab_refusal(parallel: ParallelConfig, dims: ParallelDims) -> str | None:
    """Why this layout cannot split the embedding by rows over FSDP2's ranks; None where it can."""
    if not dims.fsdp_enabled:
        return (
            f"splits the embedding over FSDP2's shard ranks, and this layout shards over none (dp_shard "
            f"{dims.dp_shard} x cp {dims.cp})"
        )
    if dims.replicate_reduces:
        return f"splits over a 1-D shard mesh, and HSDP adds dp_replicate {dims.dp_replicate}"
    if dims.tp_enabled:
        return f"tensor parallelism (tp {dims.tp}) splits the embedding its own way"
    if parallel.cpu_offload:
        return "the table stays on the device, and parallel.cpu_offload keeps the shards on the host"
    return None


def vocab_applies(parallel: ParallelConfig, dims: ParallelDims) -> bool:
    """``auto`` and ``vocab``: the embedding splits by rows here (a tied or multi-token-prediction model's
    embedding stays in its FSDP2 unit: apply_fsdp keeps it there for ``auto`` and refuses ``vocab``)."""
    return parallel.fsdp_embedding != "gather" and vocab_refusal(parallel, dims) is None


def check_fsdp_embedding_layout(cfg: Config, dims: ParallelDims) -> None:
    if cfg.parallel.fsdp_embedding == "vocab" and (why := vocab_refusal(cfg.parallel, dims)):
        raise ConfigError(FIELD, "vocab", f"{why}: allowed auto | gather here")


RULES = RuleSet("fsdp_embedding", layout=check_fsdp_embedding_layout)
