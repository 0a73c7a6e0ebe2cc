"""parallel.cpu_offload across ranks: FSDP2 with its shards, gradients and AdamW state on the host gives the single
process's losses (without offload) at every step; so do the AdamW moments in files (optimizer.offload nvme) and
activation offload, under FSDP2 and through a zero-bubble pipeline. The ranks join a ``cpu:gloo`` group, the CPU half of the
``cuda:nccl,cpu:gloo`` backend an offloaded GPU job uses (``loom.runtime.env.choose_backend``): the offloaded
gradients' global-norm all-reduce and the host-side accumulation run through it."""

from __future__ import annotations

import functools

import pytest

from tests.distributed.harness import _jobs_on_rank, losses, pool_call, run_jobs
from tests.tiny import tiny_overrides

STEPS = 4
GLOBAL = 8


def job(tmp, name, mb, **over):
    return tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{
            "run.seed": 3,
            "training.steps": STEPS,
            "training.global_batch_size": GLOBAL,
            "training.micro_batch_size": mb,
            "optimizer.warmup_steps": 1,
            "optimizer.lr": 3e-3,
            **over,
        },
    )


def _jobs_with_backend(jobs: list[dict], rank: int, world: int) -> list[dict]:
    """The harness's jobs, each also reporting the backend its group has."""
    import torch.distributed as dist

    return [{**r, "backend": dist.get_backend()} for r in _jobs_on_rank(jobs, rank, world)]


def run_on(backend: str, world: int, jobs: list[dict], tmp) -> list[dict]:
    return pool_call(world, functools.partial(_jobs_with_backend, jobs), str(tmp), backend=backend)


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_two_rank_offload_on_cpu_gloo_equals_one_process(tmp_path):
    """dp_shard 2 with offload, with gradient accumulation (each micro-batch's gradient added to the host shard) and
    clipping by the global norm (the tiny run's norms are above 1), against one process without offload."""
    four = {"model.n_layers": 4}
    single, single4 = run_jobs(
        1, [job(tmp_path, "single", 2), job(tmp_path, "single4", 2, **four)], str(tmp_path)
    )
    offloaded = job(tmp_path, "fsdp2_offload", 2, **{"parallel.dp_shard": 2, "parallel.cpu_offload": "true"})
    # the same group: FSDP2 shards with their AdamW moments in files (DTensors around them, saved by DCP at step 2)
    # and every block's saved activations (recomputed: its input) through the offload hooks
    nvme = job(
        tmp_path,
        "fsdp2_nvme_activation_offload",
        2,
        **{
            "parallel.dp_shard": 2,
            "optimizer.offload": "nvme",
            "optimizer.offload_chunk_mb": 0.01,
            "training.activation_offload": "all",
            "training.activation_checkpointing": "full",
            "checkpoint.every": 2,
        },
    )
    # and through a zero-bubble pipeline (ZBV: two stages a rank, input and weight gradients apart)
    pipeline = job(
        tmp_path,
        "zbv_activation_offload",
        2,
        **four,
        **{"parallel.pp": 2, "parallel.pp_schedule": "zbv", "training.activation_offload": "all"},
    )
    offload, files, zbv = run_on("cpu:gloo", 2, [offloaded, nvme, pipeline], tmp_path)
    assert offload.get("backend") == "cpu:gloo", offload.get("error")
    assert max(r["grad_norm"] for r in single["records"]) > 1.0  # clipping by the global norm took part
    assert max_rel(losses(offload), losses(single)) < 1e-5
    assert max_rel(losses(files), losses(single)) < 1e-5, files.get("error")
    assert max_rel(losses(zbv), losses(single4)) < 1e-5, zbv.get("error")


@pytest.mark.exhaustive
def test_offload_with_context_and_expert_parallelism_equals_one_process(tmp_path):
    """cp 2 (the shard axis is dp_shard x cp) and a MoE model with ep 2 (its experts sharded, offloaded, over edp)."""
    moe = {"model.flavor": "debug_moe"}
    singles = run_jobs(1, [job(tmp_path, "single", 4), job(tmp_path, "single_moe", 4, **moe)], str(tmp_path))
    offloaded = run_on(
        "cpu:gloo",
        2,
        [
            job(tmp_path, "cp2_offload", 4, **{"parallel.cp": 2, "parallel.cpu_offload": "true"}),
            job(
                tmp_path,
                "ep2_offload",
                2,
                **moe,
                **{"parallel.dp_shard": 2, "parallel.ep": 2, "parallel.cpu_offload": "true"},
            ),
        ],
        tmp_path,
    )
    for off, single in zip(offloaded, singles):
        assert max_rel(losses(off), losses(single)) < 1e-5
