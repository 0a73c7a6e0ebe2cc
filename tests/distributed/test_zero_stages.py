"""parallel.zero on 2 gloo ranks: every stage gives the single process's losses (fp32, 1e-5 relative, with
accumulation), a checkpoint written under one stage resumes under another, and with zero >= 1 each rank holds
about 1/2 of the optimizer state."""

from __future__ import annotations

import functools
import os

import pytest

from tests.distributed.harness import losses, run_fn, run_jobs
from tests.tiny import tiny_overrides

STEPS, GLOBAL, SAVE_AT = 4, 8, 2


def job(tmp, name, mb=2, **extra):
    return tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{
            "run.seed": 5,
            "training.steps": STEPS,
            "training.global_batch_size": GLOBAL,
            "training.micro_batch_size": mb,
            "optimizer.warmup_steps": 2,
            "optimizer.lr": 3e-3,
            **extra,
        },
    )


def max_rel(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def ckpt(tmp, name):
    return os.path.join(tmp, name, "checkpoints", f"step_{SAVE_AT:08d}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    return losses(run_jobs(1, [job(tmp, "single")], str(tmp))[0])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One group: the four stages (2 micro-batches a rank: accumulation), saving at step 2, then the stage-1
    checkpoint resumed under stage 3 and the stage-3 one under stage 1; ZeRO-1 with PyTorch's fused AdamW and
    loom's Triton AdamW (its reference on CPU), which fold clipping into the step and skip on the device; stages 2
    and 3 with explicit prefetch."""
    tmp = tmp_path_factory.mktemp("w2")
    save = {"checkpoint.every": SAVE_AT, "checkpoint.keep": 0}
    jobs = [job(tmp, f"zero{z}", **{"parallel.zero": z, **save}) for z in range(4)]
    jobs += [
        job(tmp, "z1_to_z3", **{"parallel.zero": 3, "checkpoint.resume": ckpt(tmp, "zero1")}),
        job(tmp, "z3_to_z1", **{"parallel.zero": 1, "checkpoint.resume": ckpt(tmp, "zero3")}),
    ]
    jobs += [
        job(tmp, f"zero1_{impl}", **{"parallel.zero": 1, "optimizer.implementation": impl})
        for impl in ("fused", "triton")
    ]
    # FSDP2's gathers issued one unit ahead (parallel.fsdp_prefetch explicit; auto is implicit without EP)
    jobs += [
        job(tmp, f"zero{z}_prefetch", **{"parallel.zero": z, "parallel.fsdp_prefetch": "explicit"})
        for z in (2, 3)
    ]
    res = run_jobs(2, jobs, str(tmp))
    names = [f"zero{z}" for z in range(4)] + ["z1_to_z3", "z3_to_z1", "zero1_fused", "zero1_triton"]
    names += ["zero2_prefetch", "zero3_prefetch"]
    return dict(zip(names, res))


@pytest.mark.parametrize("stage", ["0", "1", "2", "3", "1_fused", "1_triton", "2_prefetch", "3_prefetch"])
def test_stage_equals_single_process(reference, two_ranks, stage):
    assert max_rel(losses(two_ranks[f"zero{stage}"]), reference) < 1e-5
    assert reference[-1] < reference[0]  # it trains


@pytest.mark.parametrize("name", ["z1_to_z3", "z3_to_z1"])
def test_checkpoint_resumes_under_another_stage(reference, two_ranks, name):
    got = two_ranks[name]["records"]
    assert [r["step"] for r in got] == list(range(SAVE_AT + 1, STEPS + 1))
    assert max_rel([r["loss"] for r in got], reference[SAVE_AT:]) < 1e-5


def _state_bytes(rank, world, tmp, stages):
    """Bytes of this rank's optimizer state tensors after one step, per stage, and the model's parameter count."""
    import torch
    import torch.distributed as dist

    from loom.config import build_config
    from loom.runtime.env import init_distributed
    from loom.train.trainer import Trainer

    out = {}
    for z in stages:
        over = job(
            tmp,
            f"mem{z}",
            **{
                "parallel.zero": z,
                "training.steps": 1,
                "optimizer.warmup_steps": 0,
                "checkpoint.at_end": "false",
            },
        )
        trainer = Trainer(
            build_config(None, {k: str(v) for k, v in over.items()}), env=init_distributed("cpu", "gloo")
        )
        trainer.fit()
        local = sum(
            t.to_local().numel() * t.element_size()
            if hasattr(t, "to_local")
            else t.numel() * t.element_size()
            for opt in trainer.optimizer.optimizers
            for state in opt.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        every = [None] * world
        dist.all_gather_object(every, local)
        out[z] = {
            "ranks": every,
            "params": sum(p.numel() for p in trainer.params),
            "largest": max(p.numel() for p in trainer.params),
        }
        del trainer
    return out


def test_optimizer_state_per_rank_is_a_half(tmp_path):
    """AdamW's moments (8 bytes a parameter) over 2 ranks: ZeRO-1 splits by whole parameter (each rank within
    one largest parameter of half), FSDP2 by rows (each rank within a row of half, FSDP2 pads dim 0)."""
    got = run_fn(2, functools.partial(_state_bytes, tmp=str(tmp_path), stages=(1, 3)), str(tmp_path))
    total = 8 * got["1"]["params"]  # fp32 exp_avg and exp_avg_sq of every parameter: each rank's at zero 0
    for z, slack in (("1", 8 * got["1"]["largest"]), ("3", total / 50)):
        ranks = got[z]["ranks"]
        assert abs(sum(ranks) - total) <= slack / 2 and all(abs(r - total / 2) <= slack / 2 for r in ranks), (
            z,
            ranks,
        )
        assert max(ranks) < 0.6 * total


@pytest.mark.exhaustive  # stages x accumulation on 4 ranks (pytest --exhaustive)
def test_stages_by_accumulation_on_four_ranks(reference, tmp_path):
    names = [(z, mb) for z in range(4) for mb in (1, 2)]
    res = run_jobs(
        4, [job(tmp_path, f"z{z}mb{mb}", mb=mb, **{"parallel.zero": z}) for z, mb in names], str(tmp_path)
    )
    for (z, mb), r in zip(names, res):
        assert max_rel(losses(r), reference) < 1e-5, (z, mb)
