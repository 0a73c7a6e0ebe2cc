"""The rules of the vocabulary-split embedding (``parallel.fsdp_embedding``: loom.parallel.vocab_embedding), handed
to the resolver (loom.resolve), and what ``auto`` resolves to for a built model (``fsdp_embedding``). Apart from the
module so the resolver imports no DTensor."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config, ParallelConfig
from loom.parallel.dims import ParallelDims

FIELD = "parallel.fsdp_embedding"
# auto splits where a micro-batch's tokens of every shard rank, gathered, are at most this share of the table's rows:
# the split's buffers (those tokens x dim, in fp32 and the compute dtype) then stay below about the gathered table's
# bytes, and it moves at most a quarter of the unit's (a sixth with bf16 compute, fp32 reduction and one gather)
AUTO_TOKEN_SHARE = 0.25


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


def model_refusal(args, equal_widths: bool) -> str | None:
    """Why this model or objective cannot split its embedding; None where it can."""
    if args.tie_embeddings:
        return "this model's embedding is also its output head (tied)"
    if getattr(args, "mtp_depth", 0):
        return "multi-token prediction reads the embedding again after the blocks"
    if not equal_widths:
        return (
            "this objective's micro-batches differ in width between ranks (rollouts pad to each rank's longest), "
            "and the split's collectives need every rank's token count equal"
        )
    return None


def fsdp_embedding(parallel: ParallelConfig, dims: ParallelDims, args, training, objective) -> str:
    """``parallel.fsdp_embedding`` for this model and objective (its class or instance: ``equal_widths``, every rank's
    micro-batches of one shape; ``rows_per_example``): ``vocab`` or ``gather``. ``vocab`` by hand where the split
    cannot apply is a ConfigError; ``auto`` splits where it can and the gathered tokens are few against the table
    (``AUTO_TOKEN_SHARE``)."""
    setting = parallel.fsdp_embedding
    if setting == "gather":
        return "gather"
    why = vocab_refusal(parallel, dims) or model_refusal(args, objective.equal_widths)
    if why:
        if setting == "vocab":
            raise ConfigError(FIELD, "vocab", f"{why}: allowed auto | gather")
        return "gather"
    # one rank's tokens a micro-batch (rows x seq_len over cp), on every shard rank
    gathered = dims.dp_shard * training.micro_batch_size * objective.rows_per_example * training.seq_len
    return "vocab" if setting == "vocab" or gathered <= AUTO_TOKEN_SHARE * args.vocab_size else "gather"


def check_fsdp_embedding_layout(cfg: Config, dims: ParallelDims) -> None:
    if cfg.parallel.fsdp_embedding == "vocab" and (why := vocab_refusal(cfg.parallel, dims)):
        raise ConfigError(FIELD, "vocab", f"{why}: allowed auto | gather here")


RULES = RuleSet("fsdp_embedding", layout=check_fsdp_embedding_layout)
