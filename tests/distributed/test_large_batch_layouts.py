"""LAMB and LARS under sharded parameters: FSDP2 x 2 and TP x 2 (gloo) give the single process's losses over 6
steps (fp32, 1e-5 relative), which holds only if each trust ratio uses the norms of the whole parameter; and a
checkpointed run resumes exactly."""

from __future__ import annotations

import os

import pytest

from tests.distributed.harness import losses, run_fn, run_jobs
from tests.tiny import tiny_overrides

STEPS, GLOBAL = 6, 8
NAMES = ("lamb", "lars")


def job(tmp, name, opt, mb=GLOBAL, **extra):
    # LARS moves each matrix by about lr x trust_coefficient x ||w|| a step: an SGD-sized LR
    return tiny_overrides(
        f"{tmp}/{name}-{opt}",
        f"{tmp}/cache",
        **{
            "run.seed": 4,
            "training.steps": STEPS,
            "training.global_batch_size": GLOBAL,
            "training.micro_batch_size": mb,
            "optimizer.name": opt,
            "optimizer.warmup_steps": 2,
            "optimizer.lr": 2.0 if opt == "lars" else 3e-3,
            "optimizer.trust_coefficient": 0.02,
            **extra,
        },
    )


def max_rel(a, b):
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    res = run_jobs(1, [job(tmp, "single", opt) for opt in NAMES], str(tmp))
    return {opt: losses(r) for opt, r in zip(NAMES, res)}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w2")
    layouts = {
        "fsdp2": {"parallel.dp_shard": 2, "training.micro_batch_size": GLOBAL // 2},
        "tp2": {"parallel.tp": 2, "parallel.dp_shard": 1},
    }
    names = [(lay, opt) for lay in layouts for opt in NAMES]
    res = run_jobs(2, [job(tmp, lay, opt, **layouts[lay]) for lay, opt in names], str(tmp))
    return dict(zip(names, res))


def _norms_of_shards(rank, world):
    """Norms of DTensors sharded on dim 0, on dim 1, unevenly, replicated, and on a 2-D mesh, against the whole."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from loom.train.large_batch import whole_norms

    torch.manual_seed(0)
    full = [torch.randn(6, 4), torch.randn(3, 8), torch.randn(5), torch.randn(4, 4), torch.randn(4, 6)]
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    dts = [
        distribute_tensor(full[0], mesh, [Shard(0)]),
        distribute_tensor(full[1], mesh, [Shard(1)]),
        distribute_tensor(full[2], mesh, [Shard(0)]),
        distribute_tensor(full[3], mesh, [Replicate()]),
        distribute_tensor(full[4], mesh2, [Replicate(), Shard(1)]),
    ]
    got = whole_norms(dts)
    want = torch.stack([torch.linalg.vector_norm(t) for t in full])
    return float((got - want).abs().max() / want.max())


def test_whole_norms_of_shards(tmp_path):
    assert run_fn(2, _norms_of_shards, str(tmp_path)) < 1e-6


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
@pytest.mark.parametrize("opt", NAMES)
def test_sharded_equals_single_process(reference, sharded, layout, opt):
    assert max_rel(losses(sharded[(layout, opt)]), reference[opt]) < 1e-5
    assert reference[opt][-1] < reference[opt][0]  # it trains


@pytest.mark.exhaustive  # 4 ranks: the widest matrix, run by hand (pytest --exhaustive)
def test_fsdp_x_tp_and_hsdp_equal_single_process(reference, tmp_path):
    """World 4: a 2-D mesh sharding each matrix on both axes (FSDP2 x TP), and HSDP (Replicate x Shard)."""
    layouts = {
        "fsdp2xtp2": {"parallel.dp_shard": 2, "parallel.tp": 2, "training.micro_batch_size": GLOBAL // 2},
        "hsdp2x2": {"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "training.micro_batch_size": 2},
    }
    names = [(lay, opt) for lay in layouts for opt in NAMES]
    res = run_jobs(4, [job(tmp_path, lay, opt, **layouts[lay]) for lay, opt in names], str(tmp_path))
    for (lay, opt), r in zip(names, res):
        assert max_rel(losses(r), reference[opt]) < 1e-5, (lay, opt)


def test_trust_ratio_differs_from_adamw(reference, tmp_path):
    """The layouts' agreement means something: LAMB's losses are not AdamW's."""
    adamw = losses(run_jobs(1, [job(tmp_path, "single", "adamw")], str(tmp_path))[0])
    assert max_rel(reference["lamb"], adamw) > 1e-3


@pytest.mark.parametrize("opt", NAMES)
def test_resume_is_exact(tmp_path, opt):
    save_at = 3
    extra = {"run.deterministic": "true", "checkpoint.every": save_at, "checkpoint.keep": 0}
    full = run_jobs(1, [job(tmp_path, "full", opt, **extra)], str(tmp_path))[0]
    ckpt = os.path.join(tmp_path, f"full-{opt}", "checkpoints", f"step_{save_at:08d}")
    resumed = run_jobs(
        1, [job(tmp_path, "resumed", opt, **extra, **{"checkpoint.resume": ckpt})], str(tmp_path)
    )[0]
    tail = [(r["step"], r["loss"]) for r in full["records"] if r["step"] > save_at]
    assert [(r["step"], r["loss"]) for r in resumed["records"]] == tail


def test_noise_scale_under_ddp_and_fsdp(tmp_path):
    """metrics.noise_scale on 2 ranks: DDP's first micro-batch is each rank's own (no_sync), FSDP2's is reduced
    in its backward; either way the losses are the single process's and an estimate is logged."""
    probe = {"metrics.noise_scale": "true", "training.micro_batch_size": 2}
    single = losses(run_jobs(1, [job(tmp_path, "single", "adamw")], str(tmp_path))[0])
    ddp, fsdp = run_jobs(
        2,
        [
            job(tmp_path, "ddp2", "adamw", **probe, **{"parallel.dp_replicate": 2, "parallel.dp_shard": 1}),
            job(tmp_path, "fsdp2", "adamw", **probe, **{"parallel.dp_shard": 2}),
        ],
        str(tmp_path),
    )
    for res in (ddp, fsdp):
        assert max_rel(losses(res), single) < 1e-5
        assert res["records"][-1]["noise_scale"] > 0
