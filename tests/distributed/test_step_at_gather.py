"""optimizer.step_at_gather on 2 gloo ranks: FSDP2 units updated at their next gather train bit for bit as the updates
at the step's end, and their checkpoints (saved after every held update has run) resume to the same losses. Refused
in one line where the updates could not wait or something else reads the weights between steps."""

from __future__ import annotations

import pytest

from loom.config import build_config
from loom.config.errors import ConfigError
from loom.resolve import check_machine, resolve
from tests.distributed.harness import losses, run_jobs
from tests.tiny import tiny_overrides


def job(tmp, name, **extra):
    return tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{
            "run.seed": 5,
            "parallel.dp_shard": 2,
            "optimizer.implementation": "triton",  # loom's AdamW (its reference on the CPU)
            "optimizer.lr": 3e-3,
            "checkpoint.every": 2,
            **extra,
        },
    )


def test_updates_at_the_gather_train_and_resume_as_at_the_step_end(tmp_path):
    held = {"optimizer.step_at_gather": "true"}
    plain, deferred, resumed = run_jobs(
        2,
        [
            job(tmp_path, "plain"),
            job(tmp_path, "held", **held),
            job(
                tmp_path,
                "resumed",
                **held,
                **{"checkpoint.resume": f"{tmp_path}/held/checkpoints/step_00000002"},
            ),
        ],
        str(tmp_path),
    )
    assert losses(deferred) == losses(plain)
    assert losses(resumed) == losses(plain)[2:]
    assert losses(plain)[-1] < losses(plain)[0]


def test_refused_where_updates_cannot_wait_for_a_gather():
    def check(world, device="cpu", **extra):
        cfg = build_config(None, {"run.device": device, "optimizer.step_at_gather": "true", **extra})
        resolve(cfg, world, device=device)
        check_machine(cfg, device)

    with pytest.raises(
        ConfigError, match="optimizer.step_at_gather = True: .*gathers none \\(dp_shard 1 on 1"
    ):
        check(1, **{"optimizer.implementation": "triton"})
    with pytest.raises(ConfigError, match="training.objective = 'dpo': not with optimizer.step_at_gather"):
        check(2, **{"optimizer.implementation": "triton", "training.objective": "dpo"})
    with pytest.raises(
        ConfigError, match="optimizer.implementation = 'fused': not with optimizer.step_at_gather"
    ):
        check(2, **{"optimizer.implementation": "fused"})
    with pytest.raises(ConfigError, match="parallel.tp = 2: not with optimizer.step_at_gather"):
        check(4, **{"optimizer.implementation": "triton", "parallel.tp": 2})
    with pytest.raises(ConfigError, match="picks on CUDA only \\(this run: cpu\\)"):
        check(2)
    check(2, device="cuda")  # auto is loom's AdamW there
