"""``metrics.nvtx``: a training run pushes its NVTX ranges (step, data wait, micro-batch, forward, backward,
each block's forward and backward, optimizer, grad norm, the loss all-reduce, validation, checkpoint save) and
pops every one, nested as the step is; off, it pushes none; a PyTorch that cannot emit NVTX (a CPU-only build)
is a one-line config error."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from loom.config import ConfigError
from loom.methods import resolve
from loom.metrics import nvtx
from loom.train.trainer import Trainer
from tests.tiny import tiny_config


def record(monkeypatch) -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
    """Patch torch.cuda.nvtx's push and pop: -> (the pushes as (name, the names open around it), the ranges
    open now); a pop with nothing open fails the test at once."""
    pushed: list[tuple[str, tuple[str, ...]]] = []
    stack: list[str] = []

    def push(name):
        pushed.append((name, tuple(stack)))
        stack.append(name)
        return len(stack) - 1

    def pop():
        assert stack, "range_pop with no range open"
        stack.pop()
        return len(stack)

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", pop)
    return pushed, stack


def test_a_training_run_pushes_and_pops_its_ranges_in_balance(tmp_path, monkeypatch):
    pushed, open_now = record(monkeypatch)
    cfg = tiny_config(
        tmp_path / "run",
        tmp_path / "cache",
        **{
            "training.steps": 3,
            "metrics.nvtx": "true",
            "training.eval_every": 2,
            "training.eval_batches": 1,
            "training.eval_at_end": "false",  # validation at step 2 only
            "checkpoint.every": 2,
            "metrics.profile_steps": "3:3",
        },
    )  # the profiled step: both kinds of range
    Trainer(cfg).fit()
    assert not open_now, f"ranges left open: {open_now}"
    counts = Counter(name for name, _ in pushed)
    accum = 4  # global batch 8 / micro-batch 2 on one rank
    want = {
        "step 1": 1,
        "step 2": 1,
        "step 3": 1,
        "data_wait": 3,
        "optimizer": 3,
        "grad_norm": 3,
        "forward": 3 * accum,
        "backward": 3 * accum,
        "validation": 1,
        "checkpoint_save": 1,
        **{f"microbatch {i}": 3 for i in range(accum)},
    }
    assert {k: counts[k] for k in want} == want
    assert counts["allreduce.data_sum"] >= 3
    within = {name: around for name, around in pushed}  # the last push of each name
    # the blocks' ranges: forward in training and validation, backward inside each backward phase
    assert counts["block.0.backward"] == counts["block.1.backward"] == 3 * accum
    assert counts["block.0"] == counts["block.1"] > 3 * accum
    assert within["block.0.backward"][-1] == "backward" and within["block.1"][-1] == "forward"
    assert within["forward"][-1] == "microbatch 3" and within["microbatch 3"][-1] == "step 3"
    assert within["grad_norm"][-2:] == ("step 3", "optimizer")
    assert within["data_wait"] == within["step 1"] == ()  # the data wait comes before its step


def test_no_ranges_when_off(tmp_path, monkeypatch):
    pushed, _ = record(monkeypatch)
    nvtx.enable(True)  # the run turns them off again (one run may follow another in a process)
    Trainer(tiny_config(tmp_path / "run", tmp_path / "cache", **{"training.steps": 1})).fit()
    assert pushed == [] and not nvtx.enabled()


def test_no_nvtx_in_this_pytorch_is_a_config_error(monkeypatch):
    def missing(name):
        raise RuntimeError("NVTX functions not installed. Are you sure you have a CUDA build?")

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", missing)
    with pytest.raises(ConfigError) as err:
        resolve(tiny_config(**{"metrics.nvtx": "true"}), 1)
    assert err.value.field == "metrics.nvtx" and "NVTX functions not installed" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of PyTorch carries NVTX")
def test_a_cpu_only_build_refuses_metrics_nvtx():
    with pytest.raises(ConfigError, match="metrics.nvtx"):
        resolve(tiny_config(**{"metrics.nvtx": "true"}), 1)
