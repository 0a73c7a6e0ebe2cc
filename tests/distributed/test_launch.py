"""Launching: ``loom train --nproc-per-node 2`` (the console script, elastic agent) and
``torchrun -m loom.train`` train 2 ranks whose losses equal a single-process run of the same config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.harness import run_one
from tests.tiny import tiny_overrides

BIN = os.path.dirname(sys.executable)
CONFIG = tiny_overrides(**{"run.seed": 11, "optimizer.lr": 3e-3})


def cli_args(run_dir, cache, **extra) -> list[str]:
    d = {**CONFIG, "run.dir": str(run_dir), "data.cache_dir": str(cache), **extra}
    return [f"--{k}={v}" for k, v in d.items()]


def launch(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def losses_of(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line)["loss"] for line in fh]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache) -> list[float]:
    run_dir = tmp_path_factory.mktemp("single")
    records = run_one({**CONFIG, "run.dir": str(run_dir), "data.cache_dir": str(cache)})
    assert losses_of(run_dir) == [r["loss"] for r in records]
    return losses_of(run_dir)


def assert_matches(got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref) == CONFIG["training.steps"]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) < 1e-5


def test_loom_train_nproc_per_node(tmp_path, cache, single):
    proc = launch(
        [os.path.join(BIN, "loom"), "train", "--nproc-per-node", "2", *cli_args(tmp_path / "run", cache)],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FSDP (world 2: dp_shard=2), accumulation 2" in proc.stdout  # two ranks, printed once (rank 0)
    assert proc.stdout.count("step 4/4") == 1
    assert_matches(losses_of(tmp_path / "run"), single)


def test_torchrun_module(tmp_path, cache, single):
    proc = launch(
        [
            os.path.join(BIN, "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "loom.train",
            *cli_args(tmp_path / "run", cache, **{"parallel.dp_replicate": 2, "parallel.dp_shard": 1}),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DDP (world 2: dp_replicate=2)" in proc.stdout
    assert_matches(losses_of(tmp_path / "run"), single)


def test_worker_user_error_exits_2(tmp_path, cache):
    """An error only the workers find (bytes that are not UTF-8, found while rank 0 tokenizes) exits 2, one line."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good text\n" * 50 + b"\xff\xfe not utf-8\n")
    proc = launch(
        [
            os.path.join(BIN, "loom"),
            "train",
            "--nproc-per-node",
            "2",
            *cli_args(tmp_path / "run", tmp_path / "fresh_cache", **{"data.source": str(bad)}),
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("loom: error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "--data.encoding_errors replace" in errors[0], (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ranks_from_mpirun(tmp_path, cache, single):
    """``mpirun -np 2 loom train ...`` on gloo: each rank reads Open MPI's variables (no RANK, no
    MASTER_ADDR: one host, so 127.0.0.1) and the two train one process's losses. With mpirun on PATH it starts them;
    without (the test machines), two processes get the variables Open MPI's mpirun gives its ranks."""
    import shutil

    args = cli_args(tmp_path / "run", cache)
    port = str(free_port())
    env = {**os.environ, "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        env.pop(var, None)
    cmd = [
        os.path.join(BIN, "loom"),
        "train",
        *args,
    ]  # each rank checks for 2 ranks; rank 0 locks the run dir
    if shutil.which("mpirun"):
        proc = subprocess.run(
            ["mpirun", "-np", "2", "-x", "MASTER_PORT", "-x", "PYTHONPATH", *cmd],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        procs = [
            subprocess.Popen(
                cmd,
                cwd=tmp_path,
                env={
                    **env,
                    "OMPI_COMM_WORLD_RANK": str(r),
                    "OMPI_COMM_WORLD_SIZE": "2",
                    "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=300) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
        assert "FSDP (world 2: dp_shard=2)" in outs[0][0]
    assert_matches(losses_of(tmp_path / "run"), single)
