"""Restarts under the elastic agent (loom.runtime.restarts): a worker SIGKILLed or raising mid-step or mid-save under
``--max-restarts 1`` is restarted with its peers, the group resumes from the newest complete checkpoint by itself,
and the run ends with the losses of an uninterrupted one (one process: the losses do not depend on the layout).
Every restart is in ``restarts.jsonl`` (the agent's failure record, the attempt's restart record), in metrics.jsonl
(``restarts``) and in one console line. Faults come from ``restart_faults/sitecustomize.py``: tests.faults.inject's
kill points and the start of a step, armed in one rank of the first attempt only.

The default run has one launch (2 ranks, SIGKILL mid-step) and the pure parts (the log, the cause, the launcher's
options); the rest of the matrix (torchrun, a raised error, mid-save, 4 ranks) is marked ``exhaustive``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from loom.config.errors import ConfigError, SharedError
from loom.runtime import restarts
from tests.distributed.harness import run_one
from tests.tiny import tiny_overrides

STEPS, EVERY = 6, 2
CONFIG = tiny_overrides(
    **{"run.seed": 11, "optimizer.lr": 3e-3, "training.steps": STEPS, "checkpoint.every": EVERY}
)
BIN = os.path.dirname(sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "restart_faults")


def cli_args(run_dir, cache, **extra) -> list[str]:
    return [
        f"--{k}={v}"
        for k, v in {**CONFIG, "run.dir": str(run_dir), "data.cache_dir": str(cache), **extra}.items()
    ]


def fault_env(fault: str | None, rank: str = "1", **extra) -> dict:
    """This environment for a launch: no rank variables of an outer launcher, the fault armed in ``rank``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_WORLD_SIZE",
            "TORCHELASTIC_RUN_ID",
            "LOOM_RESTART_FAULT",
            "LOOM_RESTART_FAULT_RANK",
        )
    }
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [FAULTS, ROOT, env.get("PYTHONPATH")])),
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        OMP_NUM_THREADS="1",
        **extra,
    )
    if fault:
        env.update(LOOM_RESTART_FAULT=fault, LOOM_RESTART_FAULT_RANK=rank)
    return env


def launch(argv_for, tmp_path, env: dict, timeout: int):
    """Run ``argv_for(run_dir)``; once more in a fresh run dir when a rendezvous lost the race for a free port
    (torchrun picks one for each restart round, and another test's process on this machine can bind it first: the
    machine's fault, not the run's). Returns the process and its run dir."""
    for attempt in range(2):
        run_dir = tmp_path / ("run" if not attempt else "run_again")
        proc = subprocess.run(
            argv_for(run_dir), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
        )
        out = (proc.stdout + proc.stderr).lower()
        if attempt or proc.returncode == 0 or not ("eaddrinuse" in out or "address already in use" in out):
            break
        warnings.warn(  # the first attempt, said: a restart path that itself lost a port would show here
            f"launch exited {proc.returncode} on a taken port; once more in a fresh run dir. Its output's end:\n"
            + (proc.stdout + proc.stderr)[-2000:],
            stacklevel=2,
        )
    return proc, run_dir


def records_of(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> list[float]:
    """The losses of the uninterrupted run, in one process."""
    run_dir = tmp_path_factory.mktemp("reference")
    return [r["loss"] for r in run_one({**CONFIG, "run.dir": str(run_dir), "data.cache_dir": str(cache)})]


def check_restarted(proc, run_dir, reference, *, resumed: int, killed_rank: int | None, cause: str) -> None:
    """One restart, from the checkpoint of step ``resumed``, after ``killed_rank`` failed with ``cause``; the run
    finished with the reference's losses, each step once."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = records_of(run_dir)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    got = [r["loss"] for r in recs]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, reference)) < 1e-5, (got, reference)
    assert [r.get("restarts") for r in recs] == [None] * resumed + [1] * (STEPS - resumed)
    log = restarts.read(run_dir)
    assert [r["event"] for r in log if r["event"] != "failure"] == ["start", "restart"], log
    start, restart = (r for r in log if r["event"] != "failure")
    assert start["step"] == 0 and restart["step"] == resumed and restart["restart"] == 1
    assert restart["lineage"] == start["lineage"] and restart["run_id"] == start["run_id"]
    assert (killed_rank is None or f"rank {killed_rank}" in restart["cause"]) and cause in restart["cause"], (
        restart
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("loom: restart")]
    assert len(lines) == 1 and f"resumed from step {resumed}" in lines[0] and cause in lines[0], proc.stdout


def test_sigkill_mid_step_restarts_and_resumes_with_the_same_losses(tmp_path, cache, reference):
    """loom train, 2 ranks: rank 1 SIGKILLed as step 4 starts; the checkpoint of step 2 is the newest."""
    proc, run_dir = launch(
        lambda run_dir: [
            os.path.join(BIN, "loom"),
            "train",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            *cli_args(run_dir, cache),
        ],
        tmp_path,
        fault_env("step:4"),
        600,
    )
    check_restarted(proc, run_dir, reference, resumed=2, killed_rank=1, cause="SIGKILL")
    failure = next(r for r in restarts.read(run_dir) if r["event"] == "failure")
    killed = [f for f in failure["failures"] if f["rank"] == 1]
    assert killed and killed[0]["exitcode"] == -9 and failure["restarting"] is True


@pytest.mark.exhaustive
@pytest.mark.parametrize(
    "nproc,fault,how,resumed",
    [
        (2, "shard:2", "", 2),  # inside the second save (step 4): its shard written, not synced
        (4, "step:5", "", 4),
        (4, "shard:2", "", 2),
        (2, "step:3", "raise", 2),
    ],
)
def test_loom_train_restart_matrix(tmp_path, cache, reference, nproc, fault, how, resumed):
    rank = str(nproc - 1)
    proc, run_dir = launch(
        lambda run_dir: [
            os.path.join(BIN, "loom"),
            "train",
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            "1",
            *cli_args(run_dir, cache),
        ],
        tmp_path,
        fault_env(f"{fault}:{how}" if how else fault, rank),
        900,
    )
    cause = "RuntimeError: injected fault" if how == "raise" else "SIGKILL"
    check_restarted(proc, run_dir, reference, resumed=resumed, killed_rank=int(rank), cause=cause)


@pytest.mark.exhaustive
def test_torchrun_max_restarts_resumes_by_itself(tmp_path, cache, reference):
    """Plain torchrun: rank 1 raises inside the second save; the workers resume by themselves and the restart
    record names the error (this node's error files of the previous attempt)."""
    proc, run_dir = launch(
        lambda run_dir: [
            os.path.join(BIN, "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "-m",
            "loom.train",
            *cli_args(run_dir, cache),
        ],
        tmp_path,
        fault_env("shard:2:raise"),
        600,
    )
    # DCP hands rank 1's error to every rank: the cause is the error, from whichever rank wrote it first
    check_restarted(proc, run_dir, reference, resumed=2, killed_rank=None, cause="injected fault at shard")


@pytest.mark.exhaustive
def test_a_user_error_is_not_restarted(tmp_path, cache):
    """A user error in the workers (bytes that are not UTF-8) stops the group at once: exit code 2, one error line,
    the agent's failure record says it does not restart."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good text\n" * 50 + b"\xff\xfe not utf-8\n")
    proc = subprocess.run(
        [
            os.path.join(BIN, "loom"),
            "train",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            *cli_args(tmp_path / "run", tmp_path / "fresh", **{"data.source": str(bad)}),
        ],
        cwd=tmp_path,
        env=fault_env(None),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len([line for line in proc.stderr.splitlines() if line.startswith("loom: error:")]) == 1, (
        proc.stderr
    )
    log = restarts.read(tmp_path / "run")
    assert [r["event"] for r in log] == ["failure"] and log[0]["restarting"] is False, log


# ---- the pure parts ----------------------------------------------------------------------------------------


def test_the_cause_is_the_signal_not_the_peers_that_lost_it():
    killed = {
        "rank": 3,
        "pid": 7,
        "host": "n1",
        "exitcode": -9,
        "signal": "SIGKILL",
        "error": None,
        "timestamp": 9,
    }
    peer = {
        "rank": 0,
        "exitcode": -15,
        "signal": "SIGTERM",
        "timestamp": 8,
        "error": "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer. GLHF",
    }
    raised = {"rank": 1, "exitcode": 1, "signal": None, "error": "ValueError: bad batch", "timestamp": 9}
    assert (
        restarts.describe_failures([peer, killed])
        == "rank 3 (pid 7, host n1) was killed by SIGKILL (1 other rank failed with it)"
    )
    assert restarts.describe_failures([peer, raised]).startswith("rank 1 exit code 1: ValueError: bad batch")
    assert "a peer was lost" in restarts.describe_failures([peer])
    assert restarts.user_stop([{"exitcode": 2}, {"exitcode": 1, "error": "TrainingStopped: non-finite"}])
    assert restarts.user_stop([{"exitcode": 2}, peer])  # the agent's SIGTERM to the rest of the group
    assert not restarts.user_stop([{"exitcode": 2}, killed]) and not restarts.user_stop([peer])
    assert not restarts.user_stop([])


def test_an_attempt_reads_the_launch_from_the_log(tmp_path):
    """The first attempt writes ``start``; a restart (TORCHELASTIC_RESTART_COUNT, or the agent's membership record)
    takes the launch's lineage, counts the attempts and names the failures since the previous one."""
    env = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "2"}
    # none can come
    assert restarts.this_attempt(str(tmp_path), {**env, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    first = restarts.this_attempt(str(tmp_path), env)
    assert first is not None and not first.restarted and restarts.metrics_fields(first) == {}
    restarts.begin(first, str(tmp_path), step=0, world_size=4, lineage="L1", is_main=True)
    restarts.append(
        str(tmp_path),
        {
            "event": "failure",
            "run_id": "job",
            "restart_count": 0,
            "failures": [{"rank": 2, "exitcode": -9, "signal": "SIGKILL", "pid": 5, "host": "h"}],
        },
    )
    again = restarts.this_attempt(str(tmp_path), {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert (again.index, again.lineage, again.previous_world) == (1, "L1", 4)
    assert again.cause == "rank 2 (pid 5, host h) was killed by SIGKILL"
    assert restarts.metrics_fields(again) == {"restarts": 1}
    restarts.begin(again, str(tmp_path), step=6, world_size=2, lineage="L1", is_main=True)
    restarts.append(str(tmp_path), {"event": "membership", "run_id": "job", "nodes_waiting": 1})
    joined = restarts.this_attempt(str(tmp_path), {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert (joined.index, joined.previous_world) == (2, 2) and joined.cause.startswith("membership change")
    other = restarts.this_attempt(str(tmp_path), {**env, "TORCHELASTIC_RUN_ID": "next"})  # another launch
    assert not other.restarted


def test_torchrun_cause_from_the_previous_attempts_error_files(tmp_path):
    for attempt, rank, message in ((0, 1, "RuntimeError: boom"), (1, 0, "ignored: this attempt")):
        folder = tmp_path / f"attempt_{attempt}" / str(rank)
        folder.mkdir(parents=True)
        (folder / "error.json").write_text(
            json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "1", "rank": 9}}})
        )
    line = restarts.previous_errors(str(tmp_path / "attempt_1" / "0" / "error.json"), 1)
    assert line.startswith("rank 9 (host ") and line.endswith(") failed: RuntimeError: boom")
    assert "unknown" in restarts.previous_errors(str(tmp_path / "attempt_3" / "0" / "error.json"), 3)


def test_an_elastic_world_that_cannot_hold_the_layout_is_one_shared_line():
    from loom.cli.preflight import check_layout
    from tests.tiny import tiny_config

    cfg = tiny_config(**{"parallel.dp_shard": 2})
    env = {
        "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_MAX_RESTARTS": "1",
        "GROUP_WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }
    check_layout(cfg, 2, env)
    with pytest.raises(
        SharedError, match=r"parallel.dp_shard = 2: .*the job formed with 1 node\(s\) x 1 = 1 ranks"
    ):
        check_layout(cfg, 1, env)
    check_layout(cfg, 1, {})  # not under an agent that restarts: the trainer's own error stands


def test_launcher_options():
    from loom.runtime.launch import parse_launch

    launch, rest = parse_launch(
        [
            "--nproc-per-node",
            "2",
            "--max_restarts=3",
            "--nnodes",
            "1:4",
            "--rdzv-endpoint",
            "h:29500",
            "--rdzv-id",
            "j",
            "--node-rank",
            "1",
            "--training.steps",
            "5",
        ]
    )
    assert rest == ["--training.steps", "5"] and launch.elastic and launch.world_size == 8 and launch.agent
    assert launch.agent_args() == [
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--nnodes=1:4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=h:29500",
        "--rdzv-id=j",
        "--rdzv-conf=is_host=0",
    ]
    assert (
        "--rdzv-conf=is_host=0"
        not in parse_launch(["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "0"])[0].agent_args()
    )
    alone, _ = parse_launch(["--max-restarts", "1"])
    assert alone.agent and alone.agent_args()[0] == "--standalone" and alone.world_size == 1
    assert not parse_launch(["--nproc-per-node", "1"])[0].agent
    for argv, needle in (
        (["--nnodes", "2"], "--rdzv-endpoint: needed with --nnodes 2"),
        (["--nnodes", "3:2"], "--nnodes = '3:2': expected N or MIN:MAX"),
        (["--max-restarts", "-1"], "--max-restarts = -1: expected a whole number"),
        (["--rdzv-backend", "etcd"], "allowed: c10d | file"),
        (["--rdzv-backend", "file"], "--rdzv-endpoint: needed with --rdzv-backend file"),
        (["--rdzv-conf", "join_timeout"], "expected KEY=VALUE"),
    ):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            parse_launch(argv)
