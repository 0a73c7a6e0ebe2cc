"""Process-group start-up from torchrun / elastic, SLURM or mpirun environments, and device choice."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loom.config.errors import ConfigError, UserError

if TYPE_CHECKING:
    from datetime import timedelta

    import torch


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- collectives over every rank (no-ops in a single process) ----------------
    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def share_from_main(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def max_over_ranks(self, x: float | list[float], group=None) -> float | list[float]:
        """The largest value over the ranks (a list: each element's, in one collective); over ``group``, a gloo
        group of every rank, from the host's memory (no wait for the device's queue)."""
        if self.world_size == 1:
            return x
        import torch
        import torch.distributed as dist

        device = "cpu" if group is not None else self.device
        t = torch.tensor(x if isinstance(x, list) else [x], device=device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist() if isinstance(x, list) else float(t)

    def any_rank(self, flag: bool) -> bool:
        return self.max_over_ranks(float(flag)) > 0

    def first_error(self, error: str | None) -> str | None:
        """The error of the lowest rank that has one, on every rank (None where no rank has one): ranks that
        fail apart (each on its own data) stop together with one line. One scalar all-reduce; the messages are
        gathered only when one failed."""
        if self.world_size == 1 or not self.any_rank(error is not None):
            return error
        import torch.distributed as dist

        errors: list = [None] * self.world_size
        dist.all_gather_object(errors, error)
        return next(e for e in errors if e is not None)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list, e.g. ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1
    (zero padding kept; several bracket groups and text after a group work too: ``r[1-2]n[1-2]-ib``)."""
    hosts: list[str] = []
    for expr in _split_outside_brackets(nodelist):
        hosts += _expand_host(expr)
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _expand_host(expr: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", expr)
    if m is None:
        return [expr]
    head, tails = expr[: m.start()], _expand_host(expr[m.end() :])
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.strip().partition("-")
        items = [lo] if not hi else [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
        out += [head + item + tail for item in items for tail in tails]
    return out


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's tasks-per-node list, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"not a SLURM tasks-per-node list: {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def env_from_slurm(environ: dict[str, str]) -> dict[str, str]:
    """torchrun-style variables from a SLURM step (one task per GPU, ``srun python -m loom.train``).
    Nothing when not in a SLURM task or when RANK is already set (torchrun inside SLURM wins)."""
    if "SLURM_PROCID" not in environ or "RANK" in environ:
        return {}
    hosts = expand_nodelist(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])
    job = int(environ.get("SLURM_JOB_ID", "0"))
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or "1"
    counts = expand_tasks_per_node(per_node)
    node = int(environ.get("SLURM_NODEID", "0"))
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ.get("SLURM_STEP_NUM_TASKS") or environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(counts[min(node, len(counts) - 1)]),
        "MASTER_ADDR": environ.get("MASTER_ADDR", hosts[0]),
        "MASTER_PORT": environ.get("MASTER_PORT", str(20000 + job % 20000)),
    }


def env_from_mpi(environ: dict[str, str]) -> dict[str, str]:
    """torchrun-style variables from mpirun's (``mpirun -np 8 loom train ...``): Open MPI's
    ``OMPI_COMM_WORLD_RANK / SIZE / LOCAL_RANK / LOCAL_SIZE``, else MPICH's and Intel MPI's ``PMI_RANK / PMI_SIZE``
    (the local rank from ``MPI_LOCALRANKID`` or ``PMI_LOCAL_RANK``; where none is given, the rank, which picks the
    GPU ``rank % GPUs``). Nothing when not an MPI rank or when RANK is already set (torchrun wins). MASTER_ADDR /
    MASTER_PORT are the user's (``mpirun -x``); where every rank is on one host they default to 127.0.0.1:29500.
    Read before SLURM's: ranks that mpirun starts inside an allocation inherit a SLURM_PROCID that is not theirs."""
    if "RANK" in environ:
        return {}
    if "OMPI_COMM_WORLD_RANK" in environ and "OMPI_COMM_WORLD_SIZE" in environ:
        rank, world = environ["OMPI_COMM_WORLD_RANK"], environ["OMPI_COMM_WORLD_SIZE"]
        local = environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
        local_world = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    elif "PMI_RANK" in environ and "PMI_SIZE" in environ:
        rank, world = environ["PMI_RANK"], environ["PMI_SIZE"]
        local = environ.get("MPI_LOCALRANKID") or environ.get("PMI_LOCAL_RANK")
        local_world = environ.get("MPI_LOCALNRANKS") or environ.get("PMI_LOCAL_SIZE")
    else:
        return {}
    out = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": local or rank}
    if local_world:
        out["LOCAL_WORLD_SIZE"] = local_world
    one_host = local_world == world
    for var, alone in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        if environ.get(var) or one_host:
            out[var] = environ.get(var) or alone
    return out


def launched_by_mpi(environ: dict[str, str]) -> bool:
    """Whether this process is a rank mpirun / mpiexec started (Open MPI, MPICH, Intel MPI)."""
    return "OMPI_COMM_WORLD_RANK" in environ or ("PMI_RANK" in environ and "PMI_SIZE" in environ)


def env_from_launcher(environ: dict[str, str]) -> dict[str, str]:
    """torchrun-style variables from mpirun's, else from SLURM's (nothing when RANK is set or neither started us)."""
    return env_from_mpi(environ) or env_from_slurm(environ)


def check_mpi() -> None:
    """parallel.backend = mpi needs a PyTorch built with MPI (the PyPI wheels are not): one line where it is not."""
    import torch.distributed as dist

    if not dist.is_mpi_available():
        raise ConfigError(
            "parallel.backend",
            "mpi",
            "this PyTorch build has no MPI (torch.distributed.is_mpi_available() is False): use auto | nccl | "
            "gloo, which take the ranks mpirun starts as they are (docs/operations.md#mpirun)",
        )


def pick_device(kind: str, local_rank: int, index: int | None = None) -> torch.device:
    """The device this rank runs on; ``index``: the CUDA device topology-aware placement chose (None: the
    local rank's)."""
    import torch

    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("run.device", "cuda", "no CUDA device is visible; allowed here: auto | cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count() if index is None else index)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_backend(backend: str, device_type: str, cpu_offload: bool = False) -> str:
    """parallel.backend for a run on ``device_type``: ``auto`` is NCCL on CUDA and gloo on the CPU; with
    parallel.cpu_offload on CUDA both (``cuda:nccl,cpu:gloo``, as torchtitan does): FSDP2 gathers and reduces on
    the GPU, while the gradients it offloads live on the host, where the global norm's all-reduce runs (NCCL
    reduces device tensors only)."""
    if backend == "nccl" and device_type != "cuda":
        raise ConfigError("parallel.backend", backend, "nccl needs CUDA devices; allowed here: auto | gloo")
    if backend == "mpi":
        check_mpi()
    if backend != "auto":
        return backend
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def init_distributed(
    device_kind: str,
    backend: str,
    cpu_offload: bool = False,
    timeout: timedelta | None = None,
    device_index: int | None = None,
    zero_cta: bool = False,
) -> DistEnv:
    """Join the process group when launched by torchrun/elastic/SLURM/mpirun; a plain process runs alone.
    ``timeout``: the group's collective timeout (None: PyTorch's default; loom.runtime.health sets it);
    ``device_index``: the CUDA device placement chose (loom.runtime.topology; None: the local rank's);
    ``zero_cta``: NCCL's zero-CTA policy for every communicator (parallel.fsdp_symm_mem: gathers into symmetric
    memory then run on the copy engines), unless NCCL_CTA_POLICY is set."""
    os.environ.update(env_from_launcher(dict(os.environ)))
    if zero_cta:
        os.environ.setdefault("NCCL_CTA_POLICY", "2")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_kind, local_rank, device_index)
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            from loom.runtime.rendezvous import worker_store

            backend = choose_backend(backend, device.type, cpu_offload)
            if backend == "mpi":
                check_mpi_ranks(dict(os.environ))
                dist.init_process_group(backend="mpi", timeout=timeout)  # MPI itself numbers the ranks
                return DistEnv(dist.get_rank(), local_rank, dist.get_world_size(), device)
            # a file-rendezvous agent's workers meet over its FileStore, not a TCP port
            store = worker_store()
            if store is None:
                check_master(dict(os.environ))
            where = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
            dist.init_process_group(
                backend=backend, device_id=device if device.type == "cuda" else None, timeout=timeout, **where
            )
    return DistEnv(rank, local_rank, world, device)


def check_mpi_ranks(environ: dict[str, str]) -> None:
    """An MPI group's ranks are the ones mpirun started: a job torchrun or SLURM started (WORLD_SIZE > 1, no MPI
    rank) would have each process form a world of its own and wait forever."""
    if not launched_by_mpi(environ):
        raise ConfigError(
            "parallel.backend",
            "mpi",
            f"this job's {environ.get('WORLD_SIZE')} ranks were not started by mpirun / mpiexec, and an MPI group "
            "is formed by them: start it with `mpirun -np N loom train ...`, or use auto | nccl | gloo",
        )


def check_master(environ: dict[str, str]) -> None:
    """Ranks of several processes meet at MASTER_ADDR:MASTER_PORT (env://); torchrun and SLURM give them, mpirun
    does only on one host: one line instead of PyTorch's traceback."""
    missing = [var for var in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(var)]
    if missing:
        how = " -x MASTER_ADDR=<first host> -x MASTER_PORT=29500" if launched_by_mpi(environ) else ""
        raise UserError(
            f"{' and '.join(missing)} not set: rank {environ.get('RANK')} of {environ.get('WORLD_SIZE')} cannot "
            f"find the others; set them to the first host's address and a free port (mpirun{how} ...; "
            "docs/operations.md#mpirun)"
        )


def ensure_process_group(env: DistEnv, backend: str, cpu_offload: bool) -> None:
    """A process group to build meshes on: the launcher's; a plain process that needs a mesh anyway (FSDP2 with
    CPU offload on one rank) makes one of its own rank over an in-memory store (no port, no rendezvous). It
    stays until ``destroy_distributed``."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    assert env.world_size == 1, "init_distributed joins the group of a launched job"
    if backend == "mpi":
        backend = "auto"  # one rank: no MPI to join
    dist.init_process_group(
        backend=choose_backend(backend, env.device.type, cpu_offload),
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=env.device if env.device.type == "cuda" else None,
    )


def destroy_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        # every rank reaches this point before any tears its connections down: on gloo, a rank that
        # destroys its group while a peer is still finishing makes the peer abort ("terminate called")
        dist.barrier()
        dist.destroy_process_group()
