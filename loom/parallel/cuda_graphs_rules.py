"""The rules of CUDA graph replay of the compiled blocks (``training.cuda_graphs``, loom.parallel.compile), handed to
the resolver (loom.resolve)."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import SELECTIVE_AC, Config
from loom.parallel.dims import ParallelDims


def check_cuda_graphs(cfg: Config, dims: ParallelDims | None = None) -> None:
    """training.cuda_graphs: what graph replay of the compiled blocks cannot take. ``dims``: also the layout's rule
    (FSDP re-allocates its gathered parameters, tensor / pipeline / context parallelism and DDP run collectives or
    hooks between and inside blocks: one process only)."""
    t = cfg.training
    if not t.cuda_graphs:
        return
    if not t.compile:
        raise ConfigError(
            "training.cuda_graphs", True, "needs training.compile true (the graphs are the compiled blocks')"
        )
    if t.activation_checkpointing not in ("none", *SELECTIVE_AC):
        raise ConfigError(
            "training.cuda_graphs",
            True,
            f"not with training.activation_checkpointing "
            f"{t.activation_checkpointing} (the recomputation runs outside the graphs): allowed none | "
            "op | matmuls",
        )
    if cfg.parallel.cpu_offload:
        raise ConfigError(
            "training.cuda_graphs",
            True,
            "not with parallel.cpu_offload (parameters move between host and GPU every step)",
        )
    if cfg.parallel.fault_tolerance:
        raise ConfigError(
            "training.cuda_graphs",
            True,
            "not with parallel.fault_tolerance (gradients are summed "
            "across replica groups around the blocks)",
        )
    if dims is not None and dims.world_size > 1:
        raise ConfigError(
            "training.cuda_graphs",
            True,
            f"runs on one process (FSDP re-allocates gathered parameters; "
            f"DDP, tensor, context and pipeline parallelism run collectives around the blocks): got "
            f"{dims.world_size} ranks",
        )


def check_cuda_device(cfg: Config, device: str) -> None:
    """Graphs are CUDA's."""
    if cfg.training.cuda_graphs and device != "cuda":
        raise ConfigError(
            "training.cuda_graphs", True, "needs a CUDA device and this run is on the CPU: allowed false"
        )


RULES = RuleSet("CUDA graphs", config=check_cuda_graphs, layout=check_cuda_graphs, device=check_cuda_device)
