"""The rules of pipedream_2bw (``parallel.pp_schedule``: loom.parallel.pipedream), handed to the resolver
(loom.resolve): what its weight versions do not compose with, each refused with its reason."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config
from loom.parallel.dims import ParallelDims
from loom.parallel.pipeline import TWO_BW

FIELD = "parallel.pp_schedule"


def check_pipedream_config(cfg: Config) -> None:
    """Options whose state or data order the delayed-update stream cannot keep."""
    if cfg.parallel.pp_schedule != TWO_BW:
        return
    t = cfg.training
    refused = (
        (t.compile, "training.compile", "compiled blocks would recompile for each weight version"),
        (t.cuda_graphs, "training.cuda_graphs", "a graph replays one weight version's addresses"),
        (t.nonfinite == "rollback", "training.nonfinite = rollback", "a rollback resumes, which 2BW cannot"),
        (cfg.parallel.cpu_offload, "parallel.cpu_offload", "the versions are copies of unsharded weights"),
        (
            cfg.parallel.fault_tolerance,
            "parallel.fault_tolerance",
            "a step rerun after a failed replica group breaks the stream",
        ),
        (cfg.lora.rank > 0, "lora.rank > 0", "the versions copy plain weights; adapters are not supported"),
        (cfg.metrics.noise_scale, "metrics.noise_scale", "it reads gradients the delayed step moves"),
    )
    for bad, what, why in refused:
        if bad:
            raise ConfigError(FIELD, TWO_BW, f"not with {what} ({why}): use another schedule")


def check_pipedream_layout(cfg: Config, dims: ParallelDims) -> None:
    """pipedream_2bw keeps its versions as copies of this rank's whole stage: no sharded (FSDP, TP, CP, EP) or
    replicated (DDP) parameters, whose gradients go through their own wrappers."""
    if cfg.parallel.pp_schedule != TWO_BW:
        return
    used = {
        n: getattr(dims, n) for n in ("dp_replicate", "dp_shard", "tp", "cp", "ep") if getattr(dims, n) > 1
    }
    if used:
        what = ", ".join(f"{n} = {v}" for n, v in used.items())
        raise ConfigError(
            FIELD,
            TWO_BW,
            f"runs on pipeline ranks alone (world size = parallel.pp), and this layout has {what}: its weight "
            "versions are copies of unsharded, unreplicated stages",
        )


RULES = RuleSet("pipedream_2bw", config=check_pipedream_config, layout=check_pipedream_layout)
