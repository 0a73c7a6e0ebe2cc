"""``metrics.profile_steps``: the window parses or is a config error; a profiled run writes a trace with the
step, phase and block ranges, and only for the window's steps; an unprofiled run writes nothing."""

from __future__ import annotations

import json

import pytest

from loom.config import ConfigError, build_config
from loom.config.load import profile_window
from loom.config.sections import MetricsConfig
from loom.methods import check_config
from loom.train.trainer import Trainer
from tests.tiny import tiny_config


@pytest.mark.parametrize(
    "text,window", [("", None), ("2:3", (2, 3)), (" 1 : 1 ", (1, 1)), ("10:20", (10, 20))]
)
def test_window_parses(text, window):
    assert profile_window(MetricsConfig(profile_steps=text)) == window


@pytest.mark.parametrize("text", ["3", "3:", ":3", "0:2", "3:2", "a:b", "1.5:2", "-1:2", "1:2:3", "²:3"])
def test_bad_window_is_a_config_error(text):
    with pytest.raises(ConfigError, match="metrics.profile_steps.*allowed: '' \\(off\\) or 'A:B'"):
        profile_window(MetricsConfig(profile_steps=text))


def test_window_past_the_last_step_is_a_config_error():
    with pytest.raises(ConfigError, match=r"metrics.profile_steps = '4:6'.*<= training.steps \(5\)"):
        check_config(build_config(None, {"training.steps": "5", "metrics.profile_steps": "4:6"}))


def test_gpu_only_profile_needs_cuda_and_a_window():
    """metrics.profile_host = false records the GPU alone: refused on the CPU (nothing would be recorded), and as a
    field that does nothing without metrics.profile_steps."""
    from loom.resolve import resolve

    cpu = build_config(
        None, {"run.device": "cpu", "metrics.profile_steps": "1:1", "metrics.profile_host": "false"}
    )
    with pytest.raises(ConfigError, match=r"metrics.profile_host = False.*on the cpu: allowed true here"):
        resolve(cpu, 1)
    with pytest.raises(
        ConfigError, match=r"metrics.profile_host.*does nothing without metrics.profile_steps"
    ):
        check_config(build_config(None, {"metrics.profile_host": "false"}))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def run(run_dir, cache, **extra) -> Trainer:
    trainer = Trainer(
        tiny_config(run_dir, cache, **{"training.steps": 3, "training.micro_batch_size": 4, **extra})
    )
    trainer.fit()
    return trainer


def test_profiled_steps_write_a_trace_with_phase_and_block_ranges(tmp_path, cache, capsys):
    trainer = run(tmp_path / "run", cache, **{"metrics.profile_steps": "2:3"})
    folder = tmp_path / "run" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["trace_rank0.json"]  # no memory snapshot on a CPU
    with open(folder / "trace_rank0.json") as fh:
        trace = json.load(fh)
    events = trace["traceEvents"]
    assert trace["loom_profiled_steps"] == 2  # the count a GPU-only trace (no step ranges) is read by
    ranges = sorted((e for e in events if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    counts = {name: sum(e["name"] == name for e in ranges) for name in {e["name"] for e in ranges}}
    # 2 steps x 2 micro-batches of forward/backward, one optimizer phase per step, 2 blocks
    assert {k: counts.get(k) for k in ("ProfilerStep#2", "ProfilerStep#3", "optimizer")} == {
        "ProfilerStep#2": 1,
        "ProfilerStep#3": 1,
        "optimizer": 2,
    }
    for name in ("forward", "backward", "block.0", "block.1", "block.0.backward", "block.1.backward"):
        assert counts.get(name) == 4, (name, counts)
    assert "ProfilerStep#1" not in counts
    # each block's backward range lies inside a backward phase, the later block's first
    backward = [e for e in ranges if e["name"] == "backward"]
    b1, b0 = ([e for e in ranges if e["name"] == f"block.{i}.backward"] for i in (1, 0))
    for phase, late, early in zip(backward, b1, b0):
        assert phase["ts"] <= late["ts"] <= late["ts"] + late["dur"] <= early["ts"]
        assert early["ts"] + early["dur"] <= phase["ts"] + phase["dur"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("profile:")]
    assert len(lines) == 1 and str(folder) in lines[0] and "steps 2-3" in lines[0]
    assert "no memory snapshot (CUDA only" in lines[0]
    for block in trainer.parts[0].layers.values():  # the hooks are gone after the window
        assert not block._forward_hooks and not block._forward_pre_hooks


def test_no_profile_folder_when_off(tmp_path, cache):
    trainer = run(tmp_path / "run", cache)
    assert not (tmp_path / "run" / "profile").exists()
    assert trainer.profiler.window is None and not trainer.profiler.active
