"""parallel.cpu_offload across ranks: FSDP2 with its shards, gradients and AdamW state on the host gives the single
process's losses (without offload) at every step. The ranks join a ``cpu:gloo`` group, the CPU half of the
``cuda:nccl,cpu:gloo`` backend an offloaded GPU job uses (``loom.parallel.env.choose_backend``): the offloaded
gradients' global-norm all-reduce and the host-side accumulation run through it."""

from __future__ import annotations

import json
import os

import pytest
import torch.multiprocessing as mp

from tests.distributed.harness import HANG_SECONDS, _exit_now, _teardown, free_port, losses, run_jobs, run_one
from tests.tiny import tiny_overrides

STEPS = 4
GLOBAL = 8


def job(tmp, name, mb, **over):
    return tiny_overrides(f"{tmp}/{name}", f"{tmp}/cache", **{
        "run.seed": 3, "training.steps": STEPS, "training.global_batch_size": GLOBAL, "training.micro_batch_size": mb,
        "optimizer.warmup_steps": 1, "optimizer.lr": 3e-3, **over})


def _worker(rank: int, world: int, port: int, backend: str, jobs: list[dict], out_path: str) -> None:
    """As the harness's worker, on a group of ``backend``; rank 0 also reports the backend the group has."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import faulthandler
    import traceback

    import torch.distributed as dist

    faulthandler.enable()
    dist.init_process_group(backend)
    results = []
    try:
        for j in jobs:
            faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
            try:
                results.append({"records": run_one(j), "backend": dist.get_backend()})
            except Exception:  # noqa: BLE001 - reported to the test with its traceback
                results.append({"error": traceback.format_exc()})
                traceback.print_exc()
                dist.barrier()
    finally:
        _teardown(dist)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(results, fh)
    _exit_now()


def run_on(backend: str, world: int, jobs: list[dict], tmp) -> list[dict]:
    out = os.path.join(str(tmp), f"offload_w{world}_{os.getpid()}.json")
    mp.spawn(_worker, args=(world, free_port(), backend, jobs, out), nprocs=world, join=True)
    with open(out) as fh:
        return json.load(fh)


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_two_rank_offload_on_cpu_gloo_equals_one_process(tmp_path):
    """dp_shard 2 with offload, with gradient accumulation (each micro-batch's gradient added to the host shard) and
    clipping by the global norm (the tiny run's norms are above 1), against one process without offload."""
    (single,) = run_jobs(1, [job(tmp_path, "single", 2)], str(tmp_path))
    offloaded = job(tmp_path, "fsdp2_offload", 2, **{"parallel.dp_shard": 2, "parallel.cpu_offload": "true"})
    (offload,) = run_on("cpu:gloo", 2, [offloaded], tmp_path)
    assert offload.get("backend") == "cpu:gloo", offload.get("error")
    assert max(r["grad_norm"] for r in single["records"]) > 1.0  # clipping by the global norm took part
    assert max_rel(losses(offload), losses(single)) < 1e-5


@pytest.mark.exhaustive
def test_offload_with_context_and_expert_parallelism_equals_one_process(tmp_path):
    """cp 2 (the shard axis is dp_shard x cp) and a MoE model with ep 2 (its experts sharded, offloaded, over edp)."""
    moe = {"model.flavor": "debug_moe"}
    singles = run_jobs(1, [job(tmp_path, "single", 4), job(tmp_path, "single_moe", 4, **moe)], str(tmp_path))
    offloaded = run_on("cpu:gloo", 2, [
        job(tmp_path, "cp2_offload", 4, **{"parallel.cp": 2, "parallel.cpu_offload": "true"}),
        job(tmp_path, "ep2_offload", 2, **moe, **{"parallel.dp_shard": 2, "parallel.ep": 2,
                                                  "parallel.cpu_offload": "true"})], tmp_path)
    for off, single in zip(offloaded, singles):
        assert max_rel(losses(off), losses(single)) < 1e-5
