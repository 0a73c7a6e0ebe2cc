"""GPU integration: the debug model trains on CUDA in every precision; skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.harness import run_one

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def job(tmp_path, **extra):
    d = {
        "run.dir": str(tmp_path / "run"),
        "run.device": "cuda",
        "training.steps": 6,
        "training.seq_len": 128,
        "training.global_batch_size": 8,
        "training.micro_batch_size": 4,
        "optimizer.warmup_steps": 1,
        "metrics.every": 1,
        "checkpoint.at_end": "false",
        "metrics.tensorboard": "false",
    }
    d.update(extra)
    return d


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_trains_on_cuda(tmp_path, dtype):
    records = run_one(job(tmp_path, **{"training.dtype": dtype}))
    ls = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in ls) and ls[-1] < ls[0]
    assert records[-1]["mem_gib"] > 0
    assert records[-1]["mfu"] is not None  # known device (H100 / H200)


def test_bf16_close_to_fp32_on_cuda(tmp_path):
    fp32 = [r["loss"] for r in run_one(job(tmp_path / "a", **{"training.dtype": "float32"}))]
    bf16 = [r["loss"] for r in run_one(job(tmp_path / "b", **{"training.dtype": "bfloat16"}))]
    assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) < 2e-2


@pytest.mark.parametrize("ac", ["op", "matmuls"])
def test_compile_and_op_checkpointing_on_cuda(tmp_path, ac):
    eager = [r["loss"] for r in run_one(job(tmp_path / "e", **{"training.dtype": "bfloat16"}))]
    comp = [
        r["loss"]
        for r in run_one(
            job(
                tmp_path / "c",
                **{
                    "training.dtype": "bfloat16",
                    "training.compile": "true",
                    "training.activation_checkpointing": ac,
                },
            )
        )
    ]
    assert max(abs(a - b) / a for a, b in zip(eager, comp)) < 1e-2


def test_flash_attention_under_op_checkpointing_on_cuda(tmp_path):
    """loom's attention op is saved, not recomputed, under op-level checkpointing (eager and compiled): same
    losses as without checkpointing."""
    flash = {"training.dtype": "bfloat16", "model.attention": "flash"}
    plain = [r["loss"] for r in run_one(job(tmp_path / "p", **flash))]
    for name, extra in (("op", {}), ("op-compiled", {"training.compile": "true"})):
        got = [
            r["loss"]
            for r in run_one(
                job(tmp_path / name, **flash, **extra, **{"training.activation_checkpointing": "op"})
            )
        ]
        assert max(abs(a - b) / a for a, b in zip(plain, got)) < 1e-2, name


def test_moe_trains_on_cuda_close_to_fp32(tmp_path):
    """debug_moe with loom's fused kernels in bf16 (SwiGLU experts through the Triton gate) against fp32 with
    the references: the same routing decisions up to rounding, so the curves stay close."""
    moe = {"model.flavor": "debug_moe", "training.activation_checkpointing": "op"}
    fp32 = [
        r["loss"]
        for r in run_one(
            job(tmp_path / "a", **moe, **{"training.dtype": "float32", "model.fused_swiglu": "false"})
        )
    ]
    bf16 = [
        r["loss"]
        for r in run_one(
            job(tmp_path / "b", **moe, **{"training.dtype": "bfloat16", "model.fused_swiglu": "true"})
        )
    ]
    assert all(math.isfinite(x) for x in bf16) and bf16[-1] < bf16[0]
    assert max(abs(a - b) / a for a, b in zip(fp32, bf16)) < 3e-2


def test_moe_compiled_matches_eager_on_cuda(tmp_path):
    """Per-block torch.compile (fullgraph) of MoE blocks: the grouped GEMM path has static shapes."""
    moe = {"model.flavor": "debug_moe", "training.dtype": "bfloat16"}
    eager = [r["loss"] for r in run_one(job(tmp_path / "e", **moe))]
    comp = [r["loss"] for r in run_one(job(tmp_path / "c", **moe, **{"training.compile": "true"}))]
    assert max(abs(a - b) / a for a, b in zip(eager, comp)) < 1e-2
    # compiled checkpointed MoE blocks (the forward must not change module state; matmuls keeps the grouped GEMMs')
    for ac in ("full", "op", "matmuls"):
        recs = run_one(
            job(tmp_path / ac, **moe, **{"training.compile": "true", "training.activation_checkpointing": ac})
        )
        assert max(abs(a - r["loss"]) / a for a, r in zip(eager, recs)) < 1e-2
        assert all(r["moe_balance"] is None for r in recs)  # compiled runs do not report it


def test_compiled_op_level_checkpointing_keeps_what_its_policy_says():
    """Compiled blocks keep what the op-level policies say, which equal losses alone would not show: per block,
    no checkpointing keeps more than ``matmuls``, which keeps more than ``op`` (what a few-block 1B-shape model
    holds under autocast, bench.diag.float8_saved; at 3B on one H200: 945, 529 and 337 MiB)."""
    from bench.diag.float8_saved import held_per_block

    held = {
        ac: held_per_block("1B", 2048, "none", 3, 1, autocast=True, ac=ac)["held_per_block_mib"]
        for ac in ("none", "matmuls", "op")
    }
    assert held["none"] > held["matmuls"] > held["op"] > 0, held
