"""OptimizerParts: the gradient factor (clipping, loss-scale removal) is applied the same whether it is
folded into the fused AdamW kernel or applied as a separate pass."""

import pytest
import torch
from torch import nn

from loom.config.sections import OptimizerConfig
from loom.train.optimizer import OptimizerParts


def _parts(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5)), nn.Linear(5, 3, bias=False)]


def _train(impl: str, factors) -> list[torch.Tensor]:
    parts = _parts()
    opt = OptimizerParts(parts, OptimizerConfig(lr=0.05, implementation=impl), torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for factor in factors:
        x = torch.randn(4, 6, generator=gen)
        parts[1](parts[0](x)).square().sum().backward()
        opt.step(factor)
        opt.zero_grad()
    return [p.detach().clone() for part in parts for p in part.parameters()]


@pytest.mark.parametrize("factors", [[None, None], [0.5, torch.tensor(0.25)], [torch.tensor(1e-3), 1.0]])
def test_folded_factor_matches_separate_pass(factors):
    fused = OptimizerParts(_parts(), OptimizerConfig(implementation="fused"), torch.device("cpu"))
    assert fused.fold_grad_factor
    assert not OptimizerParts(
        _parts(), OptimizerConfig(implementation="foreach"), torch.device("cpu")
    ).fold_grad_factor
    for a, b in zip(_train("fused", factors), _train("foreach", factors)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_factor_changes_the_step():  # Adam ignores a constant factor; a changing one shows
    a = _train("fused", [1.0, 0.01, 1.0])
    b = _train("fused", [None, None, None])
    assert any((x - y).abs().max() > 1e-4 for x, y in zip(a, b))


def test_no_fold_when_a_parameter_is_shared():
    shared = nn.Linear(5, 5)
    opt = OptimizerParts(
        [shared, nn.Sequential(shared)], OptimizerConfig(implementation="fused"), torch.device("cpu")
    )
    assert not opt.fold_grad_factor
