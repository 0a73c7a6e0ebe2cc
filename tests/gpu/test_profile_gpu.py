"""``metrics.profile_steps`` on CUDA: the trace holds GPU kernels under the phase ranges, and the memory snapshot
of the window is written and loads (what pytorch.org/memory_viz reads); skipped without CUDA."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from loom.metrics.trace_summary import in_steps, launch_times
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


def test_profile_without_the_memory_history(tmp_path, capsys):
    """metrics.profile_memory = false: the trace only (a profile for timing: no allocation history slowing the
    profiled step), and the log line says why there is no snapshot."""
    small_run(tmp_path, steps=2, window="2:2")
    assert sorted(p.name for p in (tmp_path / "run" / "profile").iterdir()) == ["trace_rank0.json"]
    assert "no memory snapshot (metrics.profile_memory = false)" in capsys.readouterr().out
    assert not torch.cuda.memory._snapshot()["device_traces"][0]  # never recorded
    # the GPU drained before the recorded step: every kernel in the trace was launched inside it
    with open(tmp_path / "run" / "profile" / "trace_rank0.json") as fh:
        events = json.load(fh)["traceEvents"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    assert kernels and in_steps(kernels, steps, launch_times(events)) == kernels


def test_gpu_only_profile(tmp_path):
    """metrics.profile_host = false: kernels and their launch calls, no host op or range, and the step count beside
    them, which trace_summary divides by."""
    from loom.metrics.trace_summary import summarize

    small_run(tmp_path, steps=4, window="2:3", **{"metrics.profile_host": "false"})
    with open(tmp_path / "run" / "profile" / "trace_rank0.json") as fh:
        trace = json.load(fh)
    cats = {e.get("cat") for e in trace["traceEvents"]}
    assert "kernel" in cats and not cats & {"cpu_op", "user_annotation", "python_function"}
    assert trace["loom_profiled_steps"] == 2
    summary = summarize(trace)
    assert summary["steps"] == 2 and summary["gpu_busy_ms_per_step"] > 0
    cs = summary["compute_stream"]
    # one stream's kernels take no more than the GPU's busy time (to float rounding)
    assert cs["stream"] is not None and 0 < cs["kernel_ms_per_step"] <= summary["gpu_busy_ms_per_step"] + 1e-9
    assert cs["gap_ms_per_step"] < summary["gpu_span_ms_per_step"]


def small_run(tmp_path, steps: int, window: str, **extra) -> None:
    """A small CUDA run profiling ``window`` without the memory history."""
    run_one(
        {
            "run.dir": str(tmp_path / "run"),
            "run.device": "cuda",
            "training.steps": steps,
            "training.seq_len": 128,
            "training.global_batch_size": 4,
            "training.micro_batch_size": 4,
            "metrics.every": 1,
            "checkpoint.at_end": "false",
            "metrics.tensorboard": "false",
            "metrics.profile_steps": window,
            "metrics.profile_memory": "false",
            **extra,
        }
    )


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


def test_nvtx_ranges_on_cuda_are_balanced_per_thread_and_share_the_traces_names(tmp_path, monkeypatch):
    """metrics.nvtx on CUDA: the real torch.cuda.nvtx calls (wrapped, still made) push and pop in balance on each
    thread (block backward ranges on autograd's device thread), and the profiled window's trace holds the same
    phase names as user annotations (the profiler window opens both kinds of range)."""
    import threading

    from loom.metrics import nvtx

    assert nvtx.unavailable() == ""  # a CUDA build carries NVTX
    real_push, real_pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    stacks: dict[int, list[str]] = {}
    pushed: list[str] = []
    lock = threading.Lock()

    def push(name):
        with lock:
            stacks.setdefault(threading.get_ident(), []).append(name)
            pushed.append(name)
        return real_push(name)

    def pop():
        with lock:
            stack = stacks.get(threading.get_ident())
            assert stack, "range_pop with no range open on this thread"
            stack.pop()
        return real_pop()

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", pop)
    run_one(
        {
            "run.dir": str(tmp_path / "run"),
            "run.device": "cuda",
            "training.steps": 3,
            "training.seq_len": 128,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 4,
            "training.dtype": "bfloat16",
            "metrics.every": 1,
            "checkpoint.at_end": "false",
            "metrics.tensorboard": "false",
            "metrics.nvtx": "true",
            "metrics.profile_steps": "2:2",
        }
    )
    assert all(not s for s in stacks.values()), f"ranges left open: {stacks}"
    assert {
        "step 1",
        "step 3",
        "data_wait",
        "microbatch 1",
        "forward",
        "backward",
        "optimizer",
        "grad_norm",
    } <= set(pushed)
    assert {"block.0", "block.0.backward"} <= set(pushed)
    with open(tmp_path / "run" / "profile" / "trace_rank0.json") as fh:
        names = {e["name"] for e in json.load(fh)["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"forward", "backward", "optimizer", "block.0", "block.0.backward"} <= names & set(pushed)
