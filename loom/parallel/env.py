"""Process-group start-up from torchrun / elastic or SLURM environments, and device choice."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from loom.config.errors import ConfigError


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list, e.g. ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            width = len(lo)
            hosts += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
    return hosts


def env_from_slurm(environ: dict[str, str]) -> dict[str, str]:
    """torchrun-style variables from a SLURM step (one task per GPU, ``srun python -m loom.train``)."""
    if "SLURM_PROCID" not in environ or "RANK" in environ:
        return {}
    hosts = expand_nodelist(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])
    job = int(environ.get("SLURM_JOB_ID", "0"))
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0],
        "MASTER_ADDR": environ.get("MASTER_ADDR", hosts[0]),
        "MASTER_PORT": environ.get("MASTER_PORT", str(20000 + job % 20000)),
    }


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("run.device", "cuda", "no CUDA device is visible; allowed here: auto | cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(device_kind: str, backend: str) -> DistEnv:
    """Join the process group when launched by torchrun/elastic/SLURM; a plain process runs alone."""
    os.environ.update(env_from_slurm(dict(os.environ)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_kind, local_rank)
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            if backend == "auto":
                backend = "nccl" if device.type == "cuda" else "gloo"
            if backend == "nccl" and device.type != "cuda":
                raise ConfigError("parallel.backend", backend, "nccl needs CUDA devices; allowed here: auto | gloo")
            dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return DistEnv(rank, local_rank, world, device)


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
