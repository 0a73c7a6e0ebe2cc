"""``metrics.profile_steps`` on CUDA: the trace holds GPU kernels under the phase ranges, and the memory snapshot
of the window is written and loads (what pytorch.org/memory_viz reads); skipped without CUDA."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from tests.distributed.harness import run_one

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_profile_writes_a_cuda_trace_and_a_memory_snapshot(tmp_path, capsys):
    run_one(
        {
            "run.dir": str(tmp_path / "run"),
            "run.device": "cuda",
            "training.steps": 4,
            "training.seq_len": 128,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 4,
            "training.dtype": "bfloat16",
            "optimizer.warmup_steps": 1,
            "metrics.every": 1,
            "checkpoint.at_end": "false",
            "metrics.tensorboard": "false",
            "metrics.profile_steps": "2:3",
        }
    )
    folder = tmp_path / "run" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["memory_snapshot_rank0.pickle", "trace_rank0.json"]
    with open(folder / "trace_rank0.json") as fh:
        events = json.load(fh)["traceEvents"]
    names = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert {
        "ProfilerStep#2",
        "ProfilerStep#3",
        "forward",
        "backward",
        "optimizer",
        "block.0",
        "block.0.backward",
    } <= names
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA activity was recorded
    with open(folder / "memory_snapshot_rank0.pickle", "rb") as fh:
        snapshot = pickle.load(fh)
    assert snapshot["segments"] and any(snapshot["device_traces"])  # allocations and their history
    assert "memory_snapshot_rank<r>.pickle (pytorch.org/memory_viz)" in capsys.readouterr().out
    assert not torch.cuda.memory._snapshot()["device_traces"][0]  # recording stopped after the window


def test_profile_of_moe_under_activation_checkpointing_trains_on(tmp_path, capsys):
    """PyTorch's CUDA memory history broke the backward of MoE blocks under activation checkpointing (torch 2.11):
    the profile then writes the trace only, says why, and training goes on."""
    run_one(
        {
            "run.dir": str(tmp_path / "run"),
            "run.device": "cuda",
            "model.flavor": "debug_moe",
            "training.steps": 3,
            "training.dtype": "bfloat16",
            "training.activation_checkpointing": "full",
            "metrics.every": 1,
            "checkpoint.at_end": "false",
            "metrics.tensorboard": "false",
            "metrics.profile_steps": "2:2",
        }
    )
    assert sorted(p.name for p in (tmp_path / "run" / "profile").iterdir()) == ["trace_rank0.json"]
    out = capsys.readouterr().out
    assert "no memory snapshot (skipped: PyTorch's memory history" in out and "step 3/3" in out
