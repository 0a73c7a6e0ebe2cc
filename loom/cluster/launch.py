"""Starting one job on many machines: one elastic agent (``loom train --nnodes N ...``) per host over ssh from a
hostfile, an sbatch script that starts one agent per node with srun, and Kubernetes manifests (a Kubeflow
PyTorchJob and a JobSet) that do the same in pods.

Every path ends in the same agent command: ``loom train --nnodes N --node-rank i --nproc-per-node G
--rdzv-backend c10d --rdzv-endpoint HEAD:PORT --rdzv-id ID`` followed by the run's own ``loom train``
arguments; the agents meet at the rendezvous, number the workers host by host and restart them together.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from loom.config.errors import ConfigError, UserError

DEFAULT_PORT = 29500
DEFAULT_LAUNCHER = "ssh -o BatchMode=yes {host} {cmd}"
LAUNCHER_ENV = "LOOM_SSH"  # the launcher command when --launcher-cmd is not given
# variables that change how a job communicates or finds its code: sent to every host (names or prefixes)
FORWARD_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "UCX_", "FI_", "NVSHMEM_")
FORWARD_NAMES = (
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "OMP_NUM_THREADS",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCH_CPP_LOG_LEVEL",
    "HF_HOME",
    "LOOM_TEST_HANG_SECONDS",
)


# ---- hostfiles ------------------------------------------------------------------------------------------------


@dataclass
class Host:
    name: str
    slots: int
    devices: list[int] | None = None  # the slots (CUDA device indexes) to use; None: all of them

    @property
    def nproc(self) -> int:
        return len(self.devices) if self.devices is not None else self.slots


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """DeepSpeed's hostfile format: one ``host slots=N`` per line; ``#`` starts a comment; blank lines skipped."""
    hosts: list[Host] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
        if m is None:
            raise ConfigError(
                "--hostfile", source, f"line {n} {raw.strip()!r}: expected 'HOST slots=N'", show_value=True
            )
        name, slots = m.group(1), int(m.group(2))
        if slots < 1:
            raise ConfigError("--hostfile", source, f"line {n}: slots must be at least 1")
        if any(h.name == name for h in hosts):
            raise ConfigError("--hostfile", source, f"line {n}: host {name} is listed twice")
        hosts.append(Host(name, slots))
    if not hosts:
        raise ConfigError("--hostfile", source, "names no host (expected lines 'HOST slots=N')")
    return hosts


def _parse_filter(spec: str, option: str) -> dict[str, list[int] | None]:
    """``host1@host2:0,2``: hosts separated by ``@``, each with an optional list of slots (DeepSpeed's syntax)."""
    out: dict[str, list[int] | None] = {}
    for part in filter(None, spec.split("@")):
        name, _, slots = part.partition(":")
        try:
            out[name] = sorted({int(s) for s in slots.split(",")}) if slots else None
        except ValueError:
            raise ConfigError(option, spec, "expected HOST[:SLOT,SLOT...] joined by '@'") from None
    return out


def select_hosts(hosts: list[Host], include: str = "", exclude: str = "") -> list[Host]:
    """The hosts (and slots) that ``--include`` keeps and ``--exclude`` drops."""
    if include and exclude:
        raise ConfigError("--include", include, "give --include or --exclude, not both")
    known = {h.name: h for h in hosts}
    spec, option = (include, "--include") if include else (exclude, "--exclude")
    chosen = _parse_filter(spec, option) if spec else {}
    for name, slots in chosen.items():
        if name not in known:
            raise ConfigError(option, spec, f"host {name} is not in the hostfile ({', '.join(known)})")
        bad = [s for s in slots or [] if s >= known[name].slots]
        if bad:
            raise ConfigError(option, spec, f"{name} has slots 0-{known[name].slots - 1}, not {bad}")
    out = []
    for h in hosts:
        if include:
            if h.name in chosen:
                out.append(Host(h.name, h.slots, chosen[h.name]))
        elif h.name not in chosen:
            out.append(h)
        elif chosen[h.name] is not None:
            keep = [s for s in range(h.slots) if s not in chosen[h.name]]
            if keep:
                out.append(Host(h.name, h.slots, keep))
    if not out:
        raise ConfigError(option, spec, "leaves no host")
    return out


# ---- the agent command ------------------------------------------------------------------------------------------


def forwarded_env(environ: dict[str, str], extra: list[str] = ()) -> dict[str, str]:
    """The variables sent to every host: NCCL / GLOO / torch.distributed settings, the Python path and venv,
    then ``--env KEY=VALUE`` pairs."""
    out = {k: v for k, v in sorted(environ.items()) if k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES}
    for item in extra:
        key, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError("--env", item, "expected KEY=VALUE")
        out[key] = value
    return out


@dataclass
class Rendezvous:
    """Where the agents meet: ``c10d`` at ``HOST:PORT`` (a TCPStore on the first host) or ``file`` at a path on a
    filesystem every host mounts (loom.runtime.rendezvous)."""

    endpoint: str
    run_id: str = field(default_factory=lambda: f"loom-{uuid.uuid4().hex[:8]}")
    backend: str = "c10d"


def agent_args(
    nnodes: int | str,
    node_rank: int | str | None,
    nproc: int | str,
    rdzv: Rendezvous,
    max_restarts: int | None = None,
) -> list[str]:
    """``loom train``'s elastic-agent options for one node."""
    args = ["--nnodes", str(nnodes)]
    if node_rank is not None:
        args += ["--node-rank", str(node_rank)]
    args += [
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        rdzv.backend,
        "--rdzv-endpoint",
        rdzv.endpoint,
        "--rdzv-id",
        rdzv.run_id,
    ]
    if max_restarts is not None:
        args += ["--max-restarts", str(max_restarts)]
    return args


def remote_command(workdir: str, env: dict[str, str], python: str, args: list[str]) -> str:
    """The shell line a host runs: the agent in ``workdir`` with ``env``, stopped (SIGTERM: the workers save and
    exit) when the launcher's connection closes, i.e. when the launcher stops it or dies."""
    assign = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    agent = " ".join(
        filter(None, ["env", assign, shlex.quote(python), "-m", "loom", "train", *map(shlex.quote, args)])
    )
    # a background job's stdin is /dev/null: the watcher reads the line's stdin through fd 3
    watch = "{ cat >/dev/null; kill -TERM $pid; } <&3 >/dev/null 2>&1 & watch=$!"
    return (
        f"cd {shlex.quote(workdir)} && {{ {agent} </dev/null 3<&- & pid=$!; {watch}; wait $pid; rc=$?; "
        f"kill $watch 2>/dev/null; exit $rc; }} 3<&0"
    )


def launcher_argv(template: str, host: str, cmd: str) -> list[str]:
    """The local command that runs ``cmd`` on ``host``: ``template``'s words with ``{host}`` and ``{cmd}`` filled
    in (``ssh -o BatchMode=yes {host} {cmd}``, ``pdsh -w {host} {cmd}``, ``bash -c {cmd}`` for this machine);
    without ``{cmd}`` the command is appended (and the host before it, unless the template has ``{host}``).
    ``{cmd}`` inside a word (``bash -lc 'cd /x && {cmd}'``) is filled in there."""
    try:
        words = shlex.split(template)
    except ValueError as err:  # an unbalanced quote
        raise ConfigError("--launcher-cmd", template, f"does not parse as shell words ({err})") from None
    if not words:
        raise ConfigError("--launcher-cmd", template, "is empty")
    unknown = sorted(set(re.findall(r"\{[^{}\s]*\}", template)) - {"{host}", "{cmd}"})
    if unknown:
        raise ConfigError(
            "--launcher-cmd",
            template,
            f"names {', '.join(unknown)}: the placeholders are {{host}} and {{cmd}}",
        )
    if not any("{cmd}" in w for w in words):  # only what the template does not name yet: `ssh {host}` + cmd
        words += ([] if any("{host}" in w for w in words) else ["{host}"]) + ["{cmd}"]
    return [cmd if w == "{cmd}" else w.replace("{host}", host).replace("{cmd}", cmd) for w in words]


@dataclass
class HostLaunch:
    host: str
    argv: list[str]


def hostfile_launches(
    hosts: list[Host],
    train_args: list[str],
    *,
    workdir: str,
    python: str,
    environ: dict[str, str],
    launcher: str,
    rdzv: Rendezvous,
    extra_env: list[str] = (),
    max_restarts: int | None = None,
) -> list[HostLaunch]:
    """One launch per host: the agent for node i with that host's slots (its devices where a subset is chosen)."""
    env = forwarded_env(environ, extra_env)
    out = []
    for i, h in enumerate(hosts):
        host_env = dict(env)
        if h.devices is not None:
            host_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, h.devices))
        args = agent_args(len(hosts), i, h.nproc, rdzv, max_restarts) + list(train_args)
        out.append(
            HostLaunch(
                h.name, launcher_argv(launcher, h.name, remote_command(workdir, host_env, python, args))
            )
        )
    return out


def run_launches(launches: list[HostLaunch], *, grace_s: float = 60.0, out=None) -> int:
    """Start every launch, print each line with its host's prefix, and when one fails (or on Ctrl-C) stop the
    others: their connections close, their agents get SIGTERM (the workers save), and after ``grace_s`` what is
    left is killed. Returns 0 when all succeed, else the first failure's exit code (130 on Ctrl-C)."""
    out = out or sys.stdout
    lock = threading.Lock()
    width = max(len(launch.host) for launch in launches)
    procs = [
        subprocess.Popen(
            launch.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        for launch in launches
    ]

    def pump(launch: HostLaunch, proc: subprocess.Popen) -> None:
        prefix = f"[{launch.host:<{width}}] "
        for line in proc.stdout:
            with lock:
                out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                out.flush()

    pumps = [threading.Thread(target=pump, args=pair, daemon=True) for pair in zip(launches, procs)]
    for t in pumps:
        t.start()
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]  # every one polled: a failure is seen while others still run
            failed = [c for c in codes if c not in (None, 0)]
            if failed or None not in codes:
                # killed by N: 128 + N
                code = (failed[0] if failed[0] > 0 else 128 - failed[0]) if failed else 0
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        code = 130
    if code:
        failed = [launch.host for launch, p in zip(launches, procs) if p.returncode not in (None, 0)]
        with lock:
            print(
                f"loom launch: {', '.join(failed) or 'interrupted'}: stopping the other hosts",
                file=sys.stderr,
                flush=True,
            )
        _stop(procs, grace_s)
    for t in pumps:
        t.join(timeout=5)
    return code


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """Close every running launch's stdin (its host's watcher sends the agent SIGTERM), then kill leftovers."""
    import signal

    for p in procs:
        if p.poll() is None and p.stdin:
            try:
                p.stdin.close()
            except OSError:
                pass
    deadline = time.time() + grace_s
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# ---- SLURM ---------------------------------------------------------------------------------------------------------


@dataclass
class SlurmJob:
    nodes: int
    gpus_per_node: int
    partition: str = ""
    time: str = ""
    account: str = ""
    job_name: str = "loom"
    output: str = "loom-%j.out"
    cpus_per_node: int = 0
    port: int = DEFAULT_PORT
    extra: list[str] = field(default_factory=list)  # more #SBATCH options, e.g. --qos=high


def sbatch_script(
    job: SlurmJob,
    train_args: list[str],
    *,
    workdir: str,
    python: str,
    environ: dict[str, str],
    extra_env: list[str] = (),
    max_restarts: int | None = None,
) -> str:
    """A batch script: one task per node (``srun --ntasks-per-node=1``), each an elastic agent with
    ``--gpus-per-node`` workers, meeting at the first node of the allocation."""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    for name, value in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if value:
            lines.append(f"#SBATCH --{name}={value}")
    if job.cpus_per_node:  # srun binds the one task per node to these CPUs: the agent and all its workers
        lines.append(f"#SBATCH --cpus-per-task={job.cpus_per_node}")
    lines.append(f"#SBATCH --output={job.output}")
    lines += [f"#SBATCH {opt}" for opt in job.extra]
    lines += [
        "",
        "set -euo pipefail",
        "# the first node of the allocation hosts the rendezvous",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    ]
    env = forwarded_env(environ, extra_env)
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    rdzv = Rendezvous("$head:" + str(job.port), "$SLURM_JOB_ID")
    # no --node-rank: the c10d rendezvous numbers the nodes; the variables are the batch shell's, the same everywhere
    args = agent_args("$SLURM_NNODES", None, job.gpus_per_node or 1, rdzv, max_restarts)
    words = [
        shlex.quote(python),
        "-m",
        "loom",
        "train",
        *(_sh_word(a) for a in args),
        *map(shlex.quote, train_args),
    ]
    lines += [
        f"cd {shlex.quote(workdir)}",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 " + " ".join(words),
    ]
    return "\n".join(lines) + "\n"


def _sh_word(arg: str) -> str:
    """A word for the script: variables (``$head``, ``$SLURM_NNODES``) stay expandable, the rest is quoted."""
    return f'"{arg}"' if "$" in arg else shlex.quote(arg)


def submit(script_path: str) -> int:
    """``sbatch SCRIPT`` where sbatch is installed; its output passes through."""
    import shutil

    if shutil.which("sbatch") is None:
        raise UserError(
            f"--submit: sbatch is not on PATH here; the script is {script_path}: submit it where SLURM "
            "runs (sbatch " + script_path + ")"
        )
    return subprocess.call(["sbatch", script_path])


# ---- Kubernetes ----------------------------------------------------------------------------------------------------


@dataclass
class KubeJob:
    name: str
    image: str
    nodes: int
    gpus_per_node: int
    port: int = DEFAULT_PORT
    max_restarts: int | None = None
    namespace: str = ""


def _container(job: KubeJob, args: list[str], env: dict[str, str]) -> dict:
    c = {
        "name": "pytorch",  # the training operator finds its container by this name
        "image": job.image,
        "command": ["python", "-m", "loom", "train"],
        "args": args,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }  # NCCL's shared-memory transport needs room
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if job.gpus_per_node:
        c["resources"] = {"limits": {"nvidia.com/gpu": job.gpus_per_node}}
    return c


def _pod_spec(job: KubeJob, args: list[str], env: dict[str, str], restart: str | None = None) -> dict:
    spec = {
        "containers": [_container(job, args, env)],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if restart:
        spec["restartPolicy"] = restart
    return spec


def _metadata(job: KubeJob) -> dict:
    return {"name": job.name, **({"namespace": job.namespace} if job.namespace else {})}


def pytorchjob(job: KubeJob, train_args: list[str], env: dict[str, str]) -> dict:
    """A Kubeflow PyTorchJob (kubeflow.org/v1) of ``nodes`` Worker pods with an elastic policy; the pods meet at
    the first worker's service (``NAME-worker-0``), which the training operator creates."""
    rdzv = Rendezvous(f"{job.name}-worker-0:{job.port}", job.name)
    args = agent_args(job.nodes, None, job.gpus_per_node or 1, rdzv, job.max_restarts) + list(train_args)
    elastic = {
        "rdzvBackend": "c10d",
        "rdzvPort": job.port,
        "minReplicas": job.nodes,
        "maxReplicas": job.nodes,
    }
    if job.max_restarts is not None:
        elastic["maxRestarts"] = job.max_restarts
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(job),
        "spec": {
            "elasticPolicy": elastic,
            "nprocPerNode": str(job.gpus_per_node or 1),
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": job.nodes,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": _pod_spec(job, args, env)},
                }
            },
        },
    }


def jobset(job: KubeJob, train_args: list[str], env: dict[str, str]) -> dict:
    """A JobSet (jobset.x-k8s.io/v1alpha2): one indexed Job of ``nodes`` pods; pod 0 of job 0 is reachable as
    ``NAME-node-0-0.NAME`` (the JobSet's headless service) and hosts the rendezvous."""
    rdzv = Rendezvous(f"{job.name}-node-0-0.{job.name}:{job.port}", job.name)
    args = agent_args(job.nodes, "$(JOB_COMPLETION_INDEX)", job.gpus_per_node or 1, rdzv, job.max_restarts)
    pod = _pod_spec(job, args + list(train_args), env, "Never")
    # declared in the container so that $(JOB_COMPLETION_INDEX) in args expands: the annotation the Job sets
    index = {
        "name": "JOB_COMPLETION_INDEX",
        "valueFrom": {
            "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
        },
    }
    pod["containers"][0]["env"] = [index, *pod["containers"][0].get("env", [])]
    spec: dict = {
        "network": {"enableDNSHostnames": True},
        "replicatedJobs": [
            {
                "name": "node",
                "replicas": 1,
                "template": {
                    "spec": {
                        "parallelism": job.nodes,
                        "completions": job.nodes,
                        "completionMode": "Indexed",
                        "backoffLimit": 0,
                        "template": {"spec": pod},
                    }
                },
            }
        ],
    }
    if job.max_restarts is not None:
        spec["failurePolicy"] = {"maxRestarts": job.max_restarts}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": _metadata(job),
        "spec": spec,
    }


def dump_manifest(obj: dict) -> tuple[str, str]:
    """(text, extension): YAML where PyYAML is installed, else JSON (kubectl accepts both)."""
    try:
        import yaml
    except ImportError:
        return json.dumps(obj, indent=2) + "\n", "json"
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False), "yaml"
