"""GRPO under tensor parallelism (gloo, fp32). TP x2: given the same rollouts (test_grpo_layouts' fixed completions),
every step's loss, gradient norm and statistics equal the single process's (1e-5 relative); with the real engine
running tensor-parallel on the trainer's own shards (nothing copied, nothing synced), after updates its cached
prefill and decode logits equal the trained model's full logits, under full fine-tuning and LoRA. Exhaustive:
FSDP2 x TP (dp_shard 2 x tp 2, 4 ranks), where each sync fills the engine's TP shards from FSDP2's (under LoRA,
after the first, the adapters only); under TP x2 a mixture of experts (parallel.etp too) and latent attention."""

from __future__ import annotations

import pytest

from tests.distributed import test_grpo_layouts as grpo
from tests.distributed.harness import run_fn
from tests.distributed.test_rl_fsdp import GRPO_JOB, engine_check, train

TP = {"parallel.dp_replicate": 1, "parallel.dp_shard": 1, "parallel.tp": 2}
FSDP_TP = {"parallel.dp_replicate": 1, "parallel.dp_shard": 2, "parallel.tp": 2}
NAME, SINGLE_MB, DP_MB, EXTRA = GRPO_JOB


def tp_jobs(rank: int, world: int) -> dict:
    from loom.parallel.env import init_distributed

    tmp = f"/tmp/loom_rl_tp_{world}"
    env = init_distributed("cpu", "gloo")
    layout = TP if world == 2 else FSDP_TP
    mb = SINGLE_MB if world == 2 else DP_MB  # the data-parallel ranks: 1 under TP x2, 2 under FSDP2 x TP
    job = grpo.overrides(tmp, f"{NAME}-{rank}", mb, **EXTRA, **layout)
    job["run.dir"] = f"{tmp}/{NAME}"
    out = {NAME: train(grpo, job, env)}
    for lora in (False, True):
        out[f"engine-lora{int(lora)}"] = engine_check(f"{tmp}/engine-{int(lora)}-{rank}", lora, env, layout)
    return out


def single(tmp) -> list[dict]:
    return train(grpo, grpo.overrides(tmp, NAME, SINGLE_MB, **EXTRA))


def check_steps(ref: list[dict], got: list[dict]) -> None:
    assert len(ref) == len(got) and all(r["grad_norm"] > 0.01 for r in ref)
    for a, b in zip(got, ref):
        for key in grpo.KEYS:
            if b[key] is None:
                assert a[key] is None, (key, a, b)
                continue
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a, b)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_tp")
    return single(tmp), run_fn(2, tp_jobs, str(tmp))


def test_tp2_step_equals_single_process(tp2):
    ref, got = tp2
    check_steps(ref, got[NAME])
    assert all(not r["weight_sync_bytes"] for r in got[NAME])  # the engine shares the shards: nothing synced


@pytest.mark.parametrize("lora", [False, True])
def test_tp2_engine_runs_on_the_trainers_shards(tp2, lora):
    got = tp2[1][f"engine-lora{int(lora)}"]
    assert got["copied"] and got["moved"] > 1e-3  # the engine's own module, and the updates reached it
    assert got["shared"] == got["params"] and got["total_bytes"] == 0 and not any(got["bytes"]), got
    assert got["prefill"] < 1e-5 and got["step"] < 1e-5 and got["whole"] < 1e-5, got


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_fsdp_tp")
    return single(tmp), run_fn(4, tp_jobs, str(tmp))


@pytest.mark.exhaustive
def test_fsdp2_x_tp_step_equals_single_process(fsdp_tp):
    ref, got = fsdp_tp
    check_steps(ref, got[NAME])
    assert got[NAME][1]["weight_sync_bytes"] > 0


@pytest.mark.exhaustive
@pytest.mark.parametrize("lora", [False, True])
def test_fsdp2_x_tp_engine_logits(fsdp_tp, lora):
    """dp_shard 2 x tp 2: the engine's TP shards, filled from FSDP2's at each sync (every weight the first time;
    later the adapters only under LoRA), give the trained model's logits."""
    engine = fsdp_tp[1][f"engine-lora{int(lora)}"]
    assert engine["copied"] and engine["shared"] == 0 and engine["filled"] == engine["params"]
    assert engine["moved"] > 1e-3
    syncs = [b for b in engine["bytes"] if b]
    later = engine["adapter_bytes"] if lora else engine["total_bytes"]
    assert syncs[0] == engine["total_bytes"] and syncs[1:] and all(b == later for b in syncs[1:]), engine
    assert engine["last_bytes"] == later
    assert engine["prefill"] < 1e-5 and engine["step"] < 1e-5 and engine["whole"] < 1e-5, engine


MODELS = {"moe": {"model.flavor": "debug_moe"}, "mla": {"model.flavor": "debug_mla"},
          "moe-etp": {"model.flavor": "debug_moe", "parallel.etp": 2}}


def model_jobs(rank: int, world: int) -> dict:
    from loom.parallel.env import init_distributed

    env = init_distributed("cpu", "gloo")
    return {name: engine_check(f"/tmp/loom_rl_tp_models/{name}-{rank}", False, env, {**TP, **extra})
            for name, extra in MODELS.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return run_fn(2, model_jobs, str(tmp_path_factory.mktemp("rl_tp_models")))


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_engine_logits_other_models(models, name):
    """A mixture of experts (router and experts: views of the replicated shards; under parallel.etp the experts,
    split over tp, gathered into the engine's plain copy at each sync) and multi-head latent attention."""
    got = models[name]
    assert got["copied"] and got["moved"] > 1e-3
    assert got["shared"] + got["filled"] == got["params"] and (got["filled"] > 0) == (name == "moe-etp"), got
    assert (got["total_bytes"] > 0) == (name == "moe-etp") and (got["last_bytes"] > 0) == (name == "moe-etp"), got
    assert got["prefill"] < 1e-5 and got["step"] < 1e-5 and got["whole"] < 1e-5, got
