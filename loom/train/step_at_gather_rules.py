"""The rules of updates at the gather (``optimizer.step_at_gather``: loom.train.step_at_gather), handed to the
resolver (loom.resolve); apart from it so that checking a config imports no torch."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config
from loom.parallel.dims import ParallelDims

FIELD = "optimizer.step_at_gather"
# the objectives whose steps read the weights only through the model's forward (the methods with a frozen copy, a
# sampler or an outer step read them between steps)
OBJECTIVES = ("lm", "sft")


def check_step_at_gather_config(cfg: Config) -> None:
    """loom's AdamW, its updates held between steps: nothing else may read or change the weights, gradients or
    optimizer state between a step's end and the next forward."""
    if not cfg.optimizer.step_at_gather:
        return
    o, p, t = cfg.optimizer, cfg.parallel, cfg.training
    for field, value, off in (
        ("optimizer.name", o.name, o.name != "adamw"),
        ("optimizer.implementation", o.implementation, o.implementation not in ("auto", "triton")),
        ("optimizer.offload", o.offload, o.offload != "none"),
        ("parallel.cpu_offload", True, p.cpu_offload),
        ("parallel.diloco_inner_steps", p.diloco_inner_steps, p.diloco_inner_steps > 0),
        ("parallel.fault_tolerance", True, p.fault_tolerance),
        ("training.cuda_graphs", True, t.cuda_graphs),
        ("training.dtype", t.dtype, t.dtype == "float16"),
        ("metrics.noise_scale", True, cfg.metrics.noise_scale),
        ("training.objective", t.objective, t.objective not in OBJECTIVES),
    ):
        if off:
            raise ConfigError(
                field,
                value,
                f"not with {FIELD} (each update held until its unit's next gather: loom's AdamW, objectives "
                f"{' | '.join(OBJECTIVES)}, nothing else reading or changing the weights between steps); allowed "
                f"{FIELD} false",
            )


def check_step_at_gather_layout(cfg: Config, dims: ParallelDims) -> None:
    """FSDP2 sharding the whole model over data-parallel ranks, which every update waits in (its units' gathers);
    the layouts it is tested in."""
    if not cfg.optimizer.step_at_gather:
        return
    if not dims.fsdp_enabled or dims.dp_shard < 2:
        raise ConfigError(
            FIELD,
            True,
            f"holds each update until its FSDP2 unit's gather, and this layout gathers none (dp_shard "
            f"{dims.dp_shard} on {dims.world_size} ranks): allowed false, or parallel.dp_shard >= 2",
        )
    for field, degree in (("parallel.tp", dims.tp), ("parallel.pp", dims.pp), ("parallel.cp", dims.cp)):
        if degree > 1:
            raise ConfigError(
                field, degree, f"not with {FIELD} (FSDP2 over data-parallel ranks only): allowed 1"
            )
    if cfg.parallel.ep > 1:
        raise ConfigError("parallel.ep", cfg.parallel.ep, f"not with {FIELD}: allowed 1")


def check_step_at_gather_machine(cfg: Config, device: str) -> None:
    """loom's AdamW is what ``optimizer.implementation auto`` picks on CUDA; elsewhere it must be asked for."""
    if cfg.optimizer.step_at_gather and cfg.optimizer.implementation == "auto" and device != "cuda":
        raise ConfigError(
            FIELD,
            True,
            f"needs loom's AdamW, which optimizer.implementation auto picks on CUDA only (this run: {device}): "
            "allowed with optimizer.implementation triton",
        )


RULES = RuleSet(
    "step_at_gather",
    config=check_step_at_gather_config,
    layout=check_step_at_gather_layout,
    machine=check_step_at_gather_machine,
)
