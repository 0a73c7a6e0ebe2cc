"""``loom launch``: one training job on many machines, from a hostfile (ssh), SLURM (an sbatch script),
Kubernetes (PyTorchJob and JobSet manifests) or a Ray cluster (one actor per rank). Arguments it does not know are ``loom train``'s."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shlex
import sys

from loom.config.errors import ConfigError

USAGE = """usage: loom launch --hostfile FILE [--include H[:S,..]@.. | --exclude ..] [--launcher-cmd CMD] [--dry-run]
                   [loom train args ...]
       loom launch --slurm --nodes N --gpus-per-node G [--partition P] [--time T] [--account A] [--submit]
                   [loom train args ...]
       loom launch --kubernetes --image IMG --nodes N --gpus-per-node G [--name NAME] [loom train args ...]
       loom launch --ray --nproc N [--gpus] [--address auto] [loom train args ...]

Starts one elastic agent (`loom train --nnodes N --nproc-per-node G --rdzv-backend c10d ...`) per machine;
the agents meet at the first machine's rendezvous and train one job. Arguments launch does not know are
passed to `loom train` (--config FILE, --section.field VALUE ...). docs/operations.md#launchers has examples.

hostfile (DeepSpeed's format: lines `HOST slots=N`, # comments):
  --hostfile FILE          the hosts; the first hosts the rendezvous (--master-addr to use another address)
  --include / --exclude S  hosts (and slots) to use / leave out: `h1@h2:0,1` (DeepSpeed's syntax)
  --launcher-cmd CMD       how to run a command on a host: words with {host} and {cmd}; default $LOOM_SSH or
                           "ssh -o BatchMode=yes {host} {cmd}" (e.g. "pdsh -w {host} {cmd}"; "bash -c {cmd}"
                           runs every "host" on this machine)
  --workdir DIR            the folder the agents start in (default: this one; the same path on every host)
  --python PATH            the Python every host runs (default: this one, e.g. the venv's)
  --env KEY=VALUE          one more variable for every host (NCCL_*, GLOO_*, TORCH_NCCL_*, PYTHONPATH,
                           VIRTUAL_ENV, OMP_NUM_THREADS ... are forwarded already)
  --rdzv-file PATH         meet through a file on a shared filesystem instead of a TCP port (--rdzv-backend file)
  --grace-s S              after one host fails, how long the others get to save and stop (default 60)
  --dry-run                print each host's command and exit

SLURM:
  --slurm                  write an sbatch script (one srun task per node, each an agent with G workers)
  --nodes N --gpus-per-node G --partition P --time T --account A --cpus-per-node C --job-name NAME
  --sbatch OPT             one more #SBATCH option (e.g. --sbatch=--qos=high)
  --script PATH            where the script goes (default loom_<job-name>.sbatch); --submit runs sbatch on it

Kubernetes:
  --kubernetes             write NAME.pytorchjob.yaml (Kubeflow) and NAME.jobset.yaml (JobSet); JSON where
                           PyYAML is missing (kubectl apply -f takes either)
  --image IMG --nodes N --gpus-per-node G --name NAME [--namespace NS] [--out DIR]

Ray (pip install 'loom-train[ray]'):
  --ray                    run the job on a Ray cluster: one actor per rank, each a `loom train` worker in its own
                           process; they meet at a free port on rank 0's node (gloo, or NCCL with --gpus)
  --nproc N                the job's ranks (Ray actors)
  --gpus                   one GPU per rank (without it: CPU ranks on gloo)
  --address ADDR           the Ray cluster: auto (the one `ray start` began here), ray://HOST:10001, or none given:
                           the one ray.init finds (RAY_ADDRESS) or a local instance it starts
  --cpus-per-worker C      CPUs Ray reserves for each rank (default 1; also its OMP_NUM_THREADS)
  --env KEY=VALUE          one more variable for every rank

every launcher:
  --master-port PORT       the rendezvous port on the first machine (default 29500)
  --max-restarts R         restarts of the workers before the job fails (loom train --max-restarts)
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loom launch", add_help=False, allow_abbrev=False)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--hostfile")
    mode.add_argument("--slurm", action="store_true")
    mode.add_argument("--kubernetes", action="store_true")
    mode.add_argument("--ray", action="store_true")
    p.add_argument("--nproc", type=int, default=None)
    p.add_argument("--gpus", action="store_true")
    p.add_argument("--address", default=None)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--include", default="")
    p.add_argument("--exclude", default="")
    p.add_argument("--launcher-cmd", default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--rdzv-file", default=None)
    p.add_argument("--grace-s", type=float, default=60.0)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--master-addr", default=None)
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--max-restarts", type=int, default=None)
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--partition", default="")
    p.add_argument("--time", default="")
    p.add_argument("--account", default="")
    p.add_argument("--cpus-per-node", type=int, default=None)
    p.add_argument("--job-name", default="loom")
    p.add_argument("--sbatch", action="append", default=[])
    p.add_argument("--script", default=None)
    p.add_argument("--submit", action="store_true")
    p.add_argument("--image", default=None)
    p.add_argument("--name", default="loom")
    p.add_argument("--namespace", default="")
    p.add_argument("--out", default=".")
    return p


class _Refusal(Exception):
    pass


def parse(argv: list[str]):
    """(launch's options, the rest for loom train). Option values are checked here, one line each."""
    p = parser()

    def refuse(message):
        raise _Refusal(message)

    p.error = refuse
    try:
        opts, train_args = p.parse_known_args(argv)
    except _Refusal as err:
        raise ConfigError(
            "loom launch", None, f"{err} (see `loom launch --help`)", show_value=False
        ) from None
    owned = {
        "--nnodes": "the hostfile's hosts or --nodes",
        "--nproc-per-node": "slots= or --gpus-per-node",
        "--node-rank": "the host's place in the hostfile",
        "--rdzv-backend": "--rdzv-file",
        "--rdzv-endpoint": "--master-addr / --master-port",
        "--rdzv-id": "a fresh id per launch",
        "--standalone": "one agent per machine",
    }
    for arg in train_args:
        name = arg.partition("=")[0].replace("_", "-")
        if name in owned:
            raise ConfigError(
                name, None, f"loom launch sets it for every agent (from {owned[name]})", show_value=False
            )
    for name in ("nodes", "gpus_per_node", "master_port", "cpus_per_node", "nproc"):
        value = getattr(opts, name)
        if value is not None and value < (0 if name == "gpus_per_node" else 1):
            raise ConfigError("--" + name.replace("_", "-"), value, "expected a positive integer")
    if not (math.isfinite(opts.cpus_per_worker) and opts.cpus_per_worker > 0):
        raise ConfigError("--cpus-per-worker", opts.cpus_per_worker, "expected a number of CPUs > 0")
    if opts.max_restarts is not None and opts.max_restarts < 0:
        raise ConfigError("--max-restarts", opts.max_restarts, "expected 0 or more")
    if opts.master_port is not None and opts.master_port > 65535:
        raise ConfigError("--master-port", opts.master_port, "a TCP port is 1..65535")
    if not (math.isfinite(opts.grace_s) and opts.grace_s >= 0):
        raise ConfigError(
            "--grace-s", opts.grace_s, "expected seconds >= 0 (how long workers get to save after SIGTERM)"
        )
    if opts.kubernetes and not DNS_1123.fullmatch(opts.name or ""):
        raise ConfigError(
            "--name",
            opts.name,
            "a Kubernetes name is a DNS-1123 label: at most 63 lowercase letters, "
            "digits or '-', starting and ending with a letter or digit",
        )
    if opts.kubernetes and opts.namespace and not DNS_1123.fullmatch(opts.namespace):
        raise ConfigError(
            "--namespace",
            opts.namespace,
            "a Kubernetes namespace is a DNS-1123 label: at most 63 lowercase letters, digits or '-', starting and "
            "ending with a letter or digit",
        )
    if opts.slurm and not SLURM_NAME.fullmatch(opts.job_name):
        raise ConfigError(
            "--job-name", opts.job_name, "a SLURM job name here is letters, digits and . _ - (no spaces)"
        )
    if opts.slurm and opts.time and not SLURM_TIME.fullmatch(opts.time):
        raise ConfigError(
            "--time",
            opts.time,
            "SLURM's time limit: MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED",
        )
    return opts, train_args


DNS_1123 = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
SLURM_NAME = re.compile(r"[A-Za-z0-9._-]+")  # it names the script file too
SLURM_TIME = re.compile(
    r"(?i:unlimited|infinite)|\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+"
)


def check_train_args(train_args: list[str], world_size: int | None, device: str | None = None) -> None:
    """The `loom train` options every host will get, checked here as `loom train` checks them (a misspelled field,
    a bad value, a layout that does not divide ``world_size`` workers) before any per-host command is written: an
    error is one line now, not one per host later. Files the run reads may exist on the hosts only, so a missing
    one is left to them. ``device``: the device type the workers have (a script for a cluster: not this machine's,
    which is then not checked)."""
    from loom.cli.preflight import load_config
    from loom.config.errors import UserError

    try:
        cfg, _ = load_config(list(train_args))
    except ConfigError as err:
        if any(words in str(err) for words in ("no such", "not found", "does not exist")):
            return  # a path that may exist on the hosts only
        raise
    except UserError:
        return  # an environment problem of this machine (a file), not of the options
    check_layout(cfg, world_size, device)


def check_layout(cfg, world_size: int | None, device: str | None) -> None:
    """The layout (and every rule of `loom train`) for ``world_size`` workers; ``device``: theirs, where they are
    not on this machine (SLURM nodes, Kubernetes pods)."""
    from loom.methods import resolve

    if world_size:
        resolve(cfg, world_size, **({"device": device, "triton": device == "cuda"} if device else {}))


def _cluster_device(opts) -> str:
    return "cuda" if opts.gpus_per_node else "cpu"


def main(argv: list[str]) -> int:
    opts, train_args = parse(argv)
    if opts.help or not (opts.hostfile or opts.slurm or opts.kubernetes or opts.ray):
        print(USAGE)
        return 0 if opts.help else 2
    if opts.ray:
        return ray(opts, train_args)
    if opts.hostfile:
        return hostfile(opts, train_args)
    if opts.slurm:
        return slurm(opts, train_args)
    return kubernetes(opts, train_args)


def hostfile(opts, train_args: list[str]) -> int:
    from loom.cluster.launch import (
        DEFAULT_LAUNCHER,
        DEFAULT_PORT,
        LAUNCHER_ENV,
        Rendezvous,
        hostfile_launches,
        parse_hostfile,
        run_launches,
        select_hosts,
    )

    try:
        with open(opts.hostfile, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise ConfigError("--hostfile", opts.hostfile, f"cannot be read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            "--hostfile", opts.hostfile, f"not UTF-8 text (byte {err.start}): expected lines 'HOST slots=N'"
        ) from None
    hosts = select_hosts(parse_hostfile(text, opts.hostfile), opts.include, opts.exclude)
    check_train_args(train_args, sum(h.nproc for h in hosts))
    if opts.rdzv_file:
        rdzv = Rendezvous(os.path.abspath(opts.rdzv_file), backend="file")
    else:
        rdzv = Rendezvous(f"{opts.master_addr or hosts[0].name}:{opts.master_port or DEFAULT_PORT}")
    launcher = opts.launcher_cmd or os.environ.get(LAUNCHER_ENV) or DEFAULT_LAUNCHER
    launches = hostfile_launches(
        hosts,
        train_args,
        workdir=os.path.abspath(opts.workdir or os.getcwd()),
        python=opts.python,
        environ=dict(os.environ),
        launcher=launcher,
        rdzv=rdzv,
        extra_env=opts.env,
        max_restarts=opts.max_restarts,
    )
    if opts.dry_run:
        for launch in launches:
            print(shlex.join(launch.argv))
        return 0
    total = sum(h.nproc for h in hosts)
    print(
        f"loom launch: {len(hosts)} hosts, {total} workers, rendezvous {rdzv.backend} at {rdzv.endpoint} "
        f"(id {rdzv.run_id})",
        flush=True,
    )
    return run_launches(launches, grace_s=opts.grace_s)


def _need(opts, *names: str) -> None:
    for name in names:
        if getattr(opts, name) in (None, ""):
            mode = "--slurm" if opts.slurm else "--kubernetes"
            raise ConfigError("--" + name.replace("_", "-"), None, f"{mode} needs it", show_value=False)


def check_script_config(train_args: list[str], workdir: str, world_size: int, device: str) -> None:
    """The job's config before a script that runs later is written: --config FILE exists (a relative path from
    ``workdir``, where the agents start) and, with the --section.field overrides, is a valid config whose layout
    divides the ``world_size`` workers the script asks for."""
    from loom.config import build_config, parse_overrides
    from loom.runtime.launch import parse_launch

    launch, rest = parse_launch(train_args)
    path = launch.config
    if path:
        found = path if os.path.isabs(path) else os.path.join(workdir, path)
        if not os.path.isfile(found):
            raise ConfigError(
                "--config",
                path,
                f"no such file (the job's loom train reads it from {found}; "
                "--workdir DIR sets the folder the agents start in)",
            )
        path = found
    check_layout(build_config(path, parse_overrides(rest)), world_size, device)


def _warn_cpus(opts) -> None:
    """Without --cpus-per-node SLURM's default (often 1 CPU) is shared by the agent, its workers and data loading."""
    if not opts.cpus_per_node:
        print(
            "loom launch: warning: no --cpus-per-node, so the script asks for no --cpus-per-task and SLURM gives "
            "each node's task (the agent and its workers) its default CPUs, often 1: data loading and the workers' "
            "threads share them; pass --cpus-per-node C (e.g. the node's cores)",
            file=sys.stderr,
            flush=True,
        )


def slurm(opts, train_args: list[str]) -> int:
    from loom.cluster.launch import DEFAULT_PORT, SlurmJob, sbatch_script, submit

    _need(opts, "nodes", "gpus_per_node")
    # the script runs on the cluster's shared filesystem: --config is looked for from --workdir; the layout is
    # checked against the nodes x GPUs the script asks for
    check_script_config(
        train_args,
        os.path.abspath(opts.workdir or os.getcwd()),
        opts.nodes * opts.gpus_per_node,
        _cluster_device(opts),
    )
    job = SlurmJob(
        opts.nodes,
        opts.gpus_per_node,
        opts.partition,
        opts.time,
        opts.account,
        opts.job_name,
        cpus_per_node=opts.cpus_per_node or 0,
        port=opts.master_port or DEFAULT_PORT,
        extra=opts.sbatch,
    )
    text = sbatch_script(
        job,
        train_args,
        workdir=os.path.abspath(opts.workdir or os.getcwd()),
        python=opts.python,
        environ=dict(os.environ),
        extra_env=opts.env,
        max_restarts=opts.max_restarts,
    )
    if opts.dry_run:
        sys.stdout.write(text)
        _warn_cpus(opts)
        return 0
    path = opts.script or f"loom_{opts.job_name}.sbatch"
    try:
        with open(path, "w") as fh:
            fh.write(text)
        os.chmod(path, 0o755)
    except OSError as err:
        with contextlib.suppress(OSError):
            if os.path.isfile(path) and os.path.getsize(path) < len(text.encode()):
                os.remove(path)  # nothing partial
        raise ConfigError("--script", path, f"cannot be written ({err.strerror or err})") from None
    _warn_cpus(opts)  # after every check: an error stays the one line printed
    print(
        f"loom launch: wrote {path} ({opts.nodes} nodes x {opts.gpus_per_node} GPUs); submit it with: sbatch {path}"
    )
    return submit(path) if opts.submit else 0


def kubernetes(opts, train_args: list[str]) -> int:
    from loom.cluster.launch import DEFAULT_PORT, KubeJob, dump_manifest, forwarded_env, jobset, pytorchjob

    _need(opts, "image", "nodes", "gpus_per_node")
    check_train_args(
        train_args, opts.nodes * opts.gpus_per_node, _cluster_device(opts)
    )  # the manifests' workers
    job = KubeJob(
        opts.name,
        opts.image,
        opts.nodes,
        opts.gpus_per_node,
        opts.master_port or DEFAULT_PORT,
        opts.max_restarts,
        opts.namespace,
    )
    env = forwarded_env({}, opts.env)  # this machine's variables mean nothing in the pods: only --env pairs
    written = []
    for kind, build in (("pytorchjob", pytorchjob), ("jobset", jobset)):
        text, ext = dump_manifest(build(job, train_args, env))
        if opts.dry_run:
            sys.stdout.write(f"# {kind}\n{text}")
            continue
        path = os.path.join(opts.out, f"{opts.name}.{kind}.{ext}")
        try:
            os.makedirs(opts.out, exist_ok=True)
            with open(path, "w") as fh:
                fh.write(text)
        except OSError as err:
            for done in written + [path]:
                with contextlib.suppress(OSError):
                    os.remove(done)  # nothing partial
            raise ConfigError("--out", opts.out, f"cannot be written ({err.strerror or err})") from None
        written.append(path)
    if written:
        print(
            f"loom launch: wrote {' and '.join(written)}; start one with: kubectl apply -f {written[0]} "
            "(the Kubeflow training operator) or the JobSet one (the JobSet controller)"
        )
    return 0


def ray(opts, train_args: list[str]) -> int:
    from loom.cli.ray_launch import run

    if not opts.nproc:
        raise ConfigError("--nproc", None, "--ray needs it: the job's ranks (Ray actors)", show_value=False)
    if opts.max_restarts:
        raise ConfigError(
            "--max-restarts",
            opts.max_restarts,
            "--ray restarts nothing: run the command again and checkpoint.resume = auto continues (allowed: 0)",
        )
    extra = {}
    for pair in opts.env:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError("--env", pair, "expected KEY=VALUE")
        extra[key] = value
    check_train_args(
        train_args, opts.nproc, "cuda" if opts.gpus else "cpu"
    )  # one line before any actor starts
    return run(
        train_args,
        opts.nproc,
        gpus=opts.gpus,
        address=opts.address,
        cpus_per_worker=opts.cpus_per_worker,
        workdir=opts.workdir,
        env=extra,
    )
