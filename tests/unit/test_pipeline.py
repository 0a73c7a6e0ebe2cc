"""Pipeline planning logic: stage split, stage placement, stage modules, bubble fractions, config rules."""

from __future__ import annotations

import copy

import pytest
import torch

from loom.config import ConfigError, build_config
from loom.config.sections import ParallelConfig
from loom.methods import check_config
from loom.models.llama import FLAVORS, Llama
from loom.parallel.dims import ParallelDims
from loom.parallel.pipeline import (
    balanced_counts,
    build_stage,
    head_cost,
    layer_cost,
    split_layers,
    stage_ids,
    stage_rank,
    theoretical_bubble,
)
from loom.resolve import check_model


def test_balanced_split_counts_the_head():
    args = FLAVORS["1B"]
    layers = split_layers(args, 2, 2048)
    assert [len(s) for s in layers] == [10, 6]  # the head costs about four blocks
    assert sum(layers, []) == list(range(args.n_layers))
    costs = [
        len(layers[0]) * layer_cost(args, 2048),
        len(layers[1]) * layer_cost(args, 2048) + head_cost(args),
    ]
    assert max(costs) / min(costs) < 1.1


def test_balanced_split_is_optimal_on_small_cases():
    import itertools

    for n, s, first, last in [(7, 3, 0.5, 2.0), (8, 4, 0.0, 0.0), (5, 5, 1.0, 1.0), (9, 2, 0.0, 6.0)]:
        got = balanced_counts(n, s, 1.0, first, last)
        assert sum(got) == n and min(got) >= 1

        def worst(c):
            return max(c[i] + (first if i == 0 else 0) + (last if i == s - 1 else 0) for i in range(s))

        best = min(worst(c) for c in itertools.product(range(1, n + 1), repeat=s) if sum(c) == n)
        assert worst(got) == best


def test_manual_split_uneven_and_errors():
    args = FLAVORS["debug"].with_(n_layers=5, vocab_size=256)
    assert split_layers(args, 3, 32, [1, 3, 1]) == [[0], [1, 2, 3], [4]]
    assert split_layers(args, 2, 32, [0, 5]) == [[], [0, 1, 2, 3, 4]]  # the first stage: embedding only
    with pytest.raises(ConfigError, match="stage 1 would hold nothing"):
        check_config(build_config(None, overrides(parallel__pp=3, parallel__pp_layers_per_stage="[2, 0, 3]")))
    with pytest.raises(ConfigError, match="each stage needs a layer"):
        check_model(ParallelDims.from_config(ParallelConfig(pp=6), 6), args, ParallelConfig(pp=6))


@pytest.mark.parametrize(
    "schedule,per_rank", [("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 3), ("zbv", 2)]
)
def test_every_stage_has_one_rank(schedule, per_rank):
    pp = 4
    held = sorted(s for r in range(pp) for s in stage_ids(r, pp, per_rank, schedule))
    assert held == list(range(pp * per_rank))
    for r in range(pp):
        assert all(stage_rank(s, pp, schedule) == r for s in stage_ids(r, pp, per_rank, schedule))
    if schedule == "zbv":
        assert stage_ids(0, pp, 2, schedule) == [0, 7]  # V: rank 0 holds the first and the last stage


def test_stage_modules_keep_names_and_the_tied_weight():
    args = FLAVORS["debug"].with_(n_layers=4, vocab_size=256, tie_embeddings=True)
    with torch.device("meta"):
        model = Llama(args)
    first, middle, last = (
        build_stage(model, [0], True, False),
        build_stage(model, [1, 2], False, False),
        build_stage(model, [3], False, True),
    )
    names = {n for m in (first, middle, last) for n, _ in m.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}  # same names: checkpoints reshard by name
    assert (
        list(middle.layers.keys()) == ["1", "2"] and middle.tok_embeddings is None and middle.output is None
    )
    # the head's weight is held as tok_embeddings.weight
    assert last.output.weight is last.tok_embeddings.weight
    untied = build_stage(Llama(args.with_(tie_embeddings=False)).to("meta"), [3], False, True)
    assert untied.tok_embeddings is None


def test_stage_forward_embeds_ids_and_passes_hidden_states():
    args = FLAVORS["debug"].with_(n_layers=2, vocab_size=64)
    torch.manual_seed(0)
    model = Llama(args)
    first, last = build_stage(model, [0], True, False), build_stage(model, [1], False, True)
    tokens = torch.randint(0, 64, (2, 8))
    h = first(tokens)
    assert h.shape == (2, 8, args.dim) and h.is_floating_point()
    torch.testing.assert_close(last(h), model(tokens))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 16), (8, 8)])
def test_bubble_of_one_stage_schedules_is_the_classic_formula(schedule, p, m):
    assert theoretical_bubble(schedule, p, m, 1) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs"])
@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 2)])
def test_bubble_of_interleaved_schedules_shrinks_by_v(schedule, p, m, v):
    assert theoretical_bubble(schedule, p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))


def test_zero_bubble_schedules_beat_1f1b():
    for p, m in [(2, 4), (4, 8)]:
        classic = theoretical_bubble("1f1b", p, m, 1)
        for schedule in ("interleaved_zb", "zbv", "dualpipev"):
            assert 0 <= theoretical_bubble(schedule, p, m, 2) < classic / 2


def overrides(**kw):
    return {k.replace("__", "."): str(v) for k, v in kw.items()}


def test_config_rules_for_pipeline_fields():
    cfg = build_config(None, overrides(parallel__pp=2, parallel__pp_layers_per_stage="[3, 1]"))
    assert cfg.parallel.pp_layers_per_stage == [3, 1]
    with pytest.raises(ConfigError, match="whole numbers"):
        build_config(None, overrides(parallel__pp=2, parallel__pp_layers_per_stage="[1.5, 0.5]"))
    with pytest.raises(ConfigError, match="runs one stage per rank"):
        check_config(
            build_config(None, overrides(parallel__pp_schedule="1f1b", parallel__pp_virtual_stages=2))
        )
    with pytest.raises(ConfigError, match="model.init_from"):
        check_config(build_config(None, overrides(model__n_layers=4, model__init_from="/")))


class _Scale(torch.autograd.Function):
    """A Python autograd node inside each stage, as our custom ops make."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(dim=(0, 1))


class _Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x):  # (B, S, D)
        return self.lin(_Scale.apply(x, self.w))


def test_split_backward_keeps_each_chunks_graph_until_its_weight_pass(tmp_path):
    """zbv with both stages on one rank: the input pass of a chunk holds its graph, the weight pass frees
    it, and the gradients match plain autograd on the same micro-batches."""
    import torch.distributed as dist

    from loom.parallel.pipeline import BusyClock, PipelinePlan, build_schedule

    torch.manual_seed(0)
    stages = [_Block(8), _Block(8)]
    reference = copy.deepcopy(stages)
    x = torch.randn(4, 3, 8)
    own = not dist.is_initialized()  # a one-process group left by an earlier in-process test serves as well
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        plan = PipelinePlan("zbv", pp=1, per_rank=2, layers=[[0], [1]], local=[0, 1])
        schedule = build_schedule(
            plan,
            stages,
            dist.group.WORLD,
            torch.device("cpu"),
            4,
            lambda out, _: out.pow(2).mean() / 4,
            BusyClock(torch.device("cpu")),
        )
        seen = []
        for stage in schedule._stages:
            weight_pass = stage.backward_weight_one_chunk

            def spy(chunk, *args, _stage=stage, _pass=weight_pass, **kwargs):
                seen.append(chunk in _stage.held_graphs)
                return _pass(chunk, *args, **kwargs)

            stage.backward_weight_one_chunk = spy
        schedule.step(x, target=torch.zeros(4, 3, 8))
        assert seen and all(seen)  # the split path ran and held each chunk's graph at its weight pass
        assert all(not s.held_graphs for s in schedule._stages)  # and let go of every one
    finally:
        if own:
            dist.destroy_process_group()
    loss = sum(reference[1](reference[0](mb)).pow(2).mean() / 4 for mb in x.chunk(4))
    loss.backward()
    for got, want in zip(stages, reference):
        for p, q in zip(got.parameters(), want.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def test_schedule_names_are_the_config_choices():
    """loom.parallel.pipeline names the schedules; the config field allows exactly those."""
    import dataclasses

    from loom.parallel.pipeline import SCHEDULES, SINGLE_STAGE, SPLIT_BACKWARD, V_SHAPED

    field = next(f for f in dataclasses.fields(ParallelConfig) if f.name == "pp_schedule")
    assert set(field.metadata["choices"]) == set(SCHEDULES)
    assert set(SINGLE_STAGE) | set(V_SHAPED) | set(SPLIT_BACKWARD) <= set(SCHEDULES)
