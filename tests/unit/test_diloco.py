"""DiLoCo's pieces in one process (loom.train.diloco): the fragments and their schedule, the outer Nesterov step
against torch.optim.SGD, the bf16 wire, the overlapped reductions (delayed rule, pending state across a checkpoint),
and the config rules. The multi-group behaviour is in tests/distributed/test_diloco.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from loom.config.errors import ConfigError
from loom.config.sections import ParallelConfig
from loom.methods import resolve
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
    stream = DiLoCo(
        [_model()],
        ParallelConfig(diloco_inner_steps=4, diloco_fragments=2),
        group=one_rank,
        n_groups=1,
        replica=0,
    )
    assert [(s, stream.due(s)) for s in range(1, 11) if stream.due(s)] == [
        (2, [0]),
        (4, [1]),
        (6, [0]),
        (8, [1]),
        (10, [0]),
    ]
    assert sorted(sum(stream.fragments, [])) == sorted(
        stream.params
    )  # every parameter in exactly one fragment
    assert stream.record(6) == {"inner_steps": 4, "groups": 1, "fragments": 2, "position": 0}
    assert (
        state_name("layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight")
        == "layers.0.attention.wq.weight"
    )


@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (1.0, 0.0)])
def test_outer_step_is_nesterov_sgd_on_the_pseudo_gradient(one_rank, lr, momentum):
    """One group: the averaged pseudo-gradient is the group's own, so each round is one step of torch's SGD with
    ``nesterov=True`` on the outer weights with gradient = outer - current."""
    model = _model()
    diloco = DiLoCo(
        [model],
        ParallelConfig(diloco_inner_steps=3, diloco_outer_lr=lr, diloco_outer_momentum=momentum),
        group=one_rank,
        n_groups=1,
        replica=0,
    )
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
    diloco = DiLoCo(
        [model],
        ParallelConfig(
            diloco_inner_steps=1, diloco_outer_lr=1.0, diloco_outer_momentum=0.0, diloco_bf16=True
        ),
        group=one_rank,
        n_groups=1,
        replica=0,
    )
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 + 1e-4 * torch.arange(p.numel()).reshape(p.shape))
    diloco.after_step(1)
    assert diloco.bytes_sent == 2 * sum(p.numel() for p in model.parameters())
    for s, p in zip(start, model.parameters()):
        delta = s - (s + 0.1 + 1e-4 * torch.arange(p.numel()).reshape(p.shape))
        torch.testing.assert_close(p.detach(), s - delta.bfloat16().float(), rtol=0, atol=1e-7)


def _perturb(model, step: int, rank: int = 0) -> None:
    """An inner step of replica ``rank``: any change of the weights, the same for a step in every run."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


def delayed_rule(inits, fragments, *, groups, steps, h, tau, alpha, lr, momentum, bf16=False):
    """Streaming DiLoCo with overlapped reductions, written out for ``groups`` replicas in one process: every
    replica's weights after each step, and the outer weights. Fragment f (a list of parameter indices) is reduced
    at steps (f + 1)·H / F + k·H; tau steps later the outer weights take one torch SGD (Nesterov) step with the
    averaged pseudo-gradient and each replica's weights become alpha·local + (1 - alpha)·outer."""
    outer = [t.detach().clone().requires_grad_() for t in inits]
    sgd = torch.optim.SGD(outer, lr=lr, momentum=momentum, nesterov=momentum > 0)
    local = [[t.detach().clone() for t in inits] for _ in range(groups)]
    offsets = [(f + 1) * h // len(fragments) for f in range(len(fragments))]
    waiting, history = {}, []
    for step in range(1, steps + 1):
        for r in range(groups):
            gen = torch.Generator().manual_seed(1000 * r + step)
            for t in local[r]:
                t.add_(0.1 * torch.randn(t.shape, generator=gen))
        for f in sorted(waiting):
            due, mean = waiting[f]
            if due != step:
                continue
            del waiting[f]
            for i, t in enumerate(outer):
                t.grad = mean[i] if i in fragments[f] else None
            sgd.step()
            for r in range(groups):
                for i in fragments[f]:
                    local[r][i] = alpha * local[r][i] + (1 - alpha) * outer[i].detach()
        for f, o in enumerate(offsets):
            if step >= o and (step - o) % h == 0:
                deltas = [[outer[i].detach() - local[r][i] for i in range(len(inits))] for r in range(groups)]
                if bf16:
                    total = [sum(d[i].bfloat16() for d in deltas).float() for i in range(len(inits))]
                else:
                    total = [sum(d[i] for d in deltas) for i in range(len(inits))]
                waiting[f] = (step + tau, [t / groups for t in total])
        history.append([[t.clone() for t in rep] for rep in local])
    return history, [t.detach() for t in outer]


@pytest.mark.parametrize("tau,alpha", [(1, 0.25), (3, 0.0)])
def test_overlap_applies_the_delayed_rule(one_rank, tau, alpha):
    """One group, 2 fragments, H = 4: with tau = 1 one reduction is in flight at a time, with tau = 3 two are (a
    fragment is launched while the other's is pending)."""
    model = _model()
    inits = [p.detach().clone() for p in model.parameters()]
    cfg = ParallelConfig(
        diloco_inner_steps=4,
        diloco_fragments=2,
        diloco_overlap_steps=tau,
        diloco_overlap_alpha=alpha,
        diloco_outer_lr=0.7,
        diloco_outer_momentum=0.9,
    )
    diloco = DiLoCo([model], cfg, group=one_rank, n_groups=1, replica=0)
    fragments = [[list(diloco.params).index(k) for k in names] for names in diloco.fragments]
    history, outer = delayed_rule(
        inits, fragments, groups=1, steps=13, h=4, tau=tau, alpha=alpha, lr=0.7, momentum=0.9
    )
    in_flight = []
    for step in range(1, 14):
        _perturb(model, step)
        diloco.after_step(step)
        in_flight.append(len(diloco.in_flight))
        for got, want in zip(model.parameters(), history[step - 1][0]):
            torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-7)
    for k, want in zip(diloco.params, outer):
        torch.testing.assert_close(diloco.outer[k], want, rtol=1e-6, atol=1e-7)
    assert max(in_flight) == (1 if tau == 1 else 2)
    assert diloco.syncs == 6 and diloco.bytes_sent == 3 * 4 * sum(p.numel() for p in model.parameters())


def test_overlap_schedule_and_record(one_rank):
    diloco = DiLoCo(
        [_model()],
        ParallelConfig(diloco_inner_steps=4, diloco_fragments=2, diloco_overlap_steps=3),
        group=one_rank,
        n_groups=1,
        replica=0,
    )
    assert [diloco.pending_at(s) for s in (1, 2, 4, 5, 6, 7, 8)] == [
        [],
        [(0, 5)],
        [(0, 5), (1, 7)],
        [(1, 7)],
        [(0, 9), (1, 7)],
        [(0, 9)],
        [(0, 9), (1, 11)],
    ]
    assert diloco.record(6) == {
        "inner_steps": 4,
        "groups": 1,
        "fragments": 2,
        "position": 0,
        "overlap_steps": 3,
        "pending": [[0, 9], [1, 7]],
    }


def test_overlap_pending_reductions_survive_a_checkpoint(one_rank):
    """A run stopped while reductions are in flight and continued by a fresh DiLoCo from what a checkpoint holds
    (each group's weights, the outer weights and momentum, ``diloco_pending``) ends bit for bit as the
    uninterrupted run."""
    cfg = ParallelConfig(diloco_inner_steps=4, diloco_fragments=2, diloco_overlap_steps=3, diloco_bf16=True)

    def run(model, diloco, steps):
        for step in steps:
            _perturb(model, step)
            diloco.after_step(step)

    full = _model()
    run(full, DiLoCo([full], cfg, group=one_rank, n_groups=1, replica=0), range(1, 14))
    first = _model()
    stopped = DiLoCo([first], cfg, group=one_rank, n_groups=1, replica=0)
    run(first, stopped, range(1, 7))  # after step 6 both fragments' reductions are in flight
    assert sorted(f for f, r in stopped.in_flight.items() if r.work is not None) == [0, 1]
    saved = {
        "weights": {k: v.clone() for k, v in first.state_dict().items()},
        **{
            key: {k: v.clone() for k, v in part.items()}
            for key, part in stopped.shared_state(first.state_dict()).items()
        },
    }
    assert saved["diloco_pending"]["0.weight"].abs().sum() > 0
    second = _model()
    resumed = DiLoCo([second], cfg, group=one_rank, n_groups=1, replica=0)
    state = resumed.shared_state(second.state_dict())  # what DCP loads into
    second.load_state_dict(saved["weights"])
    for key in ("model", "diloco_momentum", "diloco_pending"):
        for k, t in state[key].items():
            t.copy_(saved[key][k])
    resumed.resumed(6)
    assert {f: r.due for f, r in resumed.in_flight.items()} == {0: 9, 1: 7}
    run(second, resumed, range(7, 14))
    for a, b in zip(full.parameters(), second.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"parallel.dp_replicate": 1}, "parallel.diloco_inner_steps"),
        ({"parallel.ep": 2, "model.moe_experts": 4}, "parallel.diloco_inner_steps"),
        ({"metrics.noise_scale": "true"}, "parallel.diloco_inner_steps"),
        ({"parallel.cpu_offload": "true"}, "parallel.diloco_inner_steps"),
        ({"parallel.diloco_fragments": 5}, "parallel.diloco_fragments"),
        ({"parallel.diloco_overlap_steps": 4}, "parallel.diloco_overlap_steps"),
        (
            {"parallel.diloco_inner_steps": 0, "parallel.diloco_overlap_steps": 1},
            "parallel.diloco_overlap_steps",
        ),
    ],
)
def test_config_rules(tmp_path, overrides, field):
    cfg = tiny_config(tmp_path, **{"parallel.dp_replicate": 2, "parallel.diloco_inner_steps": 4, **overrides})
    with pytest.raises(ConfigError) as err:
        resolve(cfg, 4)
    assert err.value.field == field


def test_a_valid_layout_resolves_without_replicate_reduction(tmp_path):
    cfg = tiny_config(
        tmp_path, **{"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "parallel.diloco_inner_steps": 4}
    )
    dims = resolve(cfg, 4).dims
    assert dims.diloco and not dims.hsdp_enabled and not dims.replicate_reduces and dims.fsdp_applied
    assert dims.describe().startswith("DiLoCo(FSDP)")
