"""The run directory: checked writable before anything is built, and locked for the whole run.

The lock is an exclusive ``flock`` on ``<run.dir>/.lock`` held by the process that starts the run (the
launcher, or rank 0): the OS releases it when that process dies, so a crash never leaves a stale lock.
The file names the holder (host, pid, start time) for the error a second run gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from loom.config.errors import ConfigError, UserError
from loom.config.paths import check_folder_writable

LOCK = ".lock"
LOCKED_ENV = "LOOM_RUN_DIR_LOCKED"  # the launcher holds the lock of this (real) path for its workers
_held: dict[str, int] = {}  # real path -> the open lock file of a lock this process holds


def checkpoint_dir(cfg) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.run.dir, "checkpoints")


def check_writable_dirs(cfg) -> None:
    """``run.dir`` and the checkpoint folder can be written (one line each where not), then created."""
    for field, path in (("run.dir", cfg.run.dir), ("checkpoint.dir", checkpoint_dir(cfg))):
        check_folder_writable(field, path)
        os.makedirs(path, exist_ok=True)


def acquire(run_dir: str) -> None:
    """Hold the run dir's lock until this process exits; a no-op where this process or its launcher holds it."""
    real = os.path.realpath(run_dir)
    if real in _held or os.environ.get(LOCKED_ENV) == real:
        return
    path = os.path.join(run_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError("run.dir", run_dir, f"cannot create its lock file {path} ({err.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _read_holder(fd)
        os.close(fd)
        raise UserError(f"run.dir {run_dir} is in use by another run ({holder}): wait for it to end, stop it, or "
                        "use another --run.dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                              "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
    _held[real] = fd


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {info['host']}, pid {info['pid']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def held_env(run_dir: str) -> dict[str, str]:
    """The environment that tells a launcher's workers their run dir is locked already."""
    return {LOCKED_ENV: os.path.realpath(run_dir)}
