"""bench.common.run_train: a job past its limit is killed with every process it started and comes back as that
job's failure, so a benchmark script records it and goes on to its next layout."""

from __future__ import annotations

import os
import stat
import time

from bench import common


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet reaped by its (killed) parent is a zombie: gone for our purpose
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # reaped meanwhile
        return False


def test_a_job_past_its_limit_is_killed_with_its_workers_and_recorded(tmp_path, monkeypatch):
    pidfile = tmp_path / "worker.pid"
    launcher = (
        tmp_path / "python"
    )  # stands in for the interpreter: starts a "worker" and waits, as torchrun does
    launcher.write_text(f"#!/bin/sh\necho started\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(common.sys, "executable", str(launcher))

    proc, cmd, _ = common.run_train({"model.flavor": "debug"}, 2, timeout=2)

    assert proc.returncode == common.TIMED_OUT
    assert "started" in proc.stdout
    assert "TimeoutError: the job ran past 2 s" in proc.stderr
    assert "TimeoutError" in common.failure(proc)
    assert cmd == "loom train --nproc-per-node 2 --model.flavor=debug"
    worker = int(pidfile.read_text())
    for _ in range(100):  # the kill is delivered at once; the kernel may take a moment to finish the process
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)
