"""A rank that never joins a collective (``tests/faults/ranks.py``: ``stall``) in a launched 2-rank gloo run with
``parallel.timeout_s 5``: the job exits on its own, and the console line and ``<run.dir>/hang_report.*`` name that
rank, the collective it missed with its sequence number, and what the other rank was doing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.tiny import tiny_args

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTOLOAD = os.path.join(REPO, "tests", "faults", "autoload")
LOOM = "from loom.cli.main import entry; entry()"


def launch(run_dir, cache, fault: str, **extra) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([AUTOLOAD, REPO, os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "LOOM_FAULT_RANK": fault,
    }
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOOM_FAULT",
    ):
        env.pop(var, None)
    args = tiny_args(run_dir, cache, **{"training.steps": 6, **extra})
    # the limit only keeps a broken test from hanging CI: the run stops on its own 5 s after the stall
    return subprocess.run(
        [sys.executable, "-c", LOOM, "train", "--nproc-per-node", "2", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_rank_that_never_joins_a_collective_is_named_and_the_job_exits(tmp_path):
    run_dir = tmp_path / "run"
    # rank 1's 6th all_reduce (in step 2 today: the step's token count) never happens
    proc = launch(run_dir, tmp_path / "cache", "stall:1:6", **{"parallel.timeout_s": 5})
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "loom-fault: rank 1 stalls all_reduce #6" in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("loom: stopped: collective timeout")]
    assert "rank 1 never joined all_reduce #" in line and "which rank 0 waited in" in line, line
    assert (
        "rank 1 (after step " in line
        and ") is in tests/faults/ranks.py" in line
        and "called from loom/" in line
    ), line
    assert line.endswith(f"report {run_dir / 'hang_report.txt'}"), line
    with open(run_dir / "hang_report.json") as fh:
        report = json.load(fh)
    assert report["stuck"] == [1] and report["detected_by"] == [0] and report["silent"] == []
    (finding,) = report["findings"]
    assert finding["op"] == "all_reduce" and finding["waiting"] == [0]
    assert list(finding["behind"]) == ["1"] and finding["behind"]["1"].endswith(f" #{finding['seq'] - 1}")
    assert report["ranks"]["0"]["source"] == "timed out" and "Timed out" in report["ranks"]["0"]["error"]
    assert report["ranks"]["1"]["phase"] == "training"
    assert sorted(os.listdir(run_dir / "flight_recorder")) == [
        "rank_0",
        "rank_1",
    ]  # torch's analyzer reads these
    text = (run_dir / "hang_report.txt").read_text()
    assert text.splitlines()[0] == line[len("loom: stopped: ") :]


@pytest.mark.exhaustive
def test_a_rank_that_never_reaches_a_checkpoint_save_is_named_by_the_monitored_barrier(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(
        run_dir, tmp_path / "cache", "stall_save:1:1", **{"parallel.timeout_s": 5, "checkpoint.every": 2}
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "loom-fault: rank 1 stalls save #1" in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("loom: stopped: collective timeout")]
    assert "rank 1 never reached the monitored barrier (checkpoint) that rank 0 waited at" in line, line
    assert "rank 1 (after step 2) is in tests/faults/ranks.py" in line and "loom/train/trainer.py" in line, (
        line
    )
    with open(run_dir / "hang_report.json") as fh:
        report = json.load(fh)
    assert report["stuck"] == [1] and report["findings"][0]["op"] == "monitored barrier"
    assert "failed to pass monitoredBarrier" in report["ranks"]["0"]["error"]
