"""``loom train``: one process, or workers started by PyTorch's elastic agent (local, restarted, on several nodes)."""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass

from loom.config import ConfigError, build_config, parse_overrides, to_toml
from loom.train.run_dir import acquire, check_writable_dirs, checkpoint_dir, held_env

USAGE = """usage: loom train [--config FILE.toml] [--nproc-per-node N] [--section.field VALUE ...]
                  [--print-config] [--dry-run]
                  [--max-restarts N] [--nnodes N|MIN:MAX] [--node-rank R] [--rdzv-backend c10d|file]
                  [--rdzv-endpoint HOST:PORT|PATH] [--rdzv-id ID] [--rdzv-conf KEY=VALUE,...]
       loom train --help [SECTION]

Trains with defaults < FILE < overrides. Without --config and --data.source it trains the
`debug` model on this Python's standard-library sources (nothing is downloaded).

options:
  -c, --config FILE       TOML file of [section] tables, written as --print-config prints them
  --nproc-per-node N      start N local worker processes (PyTorch's elastic launcher); plan for N ranks
  --section.field VALUE   one config field (or --section.field=VALUE); the command line wins over FILE
  --print-config          print the config that defaults < FILE < command line give (TOML) and exit
  --dry-run               run every check a start runs, build the model on the meta device, print the plan
                          (layout, parameters, memory per device, tokens per step) and exit; writes nothing
  -h, --help [SECTION]    this text, or SECTION's fields: defaults, allowed values and meaning

restarts and several nodes (PyTorch's elastic agent; docs/operations.md):
  --max-restarts N        when a worker fails (killed, crashed, its node lost), restart all workers up to N times;
                          each restart resumes from the newest complete checkpoint and is recorded in
                          <run.dir>/restarts.jsonl and metrics.jsonl (default 0)
  --nnodes N|MIN:MAX      nodes in the job (default 1), one `loom train` per node; MIN:MAX is elastic: the job
                          re-forms when nodes leave or join, with parallel.dp_shard = -1 re-derived for the new size
  --node-rank R           c10d: only node 0 may serve the rendezvous store, the others only connect (default: the
                          first agent on the endpoint's host serves it); node ranks are assigned on arrival
  --rdzv-backend NAME     c10d (default: a TCP store on --rdzv-endpoint HOST:PORT) | file (a file on a filesystem
                          every node mounts: --rdzv-endpoint PATH; no port is served)
  --rdzv-endpoint ADDR    HOST:PORT (c10d) or PATH (file): where the nodes meet; needed with more than one node
  --rdzv-id ID            the job's id, the same on every node (default none)
  --rdzv-conf K=V,...     rendezvous settings, e.g. join_timeout=600,last_call_timeout=30
"""

PREVIEWS = {"--print-config": "print-config", "--print_config": "print-config", "--dry-run": "dry-run",
            "--dry_run": "dry-run"}
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
            conf.append("is_host=0")  # only node 0 may serve the store (it does where it runs on the endpoint's host)
        return [*args, f"--nnodes={lo}:{hi}" if lo < hi else f"--nnodes={lo}", f"--rdzv-backend={self.rdzv_backend}",
                f"--rdzv-endpoint={self.rdzv_endpoint}", f"--rdzv-id={self.rdzv_id}",
                *([f"--rdzv-conf={','.join(conf)}"] if conf else [])]


def _count(name: str, val: str, least: int) -> int:
    try:
        n = int(val)
    except ValueError:
        n = None
    if n is None or n < least:
        raise ConfigError(name, val if n is None else n,
                          "expected a positive integer" if least else "expected a whole number >= 0")
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
    "--config": ("config", str), "-c": ("config", str),
    "--nproc-per-node": ("nproc", lambda v: _count("--nproc-per-node", v, 1)),
    "--max-restarts": ("max_restarts", lambda v: _count("--max-restarts", v, 0)),
    "--nnodes": ("nnodes", _nnodes),
    "--node-rank": ("node_rank", lambda v: _count("--node-rank", v, 0)),
    "--rdzv-backend": ("rdzv_backend", _backend),
    "--rdzv-endpoint": ("rdzv_endpoint", str),
    "--rdzv-id": ("rdzv_id", str),
    "--rdzv-conf": ("rdzv_conf", _rdzv_conf),
}
LAUNCH_OPTIONS.update({k.replace("-", "_").replace("__", "--"): v for k, v in list(LAUNCH_OPTIONS.items())
                       if k.startswith("--")})
# loom train's own options: a misspelt one is named as such, not as an unknown config key
OPTIONS = ("--config", "--print-config", "--dry-run", "--help",
           *(k for k in LAUNCH_OPTIONS if k.startswith("--") and "_" not in k and k != "--config"))


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
        raise ConfigError("--node-rank", launch.node_rank, f"must be below --nnodes "
                          f"{':'.join(map(str, sorted(set(launch.nnodes))))} (0 <= rank < nodes)")
    if launch.rdzv_backend == "file" and launch.rdzv_endpoint:
        folder = os.path.dirname(os.path.abspath(launch.rdzv_endpoint))
        if not os.path.isdir(folder):
            raise ConfigError("--rdzv-endpoint", launch.rdzv_endpoint, f"its folder {folder} does not exist on this "
                              "node (the file backend needs a filesystem every node mounts)")
    if launch.rdzv_backend != "file" and launch.rdzv_endpoint and ":" in launch.rdzv_endpoint:
        port = launch.rdzv_endpoint.rpartition(":")[2]
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError("--rdzv-endpoint", launch.rdzv_endpoint, "HOST:PORT with a port in 1..65535")
    if (launch.multi_node or launch.rdzv_backend == "file") and not launch.rdzv_endpoint:
        what = "PATH: a file on a filesystem every node mounts" if launch.rdzv_backend == "file" else \
            "HOST:PORT that every node reaches (the first agent there serves the rendezvous store)"
        why = "--rdzv-backend file" if launch.rdzv_backend == "file" else \
            f"--nnodes {':'.join(map(str, sorted(set(launch.nnodes))))}"
        raise ConfigError("--rdzv-endpoint", None, f"needed with {why}: {what}", show_value=False)


def load_config(argv: list[str]):
    """(the config, --nproc-per-node)."""
    cfg, launch = load_launch(argv)
    return cfg, launch.nproc


def load_launch(argv: list[str]):
    """(the config, the launcher options)."""
    launch, rest = parse_launch(argv)
    return build_config(launch.config, parse_overrides(rest)), launch


def precheck(cfg, world_size: int, local: int | None = None):
    """Errors that need the world size, the tokenizer, the data, the device or this machine's free memory, found
    once, before any worker starts (``local``: the ranks on this machine; default ``local_ranks``). Returns the
    resolved run (loom.resolve.Run, with its model)."""
    from loom.methods import resolve  # the resolver with the chosen method's rules
    from loom.resolve import check_device

    run = resolve(cfg, world_size)  # the rules relating fields and the world size (the model's come below)
    from loom.metrics.logger import check_trackers

    check_trackers(cfg.metrics)  # metrics.wandb / mlflow without the package: one line before any worker starts
    # these import torch: they come last, after every check that does not need it
    from loom.config.paths import check_folder_writable
    from loom.data import build_tokenizer
    from loom.data.sources import parse_source
    from loom.data.token_file import TokenFile, check_ids, check_tokenizer
    from loom.plan.fit import check_fits
    from loom.train.resume_changes import check_before_start

    specs = parse_source(cfg.data.source, cfg.data.text_field, cfg.data.encoding_errors)
    check_device(cfg)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    run = run.with_model(tokenizer)  # model shape vs the tokenizer's vocabulary, heads / layers vs tp and pp
    if cfg.data.cache_dir and any(spec.kind != "tokens" for spec in specs):  # token files need no cache
        check_folder_writable("data.cache_dir", cfg.data.cache_dir)
    for spec in specs:  # a token file's ids must be the tokenizer's (checked once here, not on every rank)
        if spec.kind == "tokens":
            tf = TokenFile(spec.paths[0])
            check_tokenizer(tf.path, tf.meta, tokenizer)
            check_ids(tf, tokenizer)
    if cfg.model.init_from:
        from loom.checkpoint.hf import check_weights

        check_weights(cfg.model.init_from)  # a truncated download, before any model is built
    check_before_start(cfg)  # a checkpoint this config cannot continue (model shape, data, ...): refused here
    check_fits(cfg, run.dims, run.model_args, run.device, local or local_ranks(world_size))
    return run


def local_ranks(world_size: int) -> int:
    """Ranks on this machine: the launcher's (torchrun's or SLURM's) LOCAL_WORLD_SIZE, else the whole world."""
    from loom.parallel.env import env_from_slurm

    local = os.environ.get("LOCAL_WORLD_SIZE") or env_from_slurm(dict(os.environ)).get("LOCAL_WORLD_SIZE")
    return int(local) if local else world_size


def env_world_size() -> int:
    """The world size this process belongs to: torchrun's WORLD_SIZE, else SLURM's task count, else 1."""
    from loom.parallel.env import env_from_slurm

    world = os.environ.get("WORLD_SIZE") or env_from_slurm(dict(os.environ)).get("WORLD_SIZE") or "1"
    return int(world)


def planned_world_size(launch: Launch, cfg=None) -> int:
    """The world size a start plans for: the launcher's (--nproc-per-node x --nnodes) where it launches workers,
    else this process's. With --nnodes MIN:MAX (and ``cfg``): the most nodes whose world the layout can be formed
    on (the most nodes where none can: its error is the one to show)."""
    if not launch.agent:
        return env_world_size()
    if cfg is not None and launch.elastic:
        from loom.methods import resolve

        for nodes in range(launch.nnodes[1], launch.nnodes[0] - 1, -1):
            try:
                resolve(cfg, nodes * (launch.nproc or 1), device="cpu")  # the world's rules only
                return nodes * (launch.nproc or 1)
            except ConfigError:
                continue
    return launch.world_size


def planned_local(launch: Launch) -> int | None:
    """The ranks a start plans for on this machine: --nproc-per-node where it launches workers."""
    return (launch.nproc or 1) if launch.agent else None


def elastic_note(cfg, launch: Launch) -> str:
    """With --nnodes MIN:MAX, the node counts whose world the layout cannot be formed on (one line), else ''."""
    from loom.methods import resolve

    bad = []
    for nodes in range(launch.nnodes[0], launch.nnodes[1] + 1):
        try:
            resolve(cfg, nodes * (launch.nproc or 1), device="cpu")  # the world's rules only
        except ConfigError as err:
            bad.append(f"{nodes} ({err})")
    if not bad:
        return ""
    return (f"loom: note: with --nnodes {launch.nnodes[0]}:{launch.nnodes[1]}, a job (re-)formed on these node "
            f"counts stops with exit code 2: {'; '.join(bad)}")


@contextlib.contextmanager
def warnings_after_success():
    """Python warnings raised inside (e.g. while importing torch) are held back and shown only when the block
    succeeds, so a user error stays one line."""
    with warnings.catch_warnings(record=True) as held:
        yield
    for w in held:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def checked_config(argv: list[str]):
    """The validated config and the launcher options."""
    with warnings_after_success():
        cfg, launch = load_launch(argv)
        precheck(cfg, planned_world_size(launch, cfg), planned_local(launch))
    return cfg, launch


def run_worker(argv: list[str]) -> None:
    """The body of every worker process (also ``torchrun -m loom.train``)."""
    from loom.train.restarts import record_error

    try:
        _train_worker(argv)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        record_error(err)  # where the elastic agent reads it: the restart record names it
        raise


def _train_worker(argv: list[str]) -> None:
    from loom.methods import method_of, rules_of
    from loom.parallel.env import destroy_distributed
    from loom.train.restarts import check_layout

    cfg, _ = load_config(argv)
    check_layout(cfg, env_world_size())  # a job an elastic agent (re-)formed: a layout its world cannot hold
    chosen = method_of(cfg)  # training.objective's method runs the job (loom.methods)
    chosen.run(cfg, chosen.objective(cfg), rules=rules_of(cfg))
    # Only after success: on an error, peers may sit in a collective and a collective teardown would hang
    # (the launcher stops them). The trainer is gone by now (DDP's reducer holds the group), so the group
    # is really torn down here and not at interpreter exit, where gloo's threads can abort the process.
    gc.collect()
    destroy_distributed()


def launch(argv: list[str], launch: Launch, cfg) -> int:
    """Start this node's workers with torch.distributed.run (elastic agent; one node: a local c10d store,
    several: ``--rdzv-backend`` on ``--rdzv-endpoint``). The agent restarts them up to ``--max-restarts`` times
    (recording each failure: loom.train.restarts) and forwards SIGTERM / SIGINT to them, which agree, save and exit
    0 within checkpoint.preempt_grace_s; the agent waits a little longer than that before it kills them."""
    from torch.distributed.run import get_args_parser, run

    from loom.train.restarts import ELASTIC_ENV, RESTARTS, describe_failures, failure_entries, recording_agent

    nproc = launch.nproc or 1
    if launch.rdzv_backend == "file":
        try:
            from loom.parallel.rendezvous import register_file_rendezvous
        except ImportError:
            raise ConfigError("--rdzv-backend", "file", "needs loom.parallel.rendezvous, not in this loom: allowed "
                              "c10d") from None
        register_file_rendezvous()  # torch's registry knows c10d, etcd and static; this process learns "file"
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # stable restarts on gloo
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
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
            print(f"loom: a worker failed (exit codes {sorted(codes)}); see its message above", file=sys.stderr)
        else:
            log, n = os.path.join(cfg.run.dir, RESTARTS), launch.max_restarts
            used = f"; no restarts left (--max-restarts {n}): see {log}" if n else ""
            print(f"loom: a worker failed: {describe_failures(failure_entries(err.failures, ''))}{used}",
                  file=sys.stderr)
        return code
    return 0


def _after_signal(run_dir: str, sigval, started: float) -> int:
    """The launcher got SIGTERM / SIGINT and its workers have stopped: 0 when they saved (rank 0 wrote
    ``preempted.json`` during this launch), else 1; one line either way."""
    from loom.train.trainer import PREEMPTED

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
    print(f"loom: {name}: the workers stopped before saving a checkpoint (the last complete one stays)",
          file=sys.stderr, flush=True)
    return 1


# ---- help, --print-config, --dry-run --------------------------------------------------

def help_topic(argv: list[str]) -> str | None:
    """None without -h / --help; else '' (the overview) or the SECTION after it (--help SECTION, --help=SECTION)."""
    for i, arg in enumerate(argv):
        name, eq, val = arg.partition("=")
        if name in ("-h", "--help"):
            if eq:
                return val
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if nxt.startswith("-") else nxt
    return None


def help_text(topic: str) -> str:
    """The usage and the list of config sections, or one section's fields (SECTION.FIELD: its section)."""
    from loom.config.reference import section_text, sections_text

    if not topic:
        return f"{USAGE}\n{sections_text()}"
    return section_text(topic.split(".")[0] if "." in topic else topic)


def take_previews(argv: list[str]) -> tuple[set[str], list[str]]:
    """(the previews asked for: 'print-config', 'dry-run'; the other arguments). An option of loom train's own
    misspelt (``--dryrun``) is one line naming the option it resembles."""
    previews, rest = set(), []
    for arg in argv:
        name = arg.partition("=")[0]
        if name in PREVIEWS:
            previews.add(PREVIEWS[name])
            continue
        if name.startswith("--") and "." not in name and name not in LAUNCH_OPTIONS:
            near = difflib.get_close_matches(name.replace("_", "-"), OPTIONS, n=1, cutoff=0.75)
            if near:
                raise ConfigError(name, None, f"unknown option; did you mean '{near[0]}'? (see `loom train --help`)",
                                  show_value=False)
        rest.append(arg)
    return previews, rest


def preview(argv: list[str], previews: set[str]) -> int:
    """--print-config (the config, no checks beyond single fields) and / or --dry-run; nothing is written."""
    if "print-config" in previews:
        sys.stdout.write(to_toml(load_config(argv)[0]))
    if "dry-run" in previews:
        print(dry_run(argv))
    return 0


def dry_run(argv: list[str]) -> str:
    """Every check a start makes, without creating the run dir or its lock; the plan as text."""
    from loom.checkpoint.manager import refuse_fresh_start
    from loom.config.paths import check_folder_writable

    with warnings_after_success():
        cfg, launch = load_launch(argv)
        world = planned_world_size(launch, cfg)
        run = precheck(cfg, world, planned_local(launch))
        for field, path in (("run.dir", cfg.run.dir), ("checkpoint.dir", checkpoint_dir(cfg))):
            check_folder_writable(field, path)  # what check_writable_dirs checks, without creating them
        refuse_fresh_start(cfg.checkpoint, checkpoint_dir(cfg))
        note = elastic_note(cfg, launch) if launch.elastic else ""
        return plan_text(cfg, run, world, planned_local(launch)) + (f"\n{note}" if note else "")


def plan_text(cfg, run, world: int, local: int | None = None) -> str:
    """The layout, the model built on the meta device, memory per device by the planner (loom.plan, as
    check_fits), and the batch of one optimizer step."""
    t, dims, args = cfg.training, run.dims, run.model_args
    params, active = built_params(args)
    what = f"model.init_from {cfg.model.init_from}" if cfg.model.init_from else f"flavor {cfg.model.flavor}"
    moe = (f", {args.moe_experts} experts (top {args.moe_top_k}): {active:,} active per token" if args.moe else "")
    layout = dims.describe() + (f", pp_schedule {cfg.parallel.pp_schedule}" if dims.pp > 1 else "")
    timed = run.device == "cuda" and cfg.model.attention == "auto"
    attention = " (model.attention auto: timed at start)" if timed else ""
    tokens = t.global_batch_size * t.seq_len
    accum = f"{run.accum} accumulation step{'s' if run.accum > 1 else ''}"
    rows = [("layout", layout),
            ("device", f"{run.device}, {t.dtype}; kernels {run.kernels.describe()}{attention}"),
            ("model", f"{what}: {params:,} parameters ({args.n_layers} layers, dim {args.dim}, vocabulary "
                      f"{args.vocab_size:,}{moe}), built on the meta device"),
            ("batch", f"{t.global_batch_size} sequences x {t.seq_len} tokens = {tokens:,} tokens per optimizer step "
                      f"(micro-batch {t.micro_batch_size} x {accum} x {dims.dp_size} data-parallel)"),
            ("training", f"{t.steps:,} steps = {t.steps * tokens:,} tokens"),
            ("memory", memory_text(cfg, run)),
            ("free", room_text(run.device, local or local_ranks(world))),
            ("run dir", f"{cfg.run.dir} (not created)")]
    return "\n".join([f"loom train --dry-run on {world} rank{'s' if world > 1 else ''}: every start-up check "
                      "passed; nothing was started or written"] + [f"  {k + ':':<10} {v}" for k, v in rows])


def built_params(args) -> tuple[int, int]:
    """(parameters of the model built from ``args`` on the meta device, those one token uses: fewer with MoE)."""
    import torch

    from loom.models.registry import build_model
    from loom.parallel.expert_parallel import expert_params

    with torch.device("meta"):
        model = build_model(args)
    total = sum(p.numel() for p in model.parameters())
    if not args.moe:
        return total, total
    experts = sum(p.numel() for p in expert_params([model]))
    return total, total - experts + experts * args.moe_top_k // args.moe_experts


def memory_text(cfg, run) -> str:
    """The busiest rank's need by the planner's estimate (loom.plan, as check_fits reads it)."""
    from loom.plan.planner import rank_needs

    args, t = run.model_args, cfg.training
    # as check_fits: the activation tracer runs MoE blocks in bf16 only and has no FlexAttention
    traced = not ((args.moe and t.dtype != "bfloat16") or args.attention == "flex")
    needs = rank_needs(cfg, run.dims, args, run.device, peak=traced)
    unit = "GPU" if run.device == "cuda" else "rank"
    state = f"weights, gradients and AdamW state {size(needs.state_bytes)}"
    if cfg.parallel.cpu_offload:
        state = f"weights, gradients and AdamW state {size(needs.host_bytes)} on the host (parallel.cpu_offload)"
    if needs.peak_bytes is None:
        return f"{state} per {unit}; activations not estimated (MoE outside bfloat16, or FlexAttention)"
    return (f"~{size(needs.peak_bytes)} per {unit} at a step's peak: {state}, activations "
            f"{size(needs.activation_bytes)} (the planner's estimate for the busiest rank)")


def room_text(device: str, local: int) -> str:
    """What this machine has free for the run's ranks (as check_fits reads it)."""
    from loom.plan.fit import gpu_room, host_room

    room = gpu_room(local, False) if device == "cuda" else host_room()
    if room is None:
        return "unknown"
    shared = f", shared by {local} ranks" if device != "cuda" and local > 1 else ""
    return f"{size(room[0])} ({room[1]}{shared})"


def size(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def main(argv: list[str]) -> int:
    topic = help_topic(argv)
    if topic is not None:
        print(help_text(topic))
        return 0
    previews, argv = take_previews(argv)
    if previews:
        return preview(argv, previews)
    cfg, options = checked_config(argv)
    check_writable_dirs(cfg)  # before anything is built, and held (locked) for the whole run
    if not options.multi_node:
        # one node: this process holds the lock for its workers, across restarts. Several nodes: each runs a
        # `loom train` on the same run dir, so rank 0's worker takes it (the OS frees it when that worker dies)
        acquire(cfg.run.dir)
    from loom.checkpoint.manager import refuse_fresh_start

    refuse_fresh_start(cfg.checkpoint, checkpoint_dir(cfg))
    if options.agent:
        if options.elastic and (note := elastic_note(cfg, options)):
            print(note, file=sys.stderr, flush=True)
        # workers must not launch again: strip the launcher options from what they receive
        _, overrides = parse_launch(argv)
        worker_argv = (["--config", options.config] if options.config else []) + overrides
        return launch(worker_argv, options, cfg)
    run_worker(argv)
    return 0
