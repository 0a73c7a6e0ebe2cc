"""bench.common.run_train: a job past its limit is stopped with every process of its group (SIGTERM, then SIGKILL
for one that ignores it) and comes back as that job's failure, so a benchmark script records it and goes on to
its next layout. bench.common.command: the command a result records, as typed."""

from __future__ import annotations

import os
import stat
import sys
import time

import pytest

from bench import common


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a killed child not yet reaped by its (killed) parent is a zombie: gone for our purpose
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # reaped meanwhile
        return False


def _gone(pid: int) -> bool:
    for _ in range(200):  # the signal is delivered at once; the kernel may take a moment to end the process
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("ignores_term", [False, True], ids=["stops-on-term", "killed"])
def test_a_job_past_its_limit_is_stopped_with_its_workers_and_recorded(tmp_path, monkeypatch, ignores_term):
    pidfile = tmp_path / "worker.pid"
    launcher = (
        tmp_path / "python"
    )  # stands in for the interpreter: starts a "worker" and waits, as torchrun does
    trap = (
        "trap '' TERM\n" if ignores_term else ""
    )  # a launcher that ignores SIGTERM gets SIGKILL after the grace
    launcher.write_text(f"#!/bin/sh\n{trap}sleep 300 &\necho $! > {pidfile}\necho started\nwait\nwait\n")
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(common.sys, "executable", str(launcher))
    monkeypatch.setattr(common, "KILL_GRACE_S", 1)

    proc, cmd, _ = common.run_train({"model.flavor": "debug"}, 2, timeout=3)

    assert proc.returncode == common.TIMED_OUT
    assert "started" in proc.stdout  # what it printed before it was stopped is kept
    assert "TimeoutError: the job ran past 3 s" in proc.stderr
    assert "TimeoutError" in common.failure(proc)
    assert cmd == "loom train --nproc-per-node 2 --model.flavor=debug"
    assert _gone(int(pidfile.read_text()))


def test_command_names_the_module_as_typed(monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setattr(sys, "argv", [os.path.join(root, "bench", "diag", "floor.py"), "--peer", "a b"])
    assert common.command() == "python -m bench.diag.floor --peer 'a b'"
    monkeypatch.setattr(sys, "argv", [os.path.join(root, "bench", "train_1b.py"), "--steps", "3"])
    assert common.command() == "python -m bench.train_1b --steps 3"
