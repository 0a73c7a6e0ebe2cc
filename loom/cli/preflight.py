"""What ``loom train`` checks before any worker starts (and a worker, in a job an elastic agent re-formed): the
config, the world it plans for, the data, the tokenizer, the device and this machine's free memory. ``--dry-run``
runs every check and prints the plan."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

from loom.config import ConfigError, build_config, parse_overrides
from loom.config.errors import SharedError
from loom.runtime.launch import Launch, env_world_size, local_ranks, parse_launch
from loom.runtime.restarts import ELASTIC_ENV
from loom.train.run_dir import checkpoint_dir


def load_config(argv: list[str]):
    """(the config, --nproc-per-node)."""
    cfg, launch = load_launch(argv)
    return cfg, launch.nproc


def load_launch(argv: list[str]):
    """(the config, the launcher options)."""
    launch, rest = parse_launch(argv)
    return build_config(launch.config, parse_overrides(rest)), launch


def precheck(cfg, world_size: int, local: int | None = None, run=None):
    """Errors that need the world size, the tokenizer, the data, the device or this machine's free memory, found
    once, before any worker starts (``local``: the ranks on this machine; default ``local_ranks``; ``run``: the
    config already resolved for ``world_size``, else resolved here). Returns the resolved run (loom.resolve.Run,
    with its model)."""
    from loom.methods import resolve  # the resolver with the chosen method's rules
    from loom.resolve import check_device

    if run is None:  # the rules relating fields and the world size (the model's come below)
        run = resolve(cfg, world_size)
    from loom.metrics.logger import check_trackers

    check_trackers(
        cfg.metrics
    )  # metrics.wandb / mlflow without the package: one line before any worker starts
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
        from loom.checkpoint.hf.reader import check_weights

        check_weights(cfg.model.init_from)  # a truncated download, before any model is built
    # a checkpoint this config cannot continue (model shape, data, ...): refused here
    check_before_start(cfg, tokenizer, run.kernels, run.model_args)
    if note := check_fits(cfg, run.dims, run.model_args, run.device, local or local_ranks(world_size)):
        print(note, file=sys.stderr, flush=True)
    return run


def planned_worlds(cfg, launch: Launch) -> tuple[int, dict]:
    """(the world size a start plans for, each world the job may form on resolved once: its run, or the
    ConfigError that refuses the layout there). The world: the launcher's (--nproc-per-node x --nnodes) where it
    launches workers, else this process's. With --nnodes MIN:MAX every node count's world is resolved (an elastic
    job may re-form on any of them; its workers read that world's entry) and the plan is the most nodes whose
    world the layout can be formed on (the most nodes where none can: its error is the one to show)."""
    from loom.methods import resolve  # the resolver with the chosen method's rules

    if not launch.agent:
        worlds = [env_world_size()]
    elif launch.elastic:
        worlds = [nodes * (launch.nproc or 1) for nodes in range(launch.nnodes[0], launch.nnodes[1] + 1)]
    else:
        worlds = [launch.world_size]
    runs = {}
    for world in worlds:
        try:
            runs[world] = resolve(cfg, world)
        except ConfigError as err:
            runs[world] = err
    formed = [w for w in worlds if not isinstance(runs[w], ConfigError)]
    return max(formed or worlds), runs


def planned_local(launch: Launch) -> int | None:
    """The ranks a start plans for on this machine: --nproc-per-node where it launches workers."""
    return (launch.nproc or 1) if launch.agent else None


def elastic_note(launch: Launch, resolved) -> str:
    """With --nnodes MIN:MAX, the node counts whose world the layout cannot be formed on (one line), else ''."""
    nproc = launch.nproc or 1
    bad = [
        f"{world // nproc} ({run})" for world, run in sorted(resolved.runs.items()) if isinstance(run, str)
    ]
    if not bad:
        return ""
    return (
        f"loom: note: with --nnodes {launch.nnodes[0]}:{launch.nnodes[1]}, a job (re-)formed on these node "
        f"counts stops with exit code 2: {'; '.join(bad)}"
    )


def check_layout(cfg, world_size: int, environ=None):
    """The resolved run a worker on ``world_size`` ranks builds, as loom.resolve.Resolved to hand its engine, or
    None where the engine reads its launcher's hand-off (loom.resolve.handed) or resolves itself (a plain job).
    In a job that an elastic agent formed (or re-formed) on ``world_size`` ranks, a layout that cannot be built
    there is one line from rank 0 (exit code 2 on every rank), naming the world the job formed with. Resolved
    here only where no launcher handed this world (``torchrun`` started the job), once: the engine is handed it."""
    from loom.methods import check_config, resolve  # with the chosen method's rules
    from loom.resolve import Resolved, Run, check_machine, handed, run_device

    env = os.environ if environ is None else environ
    got = handed(cfg, world_size)
    if isinstance(got, Run):
        return None  # the launcher resolved this world: the engine reads the same hand-off
    if got is None:
        if not env.get("TORCHELASTIC_RUN_ID") or not (
            int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) or env.get(ELASTIC_ENV)
        ):
            return None  # not under an agent that restarts: the engine resolves, once
        check_config(cfg)  # the rules over the config alone: not the world's doing
        try:  # the rules relating the config to the world size
            run = resolve(cfg, world_size, device=run_device(cfg))
        except ConfigError as err:
            got = str(err)
        else:
            check_machine(cfg, run.device)  # what the machine lacks: not the world's doing either
            return Resolved(cfg, {world_size: run})
    nodes, local = env.get("GROUP_WORLD_SIZE"), env.get("LOCAL_WORLD_SIZE")
    formed = f"{nodes} node(s) x {local} = {world_size} ranks" if nodes and local else f"{world_size} ranks"
    raise SharedError(
        f"{got} (the job formed with {formed}; an elastic job needs a layout every node count "
        "allows: see docs/operations.md, Restarts and elastic node counts)"
    )


@contextlib.contextmanager
def warnings_after_success():
    """Python warnings raised inside (e.g. while importing torch) are held back and shown only when the block
    succeeds, so a user error stays one line."""
    with warnings.catch_warnings(record=True) as held:
        yield
    for w in held:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def preflight(argv: list[str]):
    """(the validated config, the launcher options, the world planned for, its resolved run, what the workers
    are handed: loom.resolve.Resolved). The config is resolved here once per world the job may form on."""
    from loom.resolve import Resolved

    with warnings_after_success():
        cfg, launch = load_launch(argv)
        world, runs = planned_worlds(cfg, launch)
        if isinstance(runs[world], ConfigError):
            raise runs[world]
        run = precheck(cfg, world, planned_local(launch), runs[world])
    handed = {
        w: run if w == world else (str(r) if isinstance(r, ConfigError) else r) for w, r in runs.items()
    }
    return cfg, launch, world, run, Resolved(cfg, handed)


def checked_config(argv: list[str]):
    """The validated config and the launcher options."""
    cfg, launch, *_ = preflight(argv)
    return cfg, launch


def dry_run(argv: list[str]) -> str:
    """Every check a start makes, without creating the run dir or its lock; the plan as text."""
    from loom.checkpoint.manager import refuse_fresh_start
    from loom.config.paths import check_folder_writable

    cfg, launch, world, run, resolved = preflight(argv)
    with warnings_after_success():
        for field, path in (("run.dir", cfg.run.dir), ("checkpoint.dir", checkpoint_dir(cfg))):
            check_folder_writable(field, path)  # what check_writable_dirs checks, without creating them
        refuse_fresh_start(cfg.checkpoint, checkpoint_dir(cfg))
        note = elastic_note(launch, resolved) if launch.elastic else ""
        return plan_text(cfg, run, world, planned_local(launch)) + (f"\n{note}" if note else "")


def plan_text(cfg, run, world: int, local: int | None = None) -> str:
    """The layout, the model built on the meta device, memory per device by the planner (loom.plan, as
    check_fits), and the batch of one optimizer step."""
    t, dims, args = cfg.training, run.dims, run.model_args
    params, active = built_params(args)
    what = f"model.init_from {cfg.model.init_from}" if cfg.model.init_from else f"flavor {cfg.model.flavor}"
    moe = (
        f", {args.moe_experts} experts (top {args.moe_top_k}): {active:,} active per token"
        if args.moe
        else ""
    )
    layout = dims.describe() + (f", pp_schedule {cfg.parallel.pp_schedule}" if dims.pp > 1 else "")
    timed = run.device == "cuda" and cfg.model.attention == "auto"
    attention = " (model.attention auto: timed at start)" if timed else ""
    tokens = t.global_batch_size * t.seq_len
    accum = f"{run.accum} accumulation step{'s' if run.accum > 1 else ''}"
    rows = [
        ("layout", layout),
        ("device", f"{run.device}, {t.dtype}; kernels {run.kernels.describe()}{attention}"),
        (
            "model",
            f"{what}: {params:,} parameters ({args.n_layers} layers, dim {args.dim}, vocabulary "
            f"{args.vocab_size:,}{moe}), built on the meta device",
        ),
        (
            "batch",
            f"{t.global_batch_size} sequences x {t.seq_len} tokens = {tokens:,} tokens per optimizer step "
            f"(micro-batch {t.micro_batch_size} x {accum} x {dims.dp_size} data-parallel)",
        ),
        ("training", f"{t.steps:,} steps = {t.steps * tokens:,} tokens"),
        ("memory", memory_text(cfg, run)),
        ("free", room_text(run.device, local or local_ranks(world))),
        ("run dir", f"{cfg.run.dir} (not created)"),
    ]
    return "\n".join(
        [
            f"loom train --dry-run on {world} rank{'s' if world > 1 else ''}: every start-up check "
            "passed; nothing was started or written"
        ]
        + [f"  {k + ':':<10} {v}" for k, v in rows]
    )


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
    # as check_fits: fp32 MoE's traces are left to loom plan, and the tracer has no FlexAttention
    traced = not ((args.moe and t.dtype != "bfloat16") or args.attention == "flex")
    needs = rank_needs(cfg, run.dims, args, run.device, peak=traced)
    unit = "GPU" if run.device == "cuda" else "rank"
    state = f"weights, gradients and AdamW state {size(needs.state_bytes)}"
    if cfg.parallel.cpu_offload:
        state = (
            f"weights, gradients and AdamW state {size(needs.host_bytes)} on the host (parallel.cpu_offload)"
        )
    if needs.peak_bytes is None:
        return f"{state} per {unit}; activations not estimated (MoE outside bfloat16, or FlexAttention)"
    return (
        f"~{size(needs.peak_bytes)} per {unit} at a step's peak: {state}, activations "
        f"{size(needs.activation_bytes)} (the planner's estimate for the busiest rank)"
    )


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
