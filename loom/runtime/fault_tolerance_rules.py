"""The rules of fault-tolerant replica groups (``parallel.fault_tolerance``, loom.runtime.fault_tolerance), handed
to the resolver (loom.resolve)."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config, ParallelConfig
from loom.runtime.fault_tolerance import lighthouse_address


def check_fault_tolerance(cfg: Config) -> None:
    """parallel.fault_tolerance (loom.runtime.fault_tolerance): the ft_* fields only with it; the replica groups are
    the replicate axis (each group shards with dp_shard); the layouts and features tested with it so far."""
    p = cfg.parallel
    if not p.fault_tolerance:
        for key in ("ft_replica_id", "ft_replica_groups", "ft_lighthouse", "ft_min_replicas", "ft_timeout_s"):
            default = ParallelConfig.__dataclass_fields__[key].default
            if getattr(p, key) != default:
                raise ConfigError(f"parallel.{key}", getattr(p, key), "used by parallel.fault_tolerance only")
        return
    if p.ft_replica_id >= p.ft_replica_groups:
        raise ConfigError(
            "parallel.ft_replica_id",
            p.ft_replica_id,
            f"must be below parallel.ft_replica_groups ({p.ft_replica_groups})",
        )
    if p.ft_min_replicas > p.ft_replica_groups:
        raise ConfigError(
            "parallel.ft_min_replicas",
            p.ft_min_replicas,
            f"must be at most parallel.ft_replica_groups ({p.ft_replica_groups})",
        )
    if p.dp_replicate > 1:
        raise ConfigError(
            "parallel.dp_replicate",
            p.dp_replicate,
            "with parallel.fault_tolerance the replica groups "
            "are the replicate axis: allowed 1 (shard within a group with parallel.dp_shard)",
        )
    for key in ("tp", "pp", "cp", "ep"):
        if getattr(p, key) > 1:
            raise ConfigError(
                f"parallel.{key}",
                getattr(p, key),
                "not supported with parallel.fault_tolerance yet "
                "(data parallelism within a replica group only): allowed 1",
            )
    if cfg.training.nonfinite == "rollback":
        raise ConfigError(
            "training.nonfinite",
            "rollback",
            "not with parallel.fault_tolerance (one group would roll back alone): allowed skip | stop",
        )


def check_torchft(cfg: Config, device: str) -> None:
    """torchft installed and its lighthouse's address known, wherever the run trains."""
    if not cfg.parallel.fault_tolerance:
        return
    from importlib.util import find_spec

    if find_spec("torchft") is None:
        raise ConfigError(
            "parallel.fault_tolerance", True, "needs the 'torchft' package (pip install 'loom-train[ft]')"
        )
    if not lighthouse_address(cfg.parallel):
        raise ConfigError(
            "parallel.ft_lighthouse",
            "",
            "parallel.fault_tolerance needs the torchft lighthouse's "
            "address (http://host:port) here or in TORCHFT_LIGHTHOUSE",
            show_value=False,
        )


RULES = RuleSet("fault tolerance", config=check_fault_tolerance, machine=check_torchft)
