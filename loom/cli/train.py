"""``loom train``: one process, or N local workers through PyTorch's elastic launcher."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import warnings

from loom.config import ConfigError, build_config, parse_overrides
from loom.train.run_dir import acquire, check_writable_dirs, checkpoint_dir, held_env

USAGE = """usage: loom train [--config FILE.toml] [--nproc-per-node N] [--section.field VALUE ...]

Trains with defaults < FILE < overrides. Without --config and --data.source it trains the
`debug` model on this Python's standard-library sources (nothing is downloaded)."""


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


def precheck(cfg, world_size: int) -> None:
    """Errors that need the world size, the tokenizer, the data, the device or this machine's free memory, found
    once, before any worker starts."""
    from loom.parallel.env import env_from_slurm
    from loom.resolve import check_device, resolve

    run = resolve(cfg, world_size)  # the rules relating fields and the world size (the model's come below)
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
    local = os.environ.get("LOCAL_WORLD_SIZE") or env_from_slurm(dict(os.environ)).get("LOCAL_WORLD_SIZE")
    check_fits(cfg, run.dims, run.model_args, run.device, int(local) if local else world_size)


def env_world_size() -> int:
    """The world size this process belongs to: torchrun's WORLD_SIZE, else SLURM's task count, else 1."""
    from loom.parallel.env import env_from_slurm

    world = os.environ.get("WORLD_SIZE") or env_from_slurm(dict(os.environ)).get("WORLD_SIZE") or "1"
    return int(world)


def checked_config(argv: list[str]):
    """The validated config and --nproc-per-node. Python warnings raised meanwhile (e.g. while importing
    torch) are held back and shown only when everything is valid, so a user error stays one line."""
    with warnings.catch_warnings(record=True) as held:
        cfg, nproc = load_config(argv)
        precheck(cfg, nproc if nproc and nproc > 1 else env_world_size())
    for w in held:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
    return cfg, nproc


def run_worker(argv: list[str]) -> None:
    """The body of every worker process (also ``torchrun -m loom.train``)."""
    from loom.train.trainer import Trainer
    from loom.parallel.env import destroy_distributed

    cfg, _ = load_config(argv)
    Trainer(cfg).fit()
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


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
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
