"""loom train's elastic launch: its launcher options (how many workers start here, how often they restart, how
nodes meet), the world size a worker belongs to, and the start of this node's workers under PyTorch's elastic
agent."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from loom.config import ConfigError
from loom.runtime.run_lock import held_env

RDZV_BACKENDS = ("c10d", "file")


@dataclass
class Launch:
    """loom train's launcher options: how many workers start here, how often they restart, how nodes meet."""

    config: str | None = None
    nproc: int | None = None
    nnodes: tuple[int, int] = (1, 1)  # (min, max)
    node_rank: int | None = None
    max_restarts: int = 0
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: str = ""

    @property
    def multi_node(self) -> bool:
        return self.nnodes[1] > 1

    @property
    def elastic(self) -> bool:
        return self.nnodes[0] < self.nnodes[1]

    @property
    def agent(self) -> bool:
        """Whether workers start through the elastic agent (else this process trains)."""
        return (self.nproc or 1) > 1 or self.multi_node or self.max_restarts > 0 or bool(self.rdzv_endpoint)

    @property
    def world_size(self) -> int:
        """The world a start plans for: every node's workers at the largest node count."""
        return (self.nproc or 1) * self.nnodes[1]

    def agent_args(self) -> list[str]:
        """torch.distributed.run's arguments (before the worker's module)."""
        args = [f"--nproc-per-node={self.nproc or 1}", f"--max-restarts={self.max_restarts}"]
        if not self.multi_node and not self.rdzv_endpoint:
            return ["--standalone", *args]  # one node: a c10d store on a free local port, a fresh job id
        lo, hi = self.nnodes
        conf = [c for c in self.rdzv_conf.split(",") if c]
        if self.rdzv_backend == "c10d" and self.node_rank and not any(c.startswith("is_host=") for c in conf):
            conf.append(
                "is_host=0"
            )  # only node 0 may serve the store (it does where it runs on the endpoint's host)
        return [
            *args,
            f"--nnodes={lo}:{hi}" if lo < hi else f"--nnodes={lo}",
            f"--rdzv-backend={self.rdzv_backend}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            *([f"--rdzv-conf={','.join(conf)}"] if conf else []),
        ]


def _count(name: str, val: str, least: int) -> int:
    try:
        n = int(val)
    except ValueError:
        n = None
    if n is None or n < least:
        raise ConfigError(
            name,
            val if n is None else n,
            "expected a positive integer" if least else "expected a whole number >= 0",
        )
    return n


def _nnodes(val: str) -> tuple[int, int]:
    lo, sep, hi = val.partition(":")
    try:
        nodes = (int(lo), int(hi if sep else lo))
    except ValueError:
        nodes = (0, 0)
    if not 1 <= nodes[0] <= nodes[1]:
        raise ConfigError("--nnodes", val, "expected N or MIN:MAX with 1 <= MIN <= MAX")
    return nodes


def _rdzv_conf(val: str) -> str:
    if any("=" not in item or not item.partition("=")[0].strip() for item in val.split(",") if item):
        raise ConfigError("--rdzv-conf", val, "expected KEY=VALUE[,KEY=VALUE...], e.g. join_timeout=600")
    return val


def _backend(val: str) -> str:
    if val not in RDZV_BACKENDS:
        raise ConfigError("--rdzv-backend", val, f"allowed: {' | '.join(RDZV_BACKENDS)}")
    return val


# option -> (Launch field, how its value is read); torchrun's underscore spellings are accepted too
LAUNCH_OPTIONS = {
    "--config": ("config", str),
    "-c": ("config", str),
    "--nproc-per-node": ("nproc", lambda v: _count("--nproc-per-node", v, 1)),
    "--max-restarts": ("max_restarts", lambda v: _count("--max-restarts", v, 0)),
    "--nnodes": ("nnodes", _nnodes),
    "--node-rank": ("node_rank", lambda v: _count("--node-rank", v, 0)),
    "--rdzv-backend": ("rdzv_backend", _backend),
    "--rdzv-endpoint": ("rdzv_endpoint", str),
    "--rdzv-id": ("rdzv_id", str),
    "--rdzv-conf": ("rdzv_conf", _rdzv_conf),
}
LAUNCH_OPTIONS.update(
    {
        k.replace("-", "_").replace("__", "--"): v
        for k, v in list(LAUNCH_OPTIONS.items())
        if k.startswith("--")
    }
)


def parse_launch(argv: list[str]) -> tuple[Launch, list[str]]:
    """Pull loom train's launcher options (and --config) out; the rest are --section.field overrides."""
    launch, rest = Launch(), []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, val = arg.partition("=")
        if name in LAUNCH_OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(name, None, "missing value after the option", show_value=False)
                val, i = argv[i + 1], i + 1
            attr, read = LAUNCH_OPTIONS[name]
            setattr(launch, attr, read(val))
        else:
            rest.append(arg)
        i += 1
    check_launch(launch)
    return launch, rest


def check_launch(launch: Launch) -> None:
    """The rules between launcher options: where nodes meet must be said when there is more than one; a node rank
    is below the node count (else the agent waits on the rendezvous forever); a c10d endpoint's port is a port."""
    if launch.node_rank is not None and launch.node_rank >= launch.nnodes[1]:
        raise ConfigError(
            "--node-rank",
            launch.node_rank,
            f"must be below --nnodes {':'.join(map(str, sorted(set(launch.nnodes))))} (0 <= rank < nodes)",
        )
    if launch.rdzv_backend == "file" and launch.rdzv_endpoint:
        folder = os.path.dirname(os.path.abspath(launch.rdzv_endpoint))
        if not os.path.isdir(folder):
            raise ConfigError(
                "--rdzv-endpoint",
                launch.rdzv_endpoint,
                f"its folder {folder} does not exist on this "
                "node (the file backend needs a filesystem every node mounts)",
            )
    if launch.rdzv_backend != "file" and launch.rdzv_endpoint and ":" in launch.rdzv_endpoint:
        port = launch.rdzv_endpoint.rpartition(":")[2]
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError("--rdzv-endpoint", launch.rdzv_endpoint, "HOST:PORT with a port in 1..65535")
    if (launch.multi_node or launch.rdzv_backend == "file") and not launch.rdzv_endpoint:
        what = (
            "PATH: a file on a filesystem every node mounts"
            if launch.rdzv_backend == "file"
            else "HOST:PORT that every node reaches (the first agent there serves the rendezvous store)"
        )
        why = (
            "--rdzv-backend file"
            if launch.rdzv_backend == "file"
            else f"--nnodes {':'.join(map(str, sorted(set(launch.nnodes))))}"
        )
        raise ConfigError("--rdzv-endpoint", None, f"needed with {why}: {what}", show_value=False)


def local_ranks(world_size: int) -> int:
    """Ranks on this machine: the launcher's (torchrun's, mpirun's or SLURM's) LOCAL_WORLD_SIZE, else the whole
    world."""
    from loom.runtime.env import env_from_launcher

    local = os.environ.get("LOCAL_WORLD_SIZE") or env_from_launcher(dict(os.environ)).get("LOCAL_WORLD_SIZE")
    return int(local) if local else world_size


def env_world_size() -> int:
    """The world size this process belongs to: torchrun's WORLD_SIZE, else mpirun's or SLURM's task count, else 1."""
    from loom.runtime.env import env_from_launcher

    world = os.environ.get("WORLD_SIZE") or env_from_launcher(dict(os.environ)).get("WORLD_SIZE") or "1"
    return int(world)


def launch(argv: list[str], launch: Launch, cfg) -> int:
    """Start this node's workers with torch.distributed.run (elastic agent; one node: a local c10d store,
    several: ``--rdzv-backend`` on ``--rdzv-endpoint``). The agent restarts them up to ``--max-restarts`` times
    (recording each failure: loom.runtime.restarts) and forwards SIGTERM / SIGINT to them, which agree, save and exit
    0 within checkpoint.preempt_grace_s; the agent waits a little longer than that before it kills them."""
    from torch.distributed.run import get_args_parser, run

    from loom.runtime.restarts import (
        ELASTIC_ENV,
        RESTARTS,
        describe_failures,
        failure_entries,
        recording_agent,
    )

    nproc = launch.nproc or 1
    if launch.rdzv_backend == "file":
        try:
            from loom.runtime.rendezvous import register_file_rendezvous
        except ImportError:
            raise ConfigError(
                "--rdzv-backend", "file", "needs loom.runtime.rendezvous, not in this loom: allowed c10d"
            ) from None
        register_file_rendezvous()  # torch's registry knows c10d, etcd and static; this process learns "file"
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # stable restarts on gloo
    from loom.runtime.topology import usable_cpus

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))  # torchrun keeps a set one
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(cfg.checkpoint.preempt_grace_s) + 10))
    if not launch.multi_node:
        os.environ.update(held_env(cfg.run.dir))  # this process holds the run dir's lock for its workers
    if launch.elastic:
        os.environ[ELASTIC_ENV] = f"{launch.nnodes[0]}:{launch.nnodes[1]}"
    args = get_args_parser().parse_args([*launch.agent_args(), "--module", "loom.train", *argv])
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    started = time.time()
    try:
        with recording_agent(cfg.run.dir):
            run(args)
    except SignalException as err:
        return _after_signal(cfg.run.dir, err.sigval, started)
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        # the agent stops the other workers (negative codes: killed by a signal) once one has failed
        code = 2 if {c for c in codes if c >= 0} == {2} else 1
        if code == 2:
            print(
                f"loom: a worker failed (exit codes {sorted(codes)}); see its message above", file=sys.stderr
            )
        else:
            log, n = os.path.join(cfg.run.dir, RESTARTS), launch.max_restarts
            used = f"; no restarts left (--max-restarts {n}): see {log}" if n else ""
            print(
                f"loom: a worker failed: {describe_failures(failure_entries(err.failures, ''))}{used}",
                file=sys.stderr,
            )
        return code
    return 0


def _after_signal(run_dir: str, sigval, started: float) -> int:
    """The launcher got SIGTERM / SIGINT and its workers have stopped: 0 when they saved (rank 0 wrote
    ``preempted.json`` during this launch), else 1; one line either way."""
    from loom.runtime.guard import PREEMPTED

    name = getattr(sigval, "name", str(sigval))
    path = os.path.join(run_dir, PREEMPTED)
    try:
        if os.path.getmtime(path) >= started:
            with open(path) as fh:
                step = json.load(fh)["step"]
            print(f"loom: {name}: the workers saved step {step} and stopped", file=sys.stderr, flush=True)
            return 0
    except (OSError, ValueError, KeyError):
        pass
    print(
        f"loom: {name}: the workers stopped before saving a checkpoint (the last complete one stays)",
        file=sys.stderr,
        flush=True,
    )
    return 1
