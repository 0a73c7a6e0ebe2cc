"""Exact resume (same layout, bitwise on CPU in deterministic mode) and resharding resume
(saved on 4 FSDP ranks, resumed on 2 FSDP ranks and on 2 DDP ranks)."""

from __future__ import annotations

import os

import pytest

from tests.distributed.harness import losses, run_jobs
from tests.tiny import tiny_overrides

STEPS, SAVE_AT = 8, 4


def job(run_dir, cache, **extra):
    return tiny_overrides(
        run_dir,
        cache,
        **{
            "run.seed": 5,
            "run.deterministic": "true",
            "training.steps": STEPS,
            "optimizer.warmup_steps": 2,
            "optimizer.lr": 3e-3,
            "checkpoint.every": SAVE_AT,
            "checkpoint.keep": 0,
            **extra,
        },
    )


def ckpt(run_dir, step):
    return os.path.join(run_dir, "checkpoints", f"step_{step:08d}")


def tail(result, from_step):
    assert "error" not in result, result["error"]
    return [(r["step"], r["loss"], r["batch_hash"]) for r in result["records"] if r["step"] > from_step]


def test_exact_resume_same_layout_is_bitwise(tmp_path):
    cache = str(tmp_path / "cache")
    full = run_jobs(1, [job(str(tmp_path / "full"), cache)], str(tmp_path))[0]
    resumed = run_jobs(
        1,
        [job(str(tmp_path / "resumed"), cache, **{"checkpoint.resume": ckpt(tmp_path / "full", SAVE_AT)})],
        str(tmp_path),
    )[0]
    assert len(losses(resumed)) == STEPS - SAVE_AT
    assert tail(resumed, SAVE_AT) == tail(full, SAVE_AT)  # bitwise: exact float equality


@pytest.mark.parametrize("async_save", ["false", pytest.param("true", marks=pytest.mark.slow)])
def test_resharding_resume_fsdp4_to_2(tmp_path, async_save):
    cache = str(tmp_path / "cache")
    src = str(tmp_path / "fsdp4")
    full = run_jobs(
        4,
        [
            job(
                src,
                cache,
                **{
                    "parallel.dp_shard": 4,
                    "training.micro_batch_size": 1,
                    "checkpoint.async_save": async_save,
                },
            )
        ],
        str(tmp_path),
    )[0]
    resume = {"checkpoint.resume": ckpt(src, SAVE_AT)}
    fsdp2, ddp2 = run_jobs(
        2,
        [
            job(str(tmp_path / "fsdp2"), cache, **{"parallel.dp_shard": 2}, **resume),
            job(
                str(tmp_path / "ddp2"),
                cache,
                **{"parallel.dp_replicate": 2, "parallel.dp_shard": 1},
                **resume,
            ),
        ],
        str(tmp_path),
    )
    ref = tail(full, SAVE_AT)
    for res in (fsdp2, ddp2):
        got = tail(res, SAVE_AT)
        assert [s for s, _, _ in got] == [s for s, _, _ in ref]
        assert [h for _, _, h in got] == [h for _, _, h in ref]  # same global batches after resharding
        for (_, a, _), (_, b, _) in zip(got, ref):
            assert abs(a - b) / abs(b) < 1e-5


def test_auto_resume_skips_a_corrupt_newest_checkpoint_on_two_ranks(tmp_path):
    """Rank 0 verifies, finds the newest checkpoint truncated, and every rank falls back to the one before."""
    cache, src = str(tmp_path / "cache"), str(tmp_path / "run")
    full = run_jobs(2, [job(src, cache, **{"parallel.dp_shard": 2})], str(tmp_path))[0]
    newest = ckpt(src, STEPS)
    shard = next(f for f in sorted(os.listdir(newest)) if f.endswith(".distcp"))
    with open(os.path.join(newest, shard), "r+b") as fh:
        fh.truncate(8)
    again = run_jobs(
        2, [job(src, cache, **{"parallel.dp_shard": 2, "checkpoint.resume": "auto"})], str(tmp_path)
    )[0]
    assert tail(again, SAVE_AT) == tail(full, SAVE_AT)  # resumed at SAVE_AT, same layout: bitwise
