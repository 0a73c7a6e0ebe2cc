"""The gradient noise scale (loom.train.noise_scale) on linear regression with Gaussian inputs and noise, where it
is known: per-sample loss ½(xᵀw − y)², x ~ N(0, I_d), y = xᵀw* + σε, δ = w − w*. The per-sample gradient is
x(xᵀδ − σε), so G = δ and Σ = (|δ|² + σ²) I + δδᵀ: B_simple = tr(Σ) / |G|² = (d(|δ|² + σ²) + |δ|²) / |δ|²."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from loom.config.sections import ParallelConfig
from loom.data.loader import MicroBatch
from loom.metrics.profile import StepProfiler
from loom.parallel.dims import ParallelDims
from loom.train.noise_scale import NoiseScale, NoiseScaleProbe, unbiased_terms
from loom.train.steps import LocalStep, StepContext

D, SIGMA = 10, 1.0


def problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(D, generator=gen, dtype=torch.float64)
    delta = torch.randn(D, generator=gen, dtype=torch.float64)
    delta /= delta.norm()  # |δ| = 1
    exact = (D * (1 + SIGMA**2) + 1) / 1.0
    return w_star, delta, exact


def sample(w_star, n, gen):
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)  # (n, D)
    y = x @ w_star + SIGMA * torch.randn(n, generator=gen, dtype=torch.float64)  # (n,)
    return x, y


def test_unbiased_terms_invert_the_expected_norms():
    """E|G_B|² = |G|² + tr(Σ)/B at two batch sizes gives back |G|² and tr(Σ) exactly."""
    g2, trace = 2.0, 30.0
    got = unbiased_terms(g2 + trace / 8, g2 + trace / 64, 8, 64)
    assert got == pytest.approx((g2, trace))


def test_recovers_the_known_noise_scale_from_sampled_gradients():
    w_star, delta, exact = problem()
    w = w_star + delta
    gen = torch.Generator().manual_seed(1)
    est = NoiseScale(decay=0.998)
    b_small, b_big = 8, 64
    for _ in range(3000):
        x, y = sample(w_star, b_big, gen)
        per_sample = x * (x @ w - y)[:, None]  # (B, D) per-sample gradients
        small, big = per_sample[:b_small].mean(0), per_sample.mean(0)
        est.update(small.square().sum(), big.square().sum(), b_small, b_big)
    assert abs(est.value() - exact) / exact < 0.1


def test_non_finite_or_degenerate_steps_leave_the_estimate():
    est = NoiseScale()
    assert est.value() is None
    est.update(3.0, 2.0, 4, 16)
    before = est.value()
    est.update(float("inf"), 2.0, 4, 16)
    est.update(3.0, 2.0, 16, 16)  # no small batch: nothing to compare
    assert est.value() == before


class Regression:
    """An objective: the summed squared error of a linear model over a micro-batch of (x, y) rows."""

    loss_in_forward = False

    def count(self, mb):
        return torch.tensor(float(mb.inputs.shape[0]))

    def forward(self, model, mb, positions):
        return model(mb.inputs).squeeze(-1)  # (B,)

    def loss(self, pred, y):
        return 0.5 * (pred - y).square().sum()


def test_probe_through_the_step_recovers_it():
    """The trainer's path: a LocalStep over 4 micro-batches of 8 rows with the step's gradient scale, the first
    micro-batch's norm read in between, the step's norm after; the linear model stays at w (no update)."""
    w_star, delta, exact = problem()
    model = nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    dims = ParallelDims.from_config(ParallelConfig(), 1)
    ctx = StepContext(
        dims,
        torch.device("cpu"),
        contextlib.nullcontext,
        False,
        False,
        StepProfiler(None, "", 0, torch.device("cpu")),
    )
    steps = LocalStep(model, [model], Regression(), ctx)
    probe = NoiseScaleProbe.build(steps, dims, Regression())
    probe.estimator = NoiseScale(decay=0.998)
    gen = torch.Generator().manual_seed(2)
    accum, b = 4, 8
    for _ in range(2500):
        x, y = sample(w_star, accum * b, gen)
        mbs = [MicroBatch(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b], None, None) for i in range(accum)]
        n = torch.tensor(float(accum * b))
        result = probe.step(mbs, dims.dp_size * dims.cp / n, 1.0)  # the trainer's grad_scale (loss scale 1)
        probe.observe(steps.grad_norm(), n)
        expected = 0.5 * (model(x).squeeze(-1) - y).square().sum()
        torch.testing.assert_close(result.loss_sum, expected.float())  # the step's loss: both parts
        model.zero_grad(set_to_none=True)
    assert abs(probe.value() - exact) / exact < 0.1


def test_training_with_the_probe_keeps_the_losses_and_logs_it(tmp_path):
    """metrics.noise_scale splits each step's micro-batches in two: the same losses, and a positive estimate."""
    from tests.distributed.harness import run_one
    from tests.tiny import tiny_overrides

    def run(name, **extra):
        return run_one(tiny_overrides(tmp_path / name, tmp_path / "cache", **{"training.steps": 6, **extra}))

    plain, probed = run("plain"), run("probed", **{"metrics.noise_scale": "true"})
    # the same gradients; the logged loss sums its micro-batches in another order
    assert [r["loss"] for r in probed] == pytest.approx([r["loss"] for r in plain], rel=1e-6)
    assert "noise_scale" not in plain[-1]
    assert all(r["noise_scale"] is None or r["noise_scale"] > 0 for r in probed)
    assert probed[-1]["noise_scale"] > 0


def test_needs_accumulation():
    from loom.config.errors import ConfigError
    from loom.methods import resolve
    from tests.tiny import tiny_config

    with pytest.raises(ConfigError, match="metrics.noise_scale.*2 or more micro-batches"):
        resolve(
            tiny_config(**{"metrics.noise_scale": "true", "training.micro_batch_size": 8}), 1, device="cpu"
        )
