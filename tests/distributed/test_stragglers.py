"""A rank whose data comes 0.4 s late every step (``tests/faults/ranks.py``: ``slow``) is named at every logged
step, on the console and in metrics.jsonl, with every rank's figures in ranks.jsonl. (The gather touches no
tensor of the step: tests/distributed/test_layout_invariance.py runs with it and keeps the single process's
losses.)"""

from __future__ import annotations

import json
import os

from tests.distributed.harness import run_jobs
from tests.tiny import tiny_overrides

AUTOLOAD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "faults", "autoload")


def job(tmp, name):
    return tiny_overrides(
        f"{tmp}/{name}", f"{tmp}/cache", **{"run.seed": 5, "training.steps": 4, "metrics.every": 2}
    )


def test_a_slow_rank_is_named(tmp_path, monkeypatch, capfd):
    # the spawned ranks import autoload/sitecustomize at start: rank 1's loader sleeps 0.4 s before each step
    monkeypatch.setenv("PYTHONPATH", AUTOLOAD + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("LOOM_FAULT_RANK", "slow:1:0.4")
    (result,) = run_jobs(
        2, [job(tmp_path, "slow")], str(tmp_path), fresh=True
    )  # ranks with the fault, in capfd
    assert "error" not in result, result["error"]
    logged = [r for r in result["records"] if "straggler_ranks" in r]
    assert [r["step"] for r in logged] == [2, 4]
    for rec in logged:
        assert rec["straggler_ranks"] == [1], rec
        assert rec["comm_time_median"] is None  # gloo: collectives are not timed
        assert rec["own_time_max"] > rec["own_time_median"] and rec["data_wait_max"] > rec["data_wait_median"]
    with open(tmp_path / "slow" / "ranks.jsonl") as fh:
        per_rank = [json.loads(line) for line in fh]
    assert [r["step"] for r in per_rank] == [2, 4]
    for r in per_rank:
        assert r["data_wait"][1] > r["data_wait"][0] and r["own_time"][1] > r["own_time"][0]
        assert len(r["step_time"]) == 2 and r["comm_time"] == [None, None]
    out = capfd.readouterr().out
    assert (
        out.count("straggler at step 2: rank 1 ") == 1 and out.count("straggler at step 4: rank 1 ") == 1
    ), out[-3000:]
