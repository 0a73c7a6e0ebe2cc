"""training.cuda_graphs: where graph replay of the compiled blocks cannot run is a config error naming the field,
and GRPO and PPO resolve with it (tests/gpu/test_cuda_graphs_gpu.py runs the graphs; tests/unit/test_rollout_graphs.py
the rollouts' fixed widths and the engine's graph-free blocks)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from loom.config import ConfigError, build_config
from loom.config.sections import ParallelConfig
from loom.data.loader import MicroBatch
from loom.methods import check_config, resolve
from loom.metrics.profile import StepProfiler
from loom.parallel.dims import ParallelDims
from loom.train.steps import LocalStep, StepContext
from tests.unit.test_noise_scale import D, Regression, sample


def cfg(**over):
    base = {"training.compile": "true", "training.cuda_graphs": "true"}
    return build_config(None, {**base, **{k: str(v) for k, v in over.items()}})


@pytest.mark.parametrize(
    "over, says",
    [
        ({"training.compile": "false"}, "needs training.compile true"),
        ({"training.activation_checkpointing": "full"}, "allowed none | op | matmuls"),
        ({"training.objective": "rloo"}, "tested for grpo and ppo only): allowed false"),
        ({"training.objective": "online_dpo"}, "tested for grpo and ppo only): allowed false"),
        ({"training.objective": "grpo", "grpo.max_staleness": 1}, "allowed with grpo.max_staleness 0"),
        ({"training.objective": "grpo", "training.compile": "false"}, "needs training.compile true"),
        ({"parallel.cpu_offload": "true"}, "parallel.cpu_offload"),
    ],
)
def test_what_graphs_cannot_take_is_refused(over, says):
    with pytest.raises(ConfigError, match="training.cuda_graphs") as err:
        check_config(
            cfg(**over)
        )  # the features' rules and the method's (a method's own refusal is in loom.methods)
    assert says in str(err.value)


def test_more_than_one_process_is_refused():
    with pytest.raises(ConfigError, match="got 2 ranks"):
        resolve(cfg(**{"run.device": "cpu"}), 2, device="cuda")


def test_the_cpu_is_refused():
    from loom.resolve import check_device

    with pytest.raises(ConfigError, match="needs a CUDA device"):
        check_device(cfg(**{"run.device": "cpu"}))


def test_one_process_with_op_checkpointing_resolves():
    run = resolve(
        cfg(
            **{
                "training.activation_checkpointing": "op",
                "training.global_batch_size": 8,
                "training.micro_batch_size": 8,
            }
        ),
        1,
        device="cuda",
    )
    assert run.dims.world_size == 1


@pytest.mark.parametrize("objective", ["grpo", "ppo"])
def test_grpo_and_ppo_resolve_with_graphs(objective):
    """Their rows are padded to fixed widths and the engine generates without training's graphs: accepted on one
    CUDA process; the layout's refusal still holds."""
    over = {
        "training.objective": objective,
        "training.global_batch_size": 16,
        "training.micro_batch_size": 16,
        "grpo.group_size": 8,
    }
    check_config(cfg(**over))
    assert resolve(cfg(**over), 1, device="cuda").dims.world_size == 1
    with pytest.raises(ConfigError, match="got 2 ranks"):
        resolve(cfg(**over), 2, device="cuda")


def test_gradients_under_cuda_graphs_are_added_to_the_kept_tensors():
    """training.cuda_graphs' backward (LocalStep._backward): each micro-batch's gradients land apart and are added to
    the tensors kept between steps in one multi-tensor add. Over two steps of three micro-batches: the plain path's
    sums, in the same tensor objects (the optimizer and the graphs hold their addresses), a frozen weight untouched."""
    gen = torch.Generator().manual_seed(3)

    def model_and_step(graphs: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, 4).double(), nn.Tanh(), nn.Linear(4, 1, bias=False).double())
        model[0].bias.requires_grad_(False)
        ctx = StepContext(
            ParallelDims.from_config(ParallelConfig(), 1),
            torch.device("cpu"),
            contextlib.nullcontext,
            False,
            False,
            StepProfiler(None, "", 0, torch.device("cpu")),
            cuda_graphs=graphs,
        )
        if graphs:  # as the engine keeps them
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        return model, LocalStep(model, [model], Regression(), ctx)

    (plain, plain_step), (graphed, graphed_step) = model_and_step(False), model_and_step(True)
    kept = [p.grad for p in graphed.parameters()]
    for _ in range(2):
        x, y = sample(torch.ones(D, dtype=torch.float64), 12, gen)
        mbs = [MicroBatch(x[i * 4 : (i + 1) * 4], y[i * 4 : (i + 1) * 4], None, None) for i in range(3)]
        for step in (plain_step, graphed_step):
            step.step(mbs, torch.tensor(0.5, dtype=torch.float64))
    for p, q, k in zip(plain.parameters(), graphed.parameters(), kept):
        assert q.grad is k
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12)
        else:
            assert p.grad is None and q.grad is None
