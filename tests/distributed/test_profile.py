"""``metrics.profile_steps`` on 2 gloo ranks: each rank writes its own trace, with the phase and block ranges
and the collectives FSDP2 and the pipeline schedule launch (under their own names), on every layout; under DDP
the trace shows ``parallel.ddp_bucket_mb`` at work (its buckets' all-reduces launched while backward runs)."""

from __future__ import annotations

import json

from tests.distributed.harness import run_jobs
from tests.tiny import tiny_overrides


def job(tmp, name, **extra) -> dict:
    return tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{"training.steps": 2, "model.n_layers": 4, "metrics.profile_steps": "2:2", **extra},
    )


def range_names(path) -> set[str]:
    with open(path) as fh:
        return {e["name"] for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"}


def all_reduces_in_backward(path) -> int:
    """How many gloo all-reduces start inside the traced step's backward ranges (DDP's buckets as they fill)."""
    with open(path) as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "backward"]
    return sum(
        1 for e in events if e["name"] == "gloo:all_reduce" and any(a <= e["ts"] <= b for a, b in spans)
    )


def test_every_rank_traces_its_phases_blocks_and_collectives(tmp_path):
    ddp = {"parallel.dp_replicate": 2, "parallel.dp_shard": 1}
    jobs = {
        "fsdp": job(tmp_path, "fsdp", **{"parallel.dp_shard": 2}),
        "pp": job(tmp_path, "pp", **{"parallel.pp": 2, "parallel.dp_shard": 1}),
        "ddp": job(tmp_path, "ddp", **ddp),  # 25 MiB: the tiny model is one bucket
        "ddp-small-buckets": job(tmp_path, "ddp-small-buckets", **ddp, **{"parallel.ddp_bucket_mb": 0.02}),
    }
    for result in run_jobs(2, list(jobs.values()), str(tmp_path)):
        assert "error" not in result, result["error"]
    # DDP rebuilds its buckets after the first step, to the cap, in the order gradients arrived: by step 2 a
    # 20 KiB cap cuts the tiny model into several buckets, each all-reduced as soon as it is full (backward
    # overlaps communication), where the default cap's single bucket goes once
    trace = "profile/trace_rank0.json"
    one, several = (all_reduces_in_backward(tmp_path / name / trace) for name in ("ddp", "ddp-small-buckets"))
    assert one <= 1 and several >= 4, (one, several)
    for rank in (0, 1):
        fsdp = range_names(tmp_path / "fsdp" / "profile" / f"trace_rank{rank}.json")
        assert {"ProfilerStep#2", "forward", "backward", "optimizer"} <= fsdp
        assert {f"block.{i}{s}" for i in range(4) for s in ("", ".backward")} <= fsdp
        assert {"gloo:all_gather", "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"} <= fsdp
        assert any(n.startswith("FSDP::all_gather") for n in fsdp)

        pp = range_names(tmp_path / "pp" / "profile" / f"trace_rank{rank}.json")
        assert {"ProfilerStep#2", "forward_backward", "optimizer", "gloo:send", "gloo:recv"} <= pp
        mine = (0, 1) if rank == 0 else (2, 3)  # stage 0 holds layers 0-1, stage 1 layers 2-3
        assert {f"block.{i}{s}" for i in mine for s in ("", ".backward")} <= pp
        assert not any(n == f"block.{i}" for i in range(4) if i not in mine for n in pp)
