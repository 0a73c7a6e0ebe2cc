"""GRPO and PPO under FSDP2 x2 (gloo, fp32). Given the same rollouts (completions fixed by (step, global row), as in
test_grpo_layouts / test_ppo_layouts), every step's loss, gradient norm and statistics equal the single process's
(1e-5 relative), and each batch of rollouts first syncs the engine's copy (bytes > 0). With the real engine after
updates, the synced copy's cached prefill and decode logits equal the sharded model's full logits, under full
fine-tuning and under LoRA, where syncs after the first move the adapters only; so do the logits of the eval
hook's gathered copy (whole_model, adapters merged). Exhaustive: HSDP 2x2 (4 ranks) against the single process."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import test_grpo_layouts as grpo
from tests.distributed import test_ppo_layouts as ppo
from tests.distributed.harness import job_tmp, run_fn

FSDP = {"parallel.dp_replicate": 1, "parallel.dp_shard": 2}
GRPO_JOB = ("dapo-copy-iter2", *grpo.JOBS["dapo-copy-iter2"])
PPO_JOB = ("critic-loss-kl-acc", *ppo.JOBS["critic-loss-kl-acc"])


def train(module, job: dict, env=None) -> list[dict]:
    """A layout test's job (its fixed rollouts) with the sync figures recorded too."""
    from loom.config import build_config
    from loom.train.trainer import Trainer

    cfg = build_config(None, {k: str(v) for k, v in job.items()})
    objective = (module.FixedGRPO if module is grpo else module.FixedPPO)(cfg)
    return [
        {k: r.get(k) for k in module.KEYS + ("weight_sync_bytes",)}
        for r in Trainer(cfg, env=env, objective=objective).fit()
    ]


def engine_check(tmp: str, lora: bool, env=None, layout: dict = FSDP) -> dict:
    """GRPO with the real engine for 3 steps, then one more sync: the engine's logits against the policy's.
    ``layout``: the parallel overrides where ``env`` is given (a distributed run)."""
    from loom.config import build_config
    from loom.methods.grpo import GroupRelative
    from loom.rl.sync import whole_model
    from loom.train.trainer import Trainer

    extra = {"lora.rank": 4, "lora.targets": "q,v", "optimizer.lr": 3e-2} if lora else {}
    job = grpo.overrides(
        tmp,
        "engine",
        2,
        **{"training.steps": 3, "grpo.beta": 0.05, **extra, **(layout if env is not None else {})},
    )
    cfg = build_config(None, {k: str(v) for k, v in job.items()})
    trainer = Trainer(cfg, env=env, objective=GroupRelative(cfg))
    model, rollouts = trainer.parts[0], trainer.objective.rollouts
    tokens = torch.tensor([trainer.tokenizer.encode("3+4=77"), trainer.tokenizer.encode("9*9=81")])  # (2, 6)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # TP's vocab-sharded logits
    with torch.no_grad():
        before = full(model(tokens))
    records = trainer.fit()
    rollouts.weights.sync()  # the last update is after the last rollouts
    engine = rollouts.generator.engine
    model.eval()
    with torch.no_grad():
        after = full(model(tokens))  # (2, 6, V): the sharded policy's full logits
        engine.allocate(2, tokens.shape[1])
        prefill = engine.prefill(tokens[:, :-1], torch.tensor([4, 4]))  # (2, V) at position 4
        step = engine.step(tokens[:, -1:], torch.tensor([[5], [5]]))[
            :, 0
        ]  # (2, V) at position 5, from the cache
        engine.release()
        whole = whole_model(model)(tokens)  # the eval hook's gathered copy, adapters merged
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    fills = rollouts.weights.fills
    return {
        "prefill": (prefill - after[:, 4]).abs().max().item(),
        "step": (step - after[:, 5]).abs().max().item(),
        "whole": (whole - after).abs().max().item(),
        "moved": (after - before).abs().max().item(),
        "copied": rollouts.weights.copied,
        "shared": len(rollouts.weights.shared),
        "filled": len(fills),
        "params": len(dict(model.named_parameters())),
        "bytes": [r.get("weight_sync_bytes") for r in records],
        "last_bytes": rollouts.weights.bytes,
        "adapter_bytes": sum(local(t).numel() * 4 for n, t in fills.items() if "lora_" in n),
        "total_bytes": sum(local(t).numel() * 4 for t in fills.values()),
    }


def fsdp_jobs(rank: int, world: int) -> dict:
    from loom.runtime.env import init_distributed

    tmp = f"{job_tmp()}/ranks"  # apart from the single-process runs of the same names
    env = init_distributed("cpu", "gloo")
    out = {}
    for module, (name, _, mb, extra) in ((grpo, GRPO_JOB), (ppo, PPO_JOB)):
        job = module.overrides(tmp, f"{name}-{rank}", mb, **extra, **FSDP)
        job["run.dir"] = f"{tmp}/{name}"
        out[name] = train(module, job, env)
    for lora in (False, True):
        out[f"engine-lora{int(lora)}"] = engine_check(f"{tmp}/engine-{int(lora)}-{rank}", lora, env)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_fsdp")
    single = {
        name: train(module, module.overrides(tmp, name, mb, **extra))
        for module, (name, mb, _, extra) in ((grpo, GRPO_JOB), (ppo, PPO_JOB))
    }
    return single, run_fn(2, fsdp_jobs, str(tmp))


@pytest.mark.parametrize("module,name", [(grpo, GRPO_JOB[0]), (ppo, PPO_JOB[0])])
def test_fsdp2_step_equals_single_process(results, module, name):
    single, fsdp = results
    ref, got = single[name], fsdp[name]
    assert len(ref) == len(got) and all(r["grad_norm"] > 0.01 for r in ref)
    assert got[1]["weight_sync_bytes"] > 0  # the first batch of rollouts synced the engine's copy
    for a, b in zip(got, ref):
        for key in module.KEYS:
            if b[key] is None:
                assert a[key] is None, (key, a, b)
                continue
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (name, key, a, b)


@pytest.mark.parametrize("lora", [False, True])
def test_engine_logits_equal_the_sharded_model(results, lora):
    got = results[1][f"engine-lora{int(lora)}"]
    assert got["copied"] and got["moved"] > 1e-3  # a copy, and the updates reached it
    assert got["prefill"] < 1e-5 and got["step"] < 1e-5 and got["whole"] < 1e-5, got
    syncs = [b for b in got["bytes"] if b]  # steps that sampled (the warm-up and held rollouts sync nothing)
    assert syncs[0] == got["total_bytes"]  # the first sync copies every weight
    if lora:  # later ones the adapters only: the copy keeps the frozen base
        assert (
            syncs[1:] and all(b == got["adapter_bytes"] for b in syncs[1:]) and got["last_bytes"] == syncs[1]
        )
    else:
        assert all(b == got["total_bytes"] for b in syncs) and got["last_bytes"] == got["total_bytes"]


HSDP = {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}
WIDE = {"training.global_batch_size": 16}  # whole groups of 4 on each of 4 ranks


def hsdp_jobs(rank: int, world: int) -> dict:
    from loom.runtime.env import init_distributed

    tmp = f"{job_tmp()}/ranks"  # apart from the single-process runs of the same names
    env = init_distributed("cpu", "gloo")
    out = {}
    for module, (name, _, _, extra) in ((grpo, GRPO_JOB), (ppo, PPO_JOB)):
        job = module.overrides(tmp, f"{name}-{rank}", 4, **extra, **WIDE, **HSDP)
        job["run.dir"] = f"{tmp}/{name}"
        out[name] = train(module, job, env)
    return out


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    return run_fn(4, hsdp_jobs, str(tmp_path_factory.mktemp("rl_hsdp")))


@pytest.mark.exhaustive
@pytest.mark.parametrize("module,name", [(grpo, GRPO_JOB[0]), (ppo, PPO_JOB[0])])
def test_hsdp_2x2_step_equals_single_process(hsdp, tmp_path, module, name):
    """HSDP (2 replicas of 2 shards, 4 ranks): the engine's copies gather from both mesh axes' shards."""
    job_extra = (GRPO_JOB if module is grpo else PPO_JOB)[3]
    ref, got = train(module, module.overrides(tmp_path, name, 8, **job_extra, **WIDE)), hsdp[name]
    assert len(ref) == len(got) and got[1]["weight_sync_bytes"] > 0
    for a, b in zip(got, ref):
        for key in module.KEYS:
            if b[key] is None:
                assert a[key] is None, (key, a, b)
                continue
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (name, key, a, b)
