"""The run dir's lock: an exclusive ``flock`` on ``<run.dir>/.lock`` held by the process that starts the run (the
launcher, or rank 0): the OS releases it when that process dies, so a crash never leaves a stale lock.
The file names the holder (host, pid, start time) for the error a second run gets. A launcher's workers hold
``.lock.workers`` shared while they live, and taking the lock also needs that one free: workers that outlive a
launcher killed with SIGKILL keep the run dir locked until the last one exits.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from loom.config.errors import ConfigError, UserError

LOCK = ".lock"
LOCKED_ENV = "LOOM_RUN_DIR_LOCKED"  # the launcher holds the lock of this (real) path for its workers
WORKERS_LOCK = ".lock.workers"  # held shared by every launched worker while it lives
_held: dict = {}  # real path (or ("workers", real path)) -> the open lock file of a lock this process holds


def acquire(run_dir: str) -> None:
    """Hold the run dir's lock until this process exits; a no-op where this process or its launcher holds it."""
    real = os.path.realpath(run_dir)
    if real in _held or os.environ.get(LOCKED_ENV) == real:
        return
    path = os.path.join(run_dir, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ConfigError(
            "run.dir", run_dir, f"cannot create its lock file {path} ({err.strerror})"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _read_holder(fd)
        os.close(fd)
        raise UserError(
            f"run.dir {run_dir} is in use by another run ({holder}): wait for it to end, stop it, or "
            "use another --run.dir"
        ) from None
    if workers_alive(run_dir):
        holder = _read_holder(fd)
        os.close(fd)
        raise UserError(
            f"run.dir {run_dir} is in use: workers of an earlier run are still running (their launcher, "
            f"{holder}, has exited; they stop at their next step): wait for them to end, or use another "
            "--run.dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(
        fd,
        json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        ).encode(),
        0,
    )
    _held[real] = fd


def workers_alive(run_dir: str) -> bool:
    """Whether a launched run's workers still hold ``WORKERS_LOCK`` (shared): they may outlive a launcher killed with
    SIGKILL by a few steps, and a new run must not start beside them."""
    path = os.path.join(run_dir, WORKERS_LOCK)
    if not os.path.exists(path):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock
    return False


def hold_as_worker(run_dir: str) -> None:
    """A launched worker (its launcher holds the run dir's lock): hold ``WORKERS_LOCK`` shared until this process
    exits, so the run dir stays locked while any worker lives, even after its launcher died."""
    real = os.path.realpath(run_dir)
    if os.environ.get(LOCKED_ENV) != real or ("workers", real) in _held:
        return
    try:
        fd = os.open(os.path.join(run_dir, WORKERS_LOCK), os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return  # the writability check names the folder
    for _ in range(100):  # another run's probe holds it for an instant
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except OSError:
            time.sleep(0.01)
    _held[("workers", real)] = fd


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {info['host']}, pid {info['pid']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def held_env(run_dir: str) -> dict[str, str]:
    """The environment that tells a launcher's workers their run dir is locked already."""
    return {LOCKED_ENV: os.path.realpath(run_dir)}
