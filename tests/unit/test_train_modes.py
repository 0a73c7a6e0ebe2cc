"""Training modes on the tiny debug model: activation checkpointing, torch.compile, float16 loss scaling,
FSDP CPU offload and deterministic mode, each against the plain fp32 eager run."""

from __future__ import annotations

import json

import pytest
import torch

from loom.train.trainer import Trainer
from tests.distributed.harness import losses, run_jobs
from tests.tiny import tiny_config, tiny_overrides

STEPS = 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def overrides(tmp_path, cache, name, **extra) -> dict:
    return tiny_overrides(
        tmp_path / name,
        cache,
        **{
            "run.seed": 7,
            "training.steps": STEPS,
            "training.micro_batch_size": 4,
            "optimizer.lr": 3e-3,
            **extra,
        },
    )


def train(tmp_path, cache, name, **extra) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(tiny_config(**overrides(tmp_path, cache, name, **extra)))
    return trainer, trainer.fit()


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def eager(tmp_path_factory, cache) -> list[dict]:
    return train(tmp_path_factory.mktemp("eager"), cache, "eager")[1]


def is_checkpointed(block) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(block, CheckpointWrapper)


@pytest.mark.parametrize(
    "mode,wrapped",
    [
        ("full", [True, True]),
        pytest.param("every_k", [True, False], marks=pytest.mark.slow),
        pytest.param("op", [True, True], marks=pytest.mark.slow),
        pytest.param("matmuls", [True, True], marks=pytest.mark.slow),
    ],
)
def test_activation_checkpointing_gives_the_same_losses(tmp_path, cache, eager, mode, wrapped):
    trainer, records = train(
        tmp_path, cache, mode, **{"training.activation_checkpointing": mode, "training.ac_every": 2}
    )
    assert [is_checkpointed(b) for b in trainer.parts[0].layers.values()] == wrapped
    assert max_rel([r["loss"] for r in records], [r["loss"] for r in eager]) < 1e-6
    assert max_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in eager]) < 1e-5


@pytest.mark.slow
def test_compile_matches_eager(tmp_path, cache, eager):
    """The one torch.compile test (cold compiles cost tens of seconds on a CPU)."""
    trainer, records = train(tmp_path, cache, "compiled", **{"training.compile": "true"})
    assert all(b._compiled_call_impl is not None for b in trainer.parts[0].layers.values())
    assert max_rel([r["loss"] for r in records], [r["loss"] for r in eager]) < 1e-4


def test_float16_with_dynamic_loss_scaling(tmp_path, cache, eager):
    trainer, records = train(tmp_path, cache, "fp16", **{"training.dtype": "float16"})
    assert [r["skipped_steps"] for r in records] == [0] * STEPS
    assert max_rel([r["loss"] for r in records], [r["loss"] for r in eager]) < 1e-2
    assert trainer.scaler.scale == 2.0**16


@pytest.mark.slow
def test_float16_overflow_is_skipped_and_counted(tmp_path, cache):
    """A huge initial scale overflows: each such step is skipped (no optimizer or LR step) and counted, and the
    scale halves until steps go through."""
    steps, init = 40, 2.0**40
    trainer, records = train(
        tmp_path,
        cache,
        "overflow",
        **{
            "training.dtype": "float16",
            "training.loss_scale_init": init,
            "training.steps": steps,
            "training.seq_len": 16,
            "training.global_batch_size": 4,
            "training.micro_batch_size": 4,
        },
    )
    skipped = [r["skipped_steps"] for r in records]
    assert skipped[:10] == list(range(1, 11))  # a scale of 2**30 and more overflows float16 for sure
    assert all(b - a in (0, 1) for a, b in zip(skipped, skipped[1:]))
    assert skipped[-1] < steps - 5  # the scale came down and later steps went through
    assert trainer.scaler.scale == init / 2 ** skipped[-1]  # halved once per skipped step (no growth yet)
    taken = [r for r, before in zip(records, [0] + skipped) if r["skipped_steps"] == before]
    assert len(taken) == steps - skipped[-1] and all(0 < r["grad_norm"] < 100 for r in taken)
    assert {r["lr"] for r in records[:10]} == {records[0]["lr"]}  # the schedule waits while steps are skipped
    assert records[-1]["lr"] < records[0]["lr"] * 2  # ... and moved once steps were taken
    with open(tmp_path / "overflow" / "metrics.jsonl") as fh:
        lines = [
            json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}")) for line in fh
        ]
    assert lines[0]["grad_norm"] is None and lines[0]["skipped_steps"] == 1  # an overflowed norm is null


@pytest.mark.slow
def test_fsdp_cpu_offload_matches(tmp_path, cache):
    base = overrides(tmp_path, cache, "fsdp", **{"parallel.dp_shard": 2, "training.micro_batch_size": 2})
    plain, offload = run_jobs(
        2,
        [base, {**base, "run.dir": str(tmp_path / "offload"), "parallel.cpu_offload": "true"}],
        str(tmp_path),
    )
    assert max_rel(losses(offload), losses(plain)) < 1e-6


@pytest.fixture
def restore_determinism():
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_runs_are_bitwise_identical(tmp_path, cache, restore_determinism):
    runs = [train(tmp_path, cache, f"det{i}", **{"run.deterministic": "true"})[1] for i in range(2)]
    keys = ("loss", "grad_norm", "lr", "batch_hash")
    assert [[r[k] for k in keys] for r in runs[0]] == [[r[k] for k in keys] for r in runs[1]]
    assert torch.are_deterministic_algorithms_enabled()
