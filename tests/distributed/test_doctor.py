"""``loom doctor`` across 2 gloo ranks: the bandwidth tests and the matmul run on every rank and rank 0 gets the
gathered per-rank results (and a variable set differently on one rank named); ``loom doctor --nproc-per-node 2``
starts the ranks through the elastic launcher and reports once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.harness import run_fn

BIN = os.path.dirname(sys.executable)


def doctor_on_two_ranks(rank: int, world: int):
    from loom.cluster.doctor import Options, render, run

    if rank == 1:
        os.environ["NCCL_DEBUG"] = "INFO"  # one rank differs: the doctor names the variable
    report = run(Options(sizes=[4096, 65536], iters=2, matmul_size=64))
    return {"json": report.to_json(), "text": render(report), "main": report.is_main}


def test_two_ranks_measure_and_gather(tmp_path):
    out = run_fn(2, doctor_on_two_ranks, str(tmp_path))
    assert out["main"]
    job = out["json"]["job"]
    assert job["world_size"] == 2 and job["backend"] == "gloo"
    for op in ("all_reduce", "all_gather"):
        rows = job["collectives"][op]
        assert [r["bytes"] for r in rows] == [
            4096,
            65536,
        ]  # all-gather: the gathered output, 2 x 2048 / 32768
        for r in rows:
            assert r["wrong"] == 0 and r["time_us"] > 0
            factor = 1.0 if op == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n at n = 2
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
            assert r["algbw_gbps"] == pytest.approx(r["bytes"] / 1e9 / (r["time_us"] / 1e6))
    assert [m["rank"] for m in job["matmul"]] == [0, 1]
    assert all(
        m["tflops"] > 0 and m["finite"] and m["dtype"] == "float32" and m["size"] == 64 for m in job["matmul"]
    )
    checks = {(c["status"], c["what"]) for c in out["json"]["checks"]}
    assert any(s == "WARN" and "NCCL_DEBUG differs between its ranks" in w for s, w in checks)
    assert any(
        s == "OK" and w.startswith("all-reduce: busbw") and "2 ranks on 1 host, gloo" in w for s, w in checks
    )
    assert "Collectives" in out["text"] and "all_gather" in out["text"]


@pytest.mark.slow
def test_nproc_per_node_reports_once_with_json(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.run(
        [
            os.path.join(BIN, "loom"),
            "doctor",
            "--nproc-per-node",
            "2",
            "--sizes",
            "4K",
            "--iters",
            "1",
            "--matmul-size",
            "32",
            "--json",
            str(tmp_path / "d.json"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("loom doctor: 2 ranks on 1 host") == 1
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["world_size"] == 2 and len(data["job"]["matmul"]) == 2 and data["exit_code"] == 0
