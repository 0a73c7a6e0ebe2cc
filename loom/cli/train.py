"""``loom train``: one process, or N local workers through PyTorch's elastic launcher."""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
import os
import sys
import time
import warnings

from loom.config import ConfigError, build_config, parse_overrides, to_toml
from loom.train.run_dir import acquire, check_writable_dirs, checkpoint_dir, held_env

USAGE = """usage: loom train [--config FILE.toml] [--nproc-per-node N] [--section.field VALUE ...]
                  [--print-config] [--dry-run]
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
"""

# loom train's own options: a misspelt one is named as such, not as an unknown config key
OPTIONS = ("--config", "--nproc-per-node", "--print-config", "--dry-run", "--help")
PREVIEWS = {"--print-config": "print-config", "--print_config": "print-config", "--dry-run": "dry-run",
            "--dry_run": "dry-run"}


def split_launcher_args(argv: list[str]) -> tuple[str | None, int | None, list[str]]:
    """Pull --config and --nproc-per-node out; the rest are --section.field overrides."""
    config, nproc, rest = None, None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, val = arg.partition("=")
        if name in ("--config", "-c", "--nproc-per-node", "--nproc_per_node"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(name, None, "missing value after the option", show_value=False)
                val, i = argv[i + 1], i + 1
            if name.startswith("--nproc"):
                try:
                    nproc = int(val)
                except ValueError:
                    raise ConfigError("--nproc-per-node", val, "expected a positive integer") from None
                if nproc < 1:
                    raise ConfigError("--nproc-per-node", nproc, "expected a positive integer")
            else:
                config = val
        else:
            rest.append(arg)
        i += 1
    return config, nproc, rest


def load_config(argv: list[str]):
    config, nproc, rest = split_launcher_args(argv)
    return build_config(config, parse_overrides(rest)), nproc


def precheck(cfg, world_size: int):
    """Errors that need the world size, the tokenizer, the data, the device or this machine's free memory, found
    once, before any worker starts. Returns the resolved run (loom.resolve.Run, with its model)."""
    from loom.resolve import check_device, resolve

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
    check_fits(cfg, run.dims, run.model_args, run.device, local_ranks(world_size))
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


def planned_world_size(nproc: int | None) -> int:
    """The world size a start plans for: --nproc-per-node where it launches workers, else this process's."""
    return nproc if nproc and nproc > 1 else env_world_size()


@contextlib.contextmanager
def warnings_after_success():
    """Python warnings raised inside (e.g. while importing torch) are held back and shown only when the block
    succeeds, so a user error stays one line."""
    with warnings.catch_warnings(record=True) as held:
        yield
    for w in held:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def checked_config(argv: list[str]):
    """The validated config and --nproc-per-node."""
    with warnings_after_success():
        cfg, nproc = load_config(argv)
        precheck(cfg, planned_world_size(nproc))
    return cfg, nproc


def run_worker(argv: list[str]) -> None:
    """The body of every worker process (also ``torchrun -m loom.train``)."""
    from loom.train.trainer import Trainer
    from loom.parallel.env import destroy_distributed

    cfg, _ = load_config(argv)
    objective = None
    if cfg.training.objective == "grpo":  # loom.rl sits above loom.train: the objective is handed in
        from loom.rl.objective import GroupRelative

        objective = GroupRelative(cfg)
    elif cfg.training.objective == "ppo":
        from loom.rl.ppo_objective import ProximalPolicy

        objective = ProximalPolicy(cfg)
    Trainer(cfg, objective=objective).fit()
    # Only after success: on an error, peers may sit in a collective and a collective teardown would hang
    # (the launcher stops them). The trainer is gone by now (DDP's reducer holds the group), so the group
    # is really torn down here and not at interpreter exit, where gloo's threads can abort the process.
    gc.collect()
    destroy_distributed()


def launch(argv: list[str], nproc: int, cfg) -> int:
    """Start ``nproc`` local workers with torch.distributed.run (elastic agent, c10d rendezvous). The agent
    forwards SIGTERM / SIGINT to the workers, which agree, save and exit 0 within checkpoint.preempt_grace_s;
    the agent waits a little longer than that before it kills them."""
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # stable restarts on gloo
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(cfg.checkpoint.preempt_grace_s) + 10))
    os.environ.update(held_env(cfg.run.dir))  # this process holds the run dir's lock for its workers
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "loom.train", *argv])
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    started = time.time()
    try:
        run(args)
    except SignalException as err:
        return _after_signal(cfg.run.dir, err.sigval, started)
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        # the agent stops the other workers (negative codes: killed by a signal) once one has failed
        code = 2 if {c for c in codes if c >= 0} == {2} else 1
        print(f"loom: a worker failed (exit codes {sorted(codes)}); see its message above", file=sys.stderr)
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
        if name.startswith("--") and "." not in name and name not in ("--config", "--nproc-per-node",
                                                                       "--nproc_per_node"):
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
        cfg, nproc = load_config(argv)
        world = planned_world_size(nproc)
        run = precheck(cfg, world)
        for field, path in (("run.dir", cfg.run.dir), ("checkpoint.dir", checkpoint_dir(cfg))):
            check_folder_writable(field, path)  # what check_writable_dirs checks, without creating them
        refuse_fresh_start(cfg.checkpoint, checkpoint_dir(cfg))
        return plan_text(cfg, run, world)


def plan_text(cfg, run, world: int) -> str:
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
            ("free", room_text(run.device, local_ranks(world))),
            ("run dir", f"{cfg.run.dir} (not created)")]
    return "\n".join([f"loom train --dry-run on {world} rank{'s' if world > 1 else ''}: every start-up check "
                      "passed; nothing was started or written"] + [f"  {k + ':':<10} {v}" for k, v in rows])


def built_params(args) -> tuple[int, int]:
    """(parameters of the model built from ``args`` on the meta device, those one token uses: fewer with MoE)."""
    import torch

    from loom.models.llama import Llama
    from loom.parallel.expert_parallel import expert_params

    with torch.device("meta"):
        model = Llama(args)
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
    if cfg.parallel.cpu_offload and run.dims.fsdp_enabled:
        state = "weights, gradients and AdamW state on the host (parallel.cpu_offload)"
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
    cfg, nproc = checked_config(argv)
    check_writable_dirs(cfg)  # before anything is built, and held (locked) for the whole run
    acquire(cfg.run.dir)
    from loom.checkpoint.manager import refuse_fresh_start

    refuse_fresh_start(cfg.checkpoint, checkpoint_dir(cfg))
    if nproc and nproc > 1:
        # workers must not launch again: strip --nproc-per-node from what they receive
        config, _, overrides = split_launcher_args(argv)
        worker_argv = (["--config", config] if config else []) + overrides
        return launch(worker_argv, nproc, cfg)
    run_worker(argv)
    return 0
