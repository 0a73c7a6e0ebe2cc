"""Kill points inside a running trainer, and killing a whole run at once (standard library only: this is
imported at interpreter start by ``autoload/sitecustomize.py`` in the trainer, the launcher and its workers).

``LOOM_FAULT = "<point>:<n>"`` SIGKILLs the run at the n-th time this process reaches ``point``:

    shard         a rank is about to fsync a DCP shard it has just written (no .metadata yet)
    marker        COMPLETE.json is written as .partial, not yet renamed into place
    rename        the finished .step_N.tmp folder, marker inside, is about to be renamed to step_N
    renamed       just after that rename: the checkpoint exists, retention has not run
    deleting      retention (or a replaced folder of the same step) has just renamed step_N to .step_N.deleting
    rmtree        the first file of a .step_N.deleting folder has just been removed (by retention, or by the
                  next start clearing a kill's leftover)
    cache_commit  the token cache file has just been renamed into place, its description not yet written
    dpo_reference DPO's cached reference is written to its temporary file, not yet fsynced or renamed into place

A launched worker kills the launcher and every other worker with itself (stopped first, so none of them
reacts): a lost machine, not a preemption. The workers of ``--nproc-per-node`` run in sessions of their own
(torch's elastic agent starts them with ``start_new_session``), so a process-group kill of the launcher
would not reach them.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

POINTS = ("shard", "marker", "rename", "renamed", "deleting", "rmtree", "cache_commit", "dpo_reference")


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first, then theirs)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            names = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in names:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as fh:
                    kids = [int(p) for p in fh.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def kill_tree(root: int, spare: int | None = None) -> list[int]:
    """SIGSTOP ``root`` and its descendants, then SIGKILL them all (``spare`` is left to the caller);
    returns the pids signalled."""
    victims = [p for p in [root, *descendants(root)] if p != spare]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in victims:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return victims


def kill_run(point: str) -> None:
    print(f"loom-fault: SIGKILL at {point} (pid {os.getpid()})", file=sys.stderr, flush=True)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a launched worker: the launcher and every sibling go too
        kill_tree(os.getppid(), spare=os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never returns: the signal is delivered at once


def install(spec: str) -> None:
    """Arm ``"<point>:<n>"`` in this process by wrapping the os / shutil calls that mark each point."""
    point, _, n = spec.partition(":")
    if point not in POINTS or not n.isdecimal() or int(n) < 1:
        raise ValueError(f"LOOM_FAULT={spec!r}: expected <point>:<n> with point one of {', '.join(POINTS)}")
    target, seen = int(n), {"count": 0, "rmtree": False}

    def hit(name: str) -> None:
        if name == point:
            seen["count"] += 1
            if seen["count"] == target:
                kill_run(f"{point} #{target}")

    fsync, replace, unlink, rmtree = os.fsync, os.replace, os.unlink, shutil.rmtree

    def fsync_(fd):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if path.endswith(".distcp"):
            hit("shard")
        if os.path.basename(path).startswith("reference-") and path.endswith(".pt.tmp"):
            hit("dpo_reference")
        return fsync(fd)

    def replace_(src, dst, *args, **kwargs):
        name, target_name = os.path.basename(str(src)), os.path.basename(str(dst))
        if name == "COMPLETE.json.partial":
            hit("marker")
        step_tmp = name.startswith(".step_") and name.endswith(".tmp")
        if step_tmp:
            hit("rename")
        replace(src, dst, *args, **kwargs)
        if step_tmp:
            hit("renamed")
        if target_name.endswith(".deleting"):
            hit("deleting")
        if ".loom-tmp-" in name and target_name.endswith(".bin"):
            hit("cache_commit")

    def rmtree_(path, *args, **kwargs):
        seen["rmtree"] = str(path).endswith(".deleting")
        try:
            return rmtree(path, *args, **kwargs)
        finally:
            seen["rmtree"] = False

    def unlink_(*args, **kwargs):
        unlink(*args, **kwargs)
        if seen["rmtree"]:
            seen["rmtree"] = False  # once per folder
            hit("rmtree")

    os.fsync, os.replace, os.unlink, shutil.rmtree = fsync_, replace_, unlink_, rmtree_
