"""The rules of FSDP2's collectives in NCCL symmetric memory (``parallel.fsdp_symm_mem``: loom.parallel.data_parallel
allocates the buffers there, loom.runtime.env sets NCCL's zero-CTA policy), handed to the resolver (loom.resolve)."""

from __future__ import annotations

from loom.config.errors import ConfigError
from loom.config.rules import RuleSet
from loom.config.sections import Config
from loom.parallel.dims import ParallelDims

FIELD = "parallel.fsdp_symm_mem"


def check_symm_mem_config(cfg: Config) -> None:
    """Symmetric memory is NCCL's here: not with another backend, the host-side shards of CPU offload, or async TP's
    own symmetric memory."""
    p = cfg.parallel
    if not p.fsdp_symm_mem:
        return
    if p.backend not in ("auto", "nccl"):
        raise ConfigError(
            FIELD,
            True,
            f"NCCL's symmetric memory: not with parallel.backend {p.backend}; allowed auto | nccl",
        )
    if p.cpu_offload:
        raise ConfigError(FIELD, True, "not with parallel.cpu_offload (FSDP2 gathers from host memory there)")
    if p.async_tp:
        raise ConfigError(
            FIELD,
            True,
            "not with parallel.async_tp, whose buffers are in PyTorch's CUDA symmetric memory (one backend per "
            "process): allowed false there",
        )


def check_symm_mem_layout(cfg: Config, dims: ParallelDims) -> None:
    """Only FSDP2's collectives move to symmetric memory: a layout without FSDP2 has none."""
    if cfg.parallel.fsdp_symm_mem and not dims.fsdp_applied:
        raise ConfigError(
            FIELD,
            True,
            f"places FSDP2's gather buffers, and this layout runs no FSDP2 (dp_shard {dims.dp_shard} x cp {dims.cp} "
            f"on {dims.world_size} ranks): allowed false here",
        )


def check_symm_mem_machine(cfg: Config, device: str) -> None:
    """CUDA devices, and a PyTorch whose FSDP2 takes custom buffers (2.11 and later)."""
    if not cfg.parallel.fsdp_symm_mem:
        return
    if device != "cuda":
        raise ConfigError(
            FIELD,
            True,
            "needs CUDA devices (NCCL symmetric memory) and this run is on the CPU: allowed false",
        )
    from loom.parallel.symm_mem import available

    if not available():
        import torch

        raise ConfigError(
            FIELD,
            True,
            f"needs FSDP2's custom-communication hooks (PyTorch >= 2.11; this is {torch.__version__}): allowed false",
        )


RULES = RuleSet(
    "fsdp_symm_mem",
    config=check_symm_mem_config,
    layout=check_symm_mem_layout,
    machine=check_symm_mem_machine,
)
