"""parallel.reduce_dtype on 2 gloo ranks: FSDP2 reducing bf16 compute's gradients in bf16 trains as the fp32
reduction does, to bf16's rounding of the summed gradients, and differs from it (the setting reaches FSDP2); HSDP
on 4 ranks is the slow case. Refused in one line where nothing is reduced by FSDP2."""

from __future__ import annotations

import pytest

from loom.config import build_config
from loom.config.errors import ConfigError
from loom.resolve import resolve
from tests.distributed.harness import losses, run_jobs
from tests.tiny import tiny_overrides


def job(tmp, name, **extra):
    return tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{
            "run.seed": 3,
            "training.steps": 4,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 2,
            "training.dtype": "bfloat16",
            "optimizer.warmup_steps": 1,
            "optimizer.lr": 3e-3,
            **extra,
        },
    )


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "world,layout",
    [
        (2, {"parallel.dp_shard": 2}),
        pytest.param(4, {"parallel.dp_shard": 2, "parallel.dp_replicate": 2}, marks=pytest.mark.slow),
    ],
    ids=["fsdp2", "hsdp2x2"],
)
def test_bf16_reduction_trains_as_the_fp32_one(tmp_path, world, layout):
    """Also: loom's gradient copy into the reduce-scatter buffer (parallel.fsdp_grad_copy triton; its reference
    on the CPU) trains as FSDP2's own, bit for bit; and so does FSDP2's own two-pass copy into the all-gather buffer
    against loom's one pass (parallel.fsdp_gather_copy: fused by default, so in every other job here)."""
    fp32, bf16, copied, gathered = run_jobs(
        world,
        [
            job(tmp_path, "fp32", **layout),
            job(tmp_path, "bf16", **layout, **{"parallel.reduce_dtype": "bfloat16"}),
            job(tmp_path, "copy", **layout, **{"parallel.fsdp_grad_copy": "triton"}),
            job(tmp_path, "gather", **layout, **{"parallel.fsdp_gather_copy": "torch"}),
        ],
        str(tmp_path),
    )
    assert losses(copied) == losses(fp32)
    assert losses(gathered) == losses(fp32)
    a, b = losses(fp32), losses(bf16)
    assert a[0] == b[0]  # the first forward precedes any reduction
    assert a != b  # the summed gradients rounded to bf16: FSDP2 got the setting
    assert max_rel(b, a) < 2e-2, (a, b)
    assert b[-1] < b[0]


def test_refused_where_fsdp2_reduces_nothing():
    def cfg(**extra):
        return build_config(
            None,
            {"training.dtype": "bfloat16", "parallel.reduce_dtype": "bfloat16", "run.device": "cpu", **extra},
        )

    with pytest.raises(
        ConfigError, match="parallel.reduce_dtype = 'bfloat16': .*needs training.dtype bfloat16"
    ):
        resolve(cfg(**{"training.dtype": "float32"}), 2, device="cpu")
    with pytest.raises(ConfigError, match="no parallel.cpu_offload"):
        resolve(cfg(**{"parallel.cpu_offload": "true"}), 1, device="cpu")
    with pytest.raises(ConfigError, match="this layout has none \\(dp_shard 1, dp_replicate 1 on 1 ranks"):
        resolve(cfg(), 1, device="cpu")
    with pytest.raises(ConfigError, match="DDP or one replica"):
        resolve(cfg(**{"parallel.dp_replicate": "2", "parallel.dp_shard": "1"}), 2, device="cpu")
    resolve(cfg(), 2, device="cpu")  # FSDP2 over 2 ranks
    with pytest.raises(
        ConfigError, match="parallel.fsdp_grad_copy = 'triton': replaces FSDP2's gradient copy"
    ):
        resolve(
            cfg(**{"parallel.reduce_dtype": "float32", "parallel.fsdp_grad_copy": "triton"}), 1, device="cpu"
        )
