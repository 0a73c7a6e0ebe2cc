"""LR schedules: linear warmup, then cosine / linear / wsd / constant, reaching min_lr_ratio x peak on the
last step."""

from __future__ import annotations

import math

import pytest
import torch

from loom.config.sections import OptimizerConfig
from loom.train.schedule import build_scheduler, lr_factor

TOTAL, WARM, LO = 111, 10, 0.1  # decay spans steps 10..110: 100 intervals, so step 60 is the middle


def cfg(schedule: str, **kw) -> OptimizerConfig:
    return OptimizerConfig(schedule=schedule, warmup_steps=WARM, min_lr_ratio=LO, **kw)


def f(schedule: str, step: int, **kw) -> float:
    return lr_factor(step, TOTAL, cfg(schedule, **kw))


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
def test_warmup_is_linear_and_ends_at_the_peak(schedule):
    assert f(schedule, 0) == pytest.approx(1 / (WARM + 1))  # the first step does not run at LR 0
    assert f(schedule, 4) == pytest.approx(5 / (WARM + 1))
    assert f(schedule, WARM - 1) == pytest.approx(WARM / (WARM + 1))
    assert f(schedule, WARM) == pytest.approx(1.0)  # end of warmup: the peak


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_middle_and_last_step(schedule):
    assert f(schedule, 60) == pytest.approx(LO + (1 - LO) / 2)  # halfway, for both shapes
    assert f(schedule, TOTAL - 1) == pytest.approx(LO)  # last step: min_lr_ratio x peak
    steps = [f(schedule, s) for s in range(WARM, TOTAL)]
    assert all(a > b for a, b in zip(steps, steps[1:]))  # strictly decreasing


def test_cosine_and_linear_shapes():
    assert f("cosine", 35) == pytest.approx(LO + (1 - LO) * 0.5 * (1 + math.cos(math.pi / 4)))
    assert f("linear", 35) == pytest.approx(LO + (1 - LO) * 0.75)


def test_wsd_stable_then_decays_to_the_floor():
    # decay_fraction 0.2 of 111 steps: the last 22 steps (89..110) decay; 10..88 stay at the peak
    assert [f("wsd", s, decay_fraction=0.2) for s in (WARM, 50, 88)] == [1.0, 1.0, 1.0]
    assert f("wsd", 89, decay_fraction=0.2) == pytest.approx(LO + (1 - LO) * 21 / 22)
    assert f("wsd", 99, decay_fraction=0.2) == pytest.approx(LO + (1 - LO) * 11 / 22)
    assert f("wsd", TOTAL - 1, decay_fraction=0.2) == pytest.approx(LO)


def test_constant_stays_at_the_peak():
    assert [f("constant", s) for s in (WARM, 60, TOTAL - 1)] == [1.0, 1.0, 1.0]


def test_no_warmup_starts_at_the_peak():
    c = OptimizerConfig(schedule="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(0, 5, c) == 1.0
    assert lr_factor(4, 5, c) == pytest.approx(0.0, abs=1e-12)


def test_scheduler_drives_the_optimizer():
    """What the trainer sees: the LR of step s is read before scheduler.step() s times."""
    peak = 3e-3
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    c = OptimizerConfig(schedule="linear", warmup_steps=2, min_lr_ratio=0.1, lr=peak)
    sched = build_scheduler(opt, 6, c)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [peak / 3, 2 * peak / 3, peak, peak * 0.7, peak * 0.4, peak * 0.1]
    assert lrs == pytest.approx(expected)
