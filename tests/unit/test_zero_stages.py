"""parallel.zero: how each stage maps onto the data-parallel degrees (loom.parallel.dims.zero_degrees), the
contradictions refused, ZeRO-1's partition of the parameters (loom.train.zero), and the planner's model state per
stage (the per-stage formula of loom.plan.memory.stage_state, which reproduces the ZeRO paper's Figure 1 with its
byte counts)."""

from __future__ import annotations

import pytest
import torch

from loom.config import build_config
from loom.config.errors import ConfigError
from loom.config.sections import ParallelConfig
from loom.methods import resolve
from loom.models.llama.model import Llama
from loom.parallel.dims import ParallelDims
from loom.plan.hardware import GPUS
from loom.plan.memory import stage_state, zero_model_state
from loom.plan.planner import candidates, estimate, model_args
from loom.train.zero import partition
from tests.tiny import tiny_config


def dims(world=4, **over) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**over), world)


@pytest.mark.parametrize(
    "zero,replicate,shard,raf", [(0, 4, 1, True), (1, 4, 1, True), (2, 1, 4, False), (3, 1, 4, True)]
)
def test_each_stage_sets_the_degrees(zero, replicate, shard, raf):
    d = dims(zero=zero)
    assert (d.dp_replicate, d.dp_shard, d.zero) == (replicate, shard, zero)
    assert d.reshard_after_forward == raf or not d.fsdp_enabled
    assert d.shard_optimizer == (zero == 1)


def test_unset_stage_is_what_the_degrees_were():
    assert dims().zero == 3  # dp_shard -1: FSDP2 over every rank
    assert dims(reshard_after_forward=False).zero == 2
    assert dims(dp_replicate=4, dp_shard=1).zero == 0
    assert dims(world=1).zero == 0
    # stages with other degrees: replicas beside tp, HSDP shards over dp_shard only
    assert (dims(world=8, zero=1, tp=2).dp_replicate, dims(world=8, zero=3, dp_replicate=2).dp_shard) == (
        4,
        4,
    )


@pytest.mark.parametrize(
    "over,field",
    [
        ({"zero": 0, "dp_shard": 2}, "parallel.dp_shard"),
        ({"zero": 1, "dp_shard": 4}, "parallel.dp_shard"),
        ({"zero": 1, "cp": 2}, "parallel.zero"),
        ({"zero": 2, "dp_replicate": 4, "dp_shard": 1}, "parallel.zero"),
    ],
)
def test_contradictions_are_config_errors(over, field):
    with pytest.raises(ConfigError) as e:
        dims(**over)
    assert e.value.field == field


@pytest.mark.parametrize("field,value", [("parallel.tp", 2), ("parallel.cpu_offload", "true")])
def test_zero_1_refuses_what_it_cannot_shard(tmp_path, field, value):
    cfg = tiny_config(tmp_path, **{"parallel.zero": 1, field: value})
    with pytest.raises(ConfigError) as e:
        resolve(cfg, 4, device="cpu")
    assert e.value.field == field


def test_partition_is_balanced_by_size():
    sizes = [100, 7, 50, 50, 3, 90, 10, 10]
    owner = partition(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(3)]
    assert sorted(set(owner)) == [0, 1, 2] and sum(loads) == sum(sizes)
    assert max(loads) - min(loads) <= max(sizes)
    assert owner == partition(sizes, 3)  # every rank decides the same
    assert partition(sizes, 1) == [0] * len(sizes)


def _cfg(**over):
    base = {
        "model.flavor": "debug",
        "model.n_layers": 6,
        "training.dtype": "bfloat16",
        "training.global_batch_size": 16,
        "training.micro_batch_size": 1,
        "training.seq_len": 256,
    }
    return build_config(None, {k: str(v) for k, v in {**base, **over}.items()})


def test_plan_state_per_stage_is_the_stage_formula():
    """`loom plan`'s weights / gradients / optimizer state per GPU for each parallel.zero on 8 GPUs follow
    stage_state with loom's bytes (4, 4, 8: fp32 weights that are their own master copy); FSDP2 keeps all three
    sharded between uses at stage 2 as at 3, and holds every block's gathered weights from forward to backward.
    The same formula with the paper's bytes (2, 2, 12) is Figure 1 (tests/unit/test_zero_memory.py)."""
    profiles: dict = {}  # activations traced once per kind (with and without FSDP2)
    est = {z: estimate(_cfg(**{"parallel.zero": z}), 8, GPUS["H100"], profiles) for z in range(4)}
    params = est[0].memory.weights / 4  # replicated fp32 weights: every parameter
    with torch.device("meta"):
        assert params == sum(p.numel() for p in Llama(model_args(_cfg())).parameters())
    for z, e in est.items():
        want = stage_state(params, 8, 3 if z >= 2 else z, 4, 4, 8)
        assert (e.memory.weights, e.memory.gradients, e.memory.optimizer) == pytest.approx(want), z
        assert e.layout["zero"] == z
    assert est[2].memory.gathered > est[3].memory.gathered
    assert est[1].memory.total < est[0].memory.total
    assert "zero1" in est[1].describe() and "zero2" in est[2].describe()
    assert sum(stage_state(7.5e9, 64, 1, 2, 2, 12)) == zero_model_state(7.5e9, 64, 1)


def test_search_considers_the_stages():
    layouts = candidates(_cfg(**{"parallel.zero": 3}), 4, max_tp=1)
    stages = {
        (c.parallel.zero, c.parallel.reshard_after_forward)
        for c in layouts
        if c.parallel.pp == c.parallel.cp == 1
    }
    assert {(-1, True), (-1, False), (1, True)} <= stages
    assert {ParallelDims.from_config(c.parallel, 4).zero for c in layouts} == {0, 1, 2, 3}


def test_fsdp_prefetch_auto_is_explicit_under_expert_parallelism_only():
    """parallel.fsdp_prefetch: auto prefetches explicitly where every MoE block waits on the host (ep > 1)."""
    from loom.parallel.parallelize import explicit_prefetch

    dense = ParallelDims.from_config(ParallelConfig(dp_shard=4), 4)
    ep = ParallelDims.from_config(ParallelConfig(dp_shard=4, ep=2), 4)
    assert [explicit_prefetch(s, dense) for s in ("auto", "explicit", "implicit")] == [False, True, False]
    assert [explicit_prefetch(s, ep) for s in ("auto", "explicit", "implicit")] == [True, True, False]
