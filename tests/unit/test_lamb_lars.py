"""LAMB and LARS (loom.train.large_batch): steps against dense per-parameter references written here, a LAMB
step checked by hand from the paper's formula, the 1-D exclusions, and exact resume from a state dict."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from loom.config.sections import OptimizerConfig
from loom.train.large_batch import Lamb, Lars, whole_norms
from loom.train.optimizer import OptimizerParts


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))


def _grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    model(torch.randn(4, 6, generator=gen)).square().sum().backward()


def lamb_reference(params, grads, state, lr, b1, b2, eps, wd, exclude_1d):
    """LAMB, Algorithm 2 of You et al. 2019, one parameter at a time on dense tensors."""
    out = []
    for i, (w, g) in enumerate(zip(params, grads)):
        s = state.setdefault(i, {"t": 0, "m": torch.zeros_like(w), "v": torch.zeros_like(w)})
        s["t"] += 1
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        m_hat, v_hat = s["m"] / (1 - b1 ** s["t"]), s["v"] / (1 - b2 ** s["t"])
        excluded = exclude_1d and w.ndim < 2
        u = m_hat / (v_hat.sqrt() + eps) + (0.0 if excluded else wd) * w
        wn, un = torch.linalg.vector_norm(w), torch.linalg.vector_norm(u)
        trust = 1.0 if excluded or wn == 0 or un == 0 else wn / un
        out.append(w - lr * trust * u)
    return out


def lars_reference(params, grads, state, lr, mu, wd, eta, eps, exclude_1d):
    """LARS, Algorithm 1 of You et al. 2017 (eps in the denominator), one parameter at a time."""
    out = []
    for i, (w, g) in enumerate(zip(params, grads)):
        excluded = exclude_1d and w.ndim < 2
        wn, gn = torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)
        if excluded or wn == 0 or gn == 0:
            local, d = 1.0, g
        else:
            local, d = eta * wn / (gn + wd * wn + eps), g + wd * w
        buf = state.get(i, torch.zeros_like(w))
        state[i] = mu * buf + lr * local * d
        out.append(w - state[i])
    return out


@pytest.mark.parametrize("name", ["lamb", "lars"])
@pytest.mark.parametrize("exclude_1d", [True, False])
def test_steps_match_the_dense_reference(name, exclude_1d):
    cfg = OptimizerConfig(
        name=name,
        lr=0.05,
        weight_decay=0.1,
        betas=[0.9, 0.99],
        eps=1e-6,
        momentum=0.8,
        trust_coefficient=0.02,
        exclude_1d=exclude_1d,
    )
    model = _model()
    opt = OptimizerParts([model], cfg, torch.device("cpu"))
    ref = [p.detach().clone() for p in model.parameters()]
    state: dict = {}
    for step in range(4):
        _grads(model, step)
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step(0.5 if step == 2 else None)  # a clipping factor multiplies the gradients first
        opt.zero_grad()
        if step == 2:
            grads = [g * 0.5 for g in grads]
        if name == "lamb":
            ref = lamb_reference(ref, grads, state, cfg.lr, *cfg.betas, cfg.eps, cfg.weight_decay, exclude_1d)
        else:
            ref = lars_reference(
                ref,
                grads,
                state,
                cfg.lr,
                cfg.momentum,
                cfg.weight_decay,
                cfg.trust_coefficient,
                cfg.eps,
                exclude_1d,
            )
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-7)


def test_lamb_first_step_by_hand():
    """Step 1: m̂ = g and v̂ = g², so u = g / (|g| + eps) + wd·w elementwise. w = (3, 4), g = (1, -2), wd = 0:
    u ≈ (1, -1), trust = ||w|| / ||u|| = 5 / √2, w ← w − lr · 5/√2 · (1, -1)."""
    w = nn.Parameter(torch.tensor([[3.0, 4.0]], dtype=torch.float64))
    w.grad = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    Lamb([w], lr=0.1, betas=(0.9, 0.999), eps=1e-12, weight_decay=0.0).step()
    step = 0.1 * 5 / math.sqrt(2)
    torch.testing.assert_close(w.detach(), torch.tensor([[3.0 - step, 4.0 + step]], dtype=torch.float64))
    # with decay: u = (1, -1) + 0.5·(3, 4) = (2.5, 1), ||u|| = √7.25
    w = nn.Parameter(torch.tensor([[3.0, 4.0]], dtype=torch.float64))
    w.grad = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    Lamb([w], lr=0.1, eps=1e-12, weight_decay=0.5).step()
    u = torch.tensor([[2.5, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(
        w.detach(), torch.tensor([[3.0, 4.0]], dtype=torch.float64) - 0.1 * 5 / math.sqrt(7.25) * u
    )


def test_excluded_vectors_take_plain_steps():
    """With exclude_1d a bias steps by lr·u (no trust ratio, no decay); without it, by lr·||w||/||u||·u."""
    for exclude in (True, False):
        b = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        b.grad = torch.tensor([1.0, 1.0, -1.0])
        Lars([b], lr=0.1, momentum=0.0, weight_decay=0.0, trust_coefficient=1.0, exclude_1d=exclude).step()
        moved = torch.linalg.vector_norm(b.detach() - torch.tensor([0.5, -1.0, 2.0]))
        expected = (
            0.1 * math.sqrt(3) if exclude else 0.1 * math.sqrt(5.25) / (math.sqrt(3) + 1e-8) * math.sqrt(3)
        )
        assert abs(float(moved) - expected) < 1e-6


def test_zero_weight_takes_a_trust_ratio_of_one():
    w = nn.Parameter(torch.zeros(2, 2))
    w.grad = torch.ones(2, 2)
    Lamb([w], lr=0.1, eps=1e-12).step()
    torch.testing.assert_close(w.detach(), torch.full((2, 2), -0.1))


def test_whole_norms_of_plain_tensors():
    ts = [torch.tensor([3.0, 4.0]), torch.ones(2, 2), torch.zeros(3)]
    torch.testing.assert_close(whole_norms(ts), torch.tensor([5.0, 2.0, 0.0]))


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_resume_from_state_dict_is_exact(name):
    cfg = OptimizerConfig(name=name, lr=0.05, weight_decay=0.1)

    def run(steps, model, opt, start=0):
        for step in range(start, steps):
            _grads(model, step)
            opt.step()
            opt.zero_grad()

    full = _model()
    opt = OptimizerParts([full], cfg, torch.device("cpu"))
    run(5, full, opt)
    half = _model()
    opt = OptimizerParts([half], cfg, torch.device("cpu"))
    run(3, half, opt)
    saved_model, saved_opt = half.state_dict(), opt.optimizers[0].state_dict()
    resumed = _model(seed=9)
    resumed.load_state_dict(saved_model)
    opt = OptimizerParts([resumed], cfg, torch.device("cpu"))
    opt.optimizers[0].load_state_dict(saved_opt)
    run(5, resumed, opt, start=3)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_cuda_steps_match_cpu(name):
    cfg = OptimizerConfig(name=name, lr=0.05, weight_decay=0.1)
    out = []
    for device in ("cpu", "cuda"):
        model = _model().to(device)
        opt = OptimizerParts([model], cfg, torch.device(device))
        for step in range(3):
            gen = torch.Generator().manual_seed(100 + step)
            model(torch.randn(4, 6, generator=gen).to(device)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        out.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
