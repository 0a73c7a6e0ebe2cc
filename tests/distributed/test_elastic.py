"""Several nodes on one machine: two ``loom train`` agents (one worker each) meet through c10d rendezvous on
127.0.0.1 and train one job.

* ``--nnodes 1:2``: one agent and its worker are SIGKILLed mid-run (a lost node); the other's worker fails on its
  lost peer, its agent re-forms the job alone, and it resumes from the newest complete checkpoint on 1 rank
  (dp_shard -1 re-derived: FSDP over 2 becomes one rank, accumulation 2 becomes 4) and ends with the losses of an
  uninterrupted run.
* ``--nnodes 1:2`` with a layout one node cannot hold (``dp_shard 2``): the survivor stops with one line, exit 2.
* ``--nnodes 2``: the two agents form one job, train, checkpoint, lose a worker, restart together and resume.
* ``--nnodes 1:2``, the second node joining mid-run: the job re-forms on 2 ranks from the step it saved.
* ``--rdzv-backend file``: the same job meets through a file instead of a port.

The first runs by default; the rest are marked ``exhaustive``."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from loom.runtime import restarts
from tests.distributed.harness import rendezvous_store
from tests.distributed.test_restarts import BIN, STEPS, cache, cli_args, fault_env, records_of, reference  # noqa: F401 (fixtures)

# quick re-forming on one machine: a lost agent is noticed after 3 missed heartbeats of 2 s, and a round waits
# 5 s for more nodes once it has the fewest it needs
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=2,keep_alive_max_attempt=3,join_timeout=120"


def agents(
    tmp_path,
    nnodes: str,
    run_dir,
    cache,
    *,
    faults=(None, None),
    fault_rank: str = "*",
    backend: str = "c10d",
    extra=(),
    max_restarts: int = 1,
) -> list[subprocess.CompletedProcess]:
    """Two agents of one job, meeting at a rendezvous store this test serves (both join it as clients); node 1
    starts first and node 0 once node 1 has loaded torch, so that both join the first round, within its 5 s last
    call, however slowly the machine starts processes. ``faults``: each node's
    LOOM_RESTART_FAULT, armed in its worker of global rank ``fault_rank`` (``*``: any)."""
    store = rendezvous_store()
    endpoint = f"127.0.0.1:{store.port}" if backend == "c10d" else str(tmp_path / "rdzv")
    procs = {}
    for node in (1, 0):
        cmd = [
            os.path.join(BIN, "loom"),
            "train",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--max-restarts",
            str(max_restarts),
            "--rdzv-backend",
            backend,
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            "elastic",
            "--rdzv-conf",
            RDZV_CONF,
            *cli_args(run_dir, cache, **dict(extra)),
        ]
        log = {k: open(tmp_path / f"node{node}.{k}", "w+") for k in ("out", "err")}
        procs[node] = (
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env=fault_env(faults[node], fault_rank),
                stdout=log["out"],
                stderr=log["err"],
                text=True,
            ),
            log,
        )
        if node == 1:
            wait_for_torch(procs[1][0])
    out = []
    for node in (0, 1):
        proc, log = procs[node]
        rc = proc.wait(timeout=600)
        log["out"].seek(0), log["err"].seek(0)
        out.append(subprocess.CompletedProcess(proc.args, rc, log["out"].read(), log["err"].read()))
    return out


def wait_for_torch(proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``proc`` has loaded libtorch (its memory map shows it), with a deadline; a process that ended fails."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"node 1 ended early with exit {proc.returncode}"
        try:
            with open(f"/proc/{proc.pid}/maps") as fh:
                if "libtorch" in fh.read():
                    return
        except OSError:  # not Linux, or the process is being replaced: try again
            pass
        assert time.monotonic() < deadline, f"node 1 did not load torch in {timeout} s"
        time.sleep(0.05)


def check_losses(run_dir, reference):
    recs = records_of(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    got = [r["loss"] for r in recs]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, reference)) < 1e-5, (got, reference)


def test_a_lost_node_leaves_the_other_to_finish_alone(tmp_path, cache, reference):
    run_dir = tmp_path / "run"
    survivor, lost = agents(tmp_path, "1:2", run_dir, cache, faults=(None, "step:4:node"))
    assert lost.returncode < 0 or lost.returncode == 137, lost.stderr[-2000:]  # SIGKILLed with its worker
    assert survivor.returncode == 0, survivor.stderr[-4000:]
    check_losses(run_dir, reference)
    last = restarts.read(run_dir)[-1]
    assert last["event"] == "restart" and last["world_size"] == 1 and last["previous_world_size"] == 2, last
    assert last["step"] == 2 and "a peer was lost" in last["cause"], last
    assert "layout: single (world 1), accumulation 4" in survivor.stdout
    lines = [line for line in survivor.stdout.splitlines() if line.startswith("loom: restart")]
    assert lines and "on 1 rank (was 2: re-formed)" in lines[-1], survivor.stdout
    assert records_of(run_dir)[-1]["restarts"] == last["restart"]


@pytest.mark.exhaustive
def test_a_layout_the_smaller_job_cannot_hold_stops_with_one_line(tmp_path, cache):
    run_dir = tmp_path / "run"
    survivor, lost = agents(
        tmp_path, "1:2", run_dir, cache, faults=(None, "step:4:node"), extra={"parallel.dp_shard": 2}
    )
    assert survivor.returncode == 2, survivor.stderr[-4000:]
    assert (
        "with --nnodes 1:2, a job (re-)formed on these node counts stops with exit code 2: 1 ("
        in survivor.stderr
    )
    errors = [line for line in survivor.stderr.splitlines() if line.startswith("loom: error:")]
    assert (
        len(errors) == 1
        and "parallel.dp_shard = 2" in errors[0]
        and "the job formed with 1 node(s) x 1 = 1 ranks" in errors[0]
    ), survivor.stderr[-4000:]
    assert restarts.read(run_dir)[-1]["restarting"] is False


@pytest.mark.exhaustive
def test_two_nodes_train_checkpoint_and_resume_after_a_lost_worker(tmp_path, cache, reference):
    """--nnodes 2: rank 1's worker (not its agent) dies at step 4; both agents restart their workers, the job
    re-forms on 2 nodes and resumes from step 2."""
    run_dir = tmp_path / "run"
    first, second = agents(tmp_path, "2", run_dir, cache, faults=("step:4", "step:4"), fault_rank="1")
    for a in (first, second):
        assert a.returncode == 0, a.stderr[-4000:]
    check_losses(run_dir, reference)
    log = restarts.read(run_dir)
    assert [r["world_size"] for r in log if r["event"] in ("start", "restart")] == [2, 2], log
    assert log[-1]["step"] == 2 and "was killed by SIGKILL" in log[-1]["cause"], log[-1]
    assert "FSDP (world 2: dp_shard=2)" in first.stdout + second.stdout


@pytest.mark.exhaustive
def test_a_node_that_joins_later_makes_the_job_re_form(tmp_path, cache, reference):
    """--nnodes 1:2: node 0 trains alone (slowly); node 1 joins mid-run. The agent stops the worker with SIGTERM,
    which saves like a preemption, and the job resumes from that step on 2 ranks with the same losses."""
    run_dir = tmp_path / "run"
    store = rendezvous_store()
    endpoint = f"127.0.0.1:{store.port}"
    cmd = [
        os.path.join(BIN, "loom"),
        "train",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "join",
        "--rdzv-conf",
        RDZV_CONF,
        *cli_args(run_dir, cache),
    ]
    logs = {n: (open(tmp_path / f"node{n}.out", "w+"), open(tmp_path / f"node{n}.err", "w+")) for n in (0, 1)}
    first = subprocess.Popen(
        [*cmd, "--node-rank", "0"],
        cwd=tmp_path,
        env=fault_env("slow:8", "*"),
        stdout=logs[0][0],
        stderr=logs[0][1],
        text=True,
    )
    deadline = time.monotonic() + 300
    while "step 1/" not in (tmp_path / "node0.out").read_text():
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "node0.err").read_text()[
            -3000:
        ]
        time.sleep(0.5)
    second = subprocess.Popen(
        [*cmd, "--node-rank", "1"],
        cwd=tmp_path,
        env=fault_env("slow:8", "*"),
        stdout=logs[1][0],
        stderr=logs[1][1],
        text=True,
    )
    for n, proc in ((0, first), (1, second)):
        assert proc.wait(timeout=600) == 0, (tmp_path / f"node{n}.err").read_text()[-3000:]
    check_losses(run_dir, reference)
    log = restarts.read(run_dir)
    assert "membership" in [r["event"] for r in log], log
    starts = [r for r in log if r["event"] in ("start", "restart")]
    assert [r["world_size"] for r in starts] == [1, 2] and starts[-1]["step"] > 0, starts
    assert starts[-1]["cause"].startswith("membership change"), starts[-1]


@pytest.mark.exhaustive
def test_two_nodes_meet_through_a_file(tmp_path, cache, reference):
    pytest.importorskip("loom.runtime.rendezvous")
    run_dir = tmp_path / "run"
    first, second = agents(tmp_path, "2", run_dir, cache, backend="file", max_restarts=0)
    for a in (first, second):
        assert a.returncode == 0, a.stderr[-4000:]
    check_losses(run_dir, reference)
    assert "FSDP (world 2: dp_shard=2)" in first.stdout + second.stdout
