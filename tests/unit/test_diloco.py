"""DiLoCo's pieces in one process (loom.train.diloco): the fragments and their schedule, the outer Nesterov step
against torch.optim.SGD, the bf16 wire, and the config rules. The multi-group behaviour is in
tests/distributed/test_diloco.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from loom.config.errors import ConfigError
from loom.config.sections import ParallelConfig
from loom.resolve import resolve
from loom.train.diloco import DiLoCo, fragment_split, state_name
from tests.tiny import tiny_config


@pytest.fixture
def one_rank(tmp_path):
    own = not dist.is_initialized()  # a one-process group left by an earlier in-process test serves as well
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield dist.group.WORLD
    if own:
        dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_fragments_are_contiguous_balanced_and_never_empty():
    assert fragment_split([1] * 10, 3) == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert fragment_split([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert fragment_split([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]
    assert fragment_split([5, 5, 5], 3) == [[0], [1], [2]]
    assert fragment_split([1, 100, 1, 1, 1, 100], 3) == [[0, 1], [2, 3, 4], [5]]


def test_schedule_one_fragment_and_streaming(one_rank):
    plain = DiLoCo([_model()], ParallelConfig(diloco_inner_steps=4), group=one_rank, n_groups=1, replica=0)
    assert [s for s in range(1, 13) if plain.due(s)] == [4, 8, 12]
    stream = DiLoCo([_model()], ParallelConfig(diloco_inner_steps=4, diloco_fragments=2), group=one_rank,
                    n_groups=1, replica=0)
    assert [(s, stream.due(s)) for s in range(1, 11) if stream.due(s)] == [(2, [0]), (4, [1]), (6, [0]), (8, [1]),
                                                                            (10, [0])]
    assert sorted(sum(stream.fragments, [])) == sorted(stream.params)  # every parameter in exactly one fragment
    assert stream.record(6) == {"inner_steps": 4, "groups": 1, "fragments": 2, "position": 0}
    assert state_name("layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight") == \
        "layers.0.attention.wq.weight"


@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (1.0, 0.0)])
def test_outer_step_is_nesterov_sgd_on_the_pseudo_gradient(one_rank, lr, momentum):
    """One group: the averaged pseudo-gradient is the group's own, so each round is one step of torch's SGD with
    ``nesterov=True`` on the outer weights with gradient = outer - current."""
    model = _model()
    diloco = DiLoCo([model], ParallelConfig(diloco_inner_steps=3, diloco_outer_lr=lr, diloco_outer_momentum=momentum),
                    group=one_rank, n_groups=1, replica=0)
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    sgd = torch.optim.SGD(ref, lr=lr, momentum=momentum, nesterov=momentum > 0)
    gen = torch.Generator().manual_seed(1)
    for round_ in range(3):
        with torch.no_grad():  # the inner steps of a round: any change of the weights
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen))
        for r, p in zip(ref, model.parameters()):
            r.grad = r.detach() - p.detach()
        for step in range(3 * round_ + 1, 3 * round_ + 4):
            diloco.after_step(step)
        sgd.step()
        for r, p in zip(ref, model.parameters()):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-6)
    assert diloco.syncs == 3
    assert diloco.bytes_sent == 3 * 4 * sum(p.numel() for p in model.parameters())


def test_bf16_wire_halves_the_bytes_and_rounds_the_pseudo_gradient(one_rank):
    model = _model()
    diloco = DiLoCo([model], ParallelConfig(diloco_inner_steps=1, diloco_outer_lr=1.0, diloco_outer_momentum=0.0,
                                            diloco_bf16=True), group=one_rank, n_groups=1, replica=0)
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 + 1e-4 * torch.arange(p.numel()).reshape(p.shape))
    diloco.after_step(1)
    assert diloco.bytes_sent == 2 * sum(p.numel() for p in model.parameters())
    for s, p in zip(start, model.parameters()):
        delta = (s - (s + 0.1 + 1e-4 * torch.arange(p.numel()).reshape(p.shape)))
        torch.testing.assert_close(p.detach(), s - delta.bfloat16().float(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("overrides,field", [
    ({"parallel.dp_replicate": 1}, "parallel.diloco_inner_steps"),
    ({"parallel.ep": 2, "model.moe_experts": 4}, "parallel.diloco_inner_steps"),
    ({"metrics.noise_scale": "true"}, "parallel.diloco_inner_steps"),
    ({"parallel.cpu_offload": "true"}, "parallel.diloco_inner_steps"),
    ({"parallel.diloco_fragments": 5}, "parallel.diloco_fragments"),
])
def test_config_rules(tmp_path, overrides, field):
    cfg = tiny_config(tmp_path, **{"parallel.dp_replicate": 2, "parallel.diloco_inner_steps": 4, **overrides})
    with pytest.raises(ConfigError) as err:
        resolve(cfg, 4)
    assert err.value.field == field


def test_a_valid_layout_resolves_without_replicate_reduction(tmp_path):
    cfg = tiny_config(tmp_path, **{"parallel.dp_replicate": 2, "parallel.dp_shard": 2,
                                   "parallel.diloco_inner_steps": 4})
    dims = resolve(cfg, 4).dims
    assert dims.diloco and not dims.hsdp_enabled and not dims.replicate_reduces and dims.fsdp_applied
    assert dims.describe().startswith("DiLoCo(FSDP)")
