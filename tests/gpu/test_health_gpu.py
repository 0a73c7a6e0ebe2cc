"""The flight recorder and collective timing on NCCL (loom.runtime.flight_recorder, loom.runtime.stragglers).

One GPU: a 1-rank NCCL group formed with loom's flight-recorder variables records its collectives; the dump
(``_dump_nccl_trace``) parses into the report's summary, and the on-completion hook sums CUDA-event durations.
Two GPUs (skipped with fewer): a rank that never joins a collective makes NCCL's watchdog dump every rank into
``<run.dir>/flight_recorder`` and stop the job; the report from the dumps names the rank. A rank made slow is
named a straggler, with collective times measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTOLOAD = os.path.join(REPO, "tests", "faults", "autoload")


def two_gpus(test):
    """A test that needs 2 CUDA devices: skipped with fewer, in the ``multi_gpu`` group."""
    return pytest.mark.multi_gpu(
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")(test)
    )


ONE_RANK = r"""
import json, os, pickle, sys, time
from loom.runtime.health import process_env
from loom.runtime.flight_recorder import summarize_dump, dump_flight_recorder
from loom.runtime.hang_report import write_report, report_from_dumps
run_dir = sys.argv[1]
os.environ.update(process_env(run_dir, "cuda", comm_timing=True))  # before the group forms, as the trainer does
import torch, torch.distributed as dist
from loom.runtime.stragglers import CommTimer
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
timer = CommTimer()
attached = timer.attach()
x = torch.ones(1 << 20, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
seconds, deadline = 0.0, time.monotonic() + 20
while seconds <= 0 and time.monotonic() < deadline:  # the hooks run on the watchdog's thread, a little later
    time.sleep(0.2)
    seconds += timer.take()
raw = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
groups = summarize_dump(raw)
os.makedirs(os.path.join(run_dir, "flight_recorder"), exist_ok=True)
with open(os.path.join(run_dir, "flight_recorder", "rank_0"), "wb") as fh:
    pickle.dump(dump_flight_recorder(), fh)
report = report_from_dumps(run_dir)
print(json.dumps({"attached": attached, "comm_seconds": seconds, "groups": groups, "stuck": report.stuck,
                  "entries": len(raw["entries"]), "env": {k: os.environ.get(k) for k in
                  ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")}}))
dist.destroy_process_group()
"""


def test_one_rank_nccl_flight_recorder_dump_parses_and_collectives_are_timed(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", ONE_RANK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert out["env"]["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(str(tmp_path), "flight_recorder", "rank_")
    assert out["entries"] >= 5
    (group,) = [g for g in out["groups"].values() if any(c["op"] == "all_reduce" for c in g["collectives"])]
    assert group["last_enqueued"] >= 5 and group["collectives"][-1]["sizes"] == [[1 << 20]]
    assert out["attached"] and out["comm_seconds"] > 0
    assert out["stuck"] == []


def launch(run_dir, nproc: int, fault: str, **extra) -> subprocess.CompletedProcess:
    config = {
        "run.device": "cuda",
        "run.dir": str(run_dir),
        "training.steps": 6,
        "training.seq_len": 128,
        "training.global_batch_size": 8,
        "training.micro_batch_size": 2,
        "metrics.every": 2,
        "metrics.tensorboard": "false",
        "checkpoint.at_end": "false",
        **extra,
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([AUTOLOAD, REPO]),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "NCCL_NVLS_ENABLE": "0",
        "LOOM_FAULT_RANK": fault,
    }
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from loom.cli.main import entry; entry()",
            "train",
            "--nproc-per-node",
            str(nproc),
            *[f"--{k}={v}" for k, v in config.items()],
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@two_gpus
def test_nccl_timeout_dumps_every_rank_and_the_report_names_the_stuck_one(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, 2, "stall:1:6", **{"parallel.timeout_s": 20})
    assert proc.returncode != 0
    # NCCL's watchdog dumps (TORCH_NCCL_DUMP_ON_TIMEOUT), or loom's own answer where the gloo vote timed out first
    dumps = sorted(os.listdir(run_dir / "flight_recorder"))
    assert "rank_0" in dumps, (dumps, proc.stderr[-3000:])
    report = subprocess.run(
        [sys.executable, "-m", "loom.runtime.hang_report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    assert report.returncode == 0, report.stderr
    with open(run_dir / "hang_report.json") as fh:
        data = json.load(fh)
    assert data["stuck"] == [1], report.stdout
    assert "rank 1 never joined all_reduce #" in report.stdout.splitlines()[0]


@two_gpus
def test_a_slow_rank_on_gpus_is_named_with_its_collective_time(tmp_path):
    run_dir = tmp_path / "slow"
    proc = launch(run_dir, 2, "slow:1:0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as fh:
        logged = [json.loads(line) for line in fh]
    assert [r["step"] for r in logged if "straggler_ranks" in r] == [2, 4, 6]
    for rec in logged:
        assert rec["straggler_ranks"] == [1], rec
        assert rec["comm_time_median"] is not None and rec["comm_time_max"] > 0
    assert sum(proc.stdout.count(f"straggler at step {s}: rank 1 ") for s in (2, 4, 6)) == 3
