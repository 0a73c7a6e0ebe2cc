"""DiLoCo with overlapped outer reductions on two GPUs over NCCL (2 replica groups of one GPU): the reductions run
on their own NCCL group (created on every rank, bound device), and a run saved while a reduction is in flight resumes
to the uninterrupted run's losses. Skipped without 2 GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

LOOM = [sys.executable, "-c", "from loom.cli.main import entry; entry()", "train"]
CONFIG = {
    "run.device": "cuda",
    "run.seed": 7,
    "run.deterministic": "true",
    "training.steps": 8,
    "training.seq_len": 128,
    "training.global_batch_size": 8,
    "training.micro_batch_size": 4,
    "optimizer.warmup_steps": 1,
    "metrics.every": 1,
    "checkpoint.every": 3,
    "checkpoint.keep": 0,
    "metrics.tensorboard": "false",
    "parallel.dp_replicate": 2,
    "parallel.dp_shard": 1,
    "parallel.diloco_inner_steps": 4,
    "parallel.diloco_fragments": 2,
    "parallel.diloco_overlap_steps": 2,
    "parallel.diloco_bf16": "true",
}


def train(run_dir, **extra) -> list[tuple]:
    args = [f"--{k}={v}" for k, v in {**CONFIG, "run.dir": str(run_dir), **extra}.items()]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "NCCL_NVLS_ENABLE": "0"}
    proc = subprocess.run(
        LOOM + ["--nproc-per-node", "2"] + args, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [(r["step"], r["loss"], r["diloco_bytes"]) for r in map(json.loads, fh)]


def test_overlapped_reductions_resume_mid_overlap_on_two_gpus(tmp_path):
    """H = 4, 2 fragments (launched at steps 2, 4, 6, 8), tau = 2: the checkpoint of step 3 holds fragment 0's
    reduction (launched at 2, due at 4) and the resumed steps 4-8 give the same losses and bytes."""
    full = train(tmp_path / "full")
    with open(tmp_path / "full" / "checkpoints" / "step_00000003" / "trainer_state.json") as fh:
        assert json.load(fh)["diloco"]["pending"] == [[0, 4]]
    resumed = train(
        tmp_path / "resumed",
        **{"checkpoint.resume": str(tmp_path / "full" / "checkpoints" / "step_00000003")},
    )
    assert [r[0] for r in resumed] == [4, 5, 6, 7, 8]
    for (s, a, bytes_a), (_, b, bytes_b) in zip(full[3:], resumed):
        assert abs(a - b) <= 1e-6 * abs(a), (s, a, b)
        assert bytes_a - full[2][2] == bytes_b  # a resumed run counts its own reductions
    assert all(torch.isfinite(torch.tensor(r[1])) for r in full)
