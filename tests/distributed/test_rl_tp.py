"""GRPO under tensor parallelism (gloo, fp32). TP x2: given the same rollouts (test_grpo_layouts' fixed completions),
every step's loss, gradient norm and statistics equal the single process's (1e-5 relative); with the real engine
running tensor-parallel on the trainer's own shards (nothing copied, nothing synced), after updates its cached
prefill and decode logits equal the trained model's full logits, under full fine-tuning and LoRA. Exhaustive:
FSDP2 x TP (dp_shard 2 x tp 2, 4 ranks), where each sync fills the engine's TP shards from FSDP2's (under LoRA,
after the first, the adapters only); under TP x2 a mixture of experts (parallel.etp too) and latent attention.

RLOO and online DPO under TP x2 (their drivers on the same fixed completions): every step's loss, gradient norm and
figures equal the single process's (1e-5 relative).

PPO under TP (test_ppo_layouts' fixed rollouts): with the value head (split by the TP plan: its weight whole, run on
the sequence shards, the values gathered whole), TP x2 gives the single process's loss, gradient norm, values,
returns and every PPO statistic at every step (1e-5 relative). On a mixture of experts with its balance loss
(debug_moe), GRPO's and PPO's steps equal the single process's too, the warm-up included, under TP x2 and FSDP2 x2. Exhaustive: the separate
critic model (the policy's TP plan) under TP x2, with the real engine too (it shares the policy's shards only: no
value head, no critic, nothing synced); both value functions under FSDP2 x TP and the head under DDP x TP
(dp_replicate 2 x tp 2)."""

from __future__ import annotations

import math

import pytest

from tests.distributed import test_grpo_layouts as grpo
from tests.distributed import test_ppo_layouts as ppo
from tests.distributed.harness import job_tmp, run_fn
from tests.distributed.test_rl_fsdp import GRPO_JOB, engine_check, train

TP = {"parallel.dp_replicate": 1, "parallel.dp_shard": 1, "parallel.tp": 2}
FSDP = {"parallel.dp_replicate": 1, "parallel.dp_shard": 2}
FSDP_TP = {"parallel.dp_replicate": 1, "parallel.dp_shard": 2, "parallel.tp": 2}
DDP_TP = {"parallel.dp_replicate": 2, "parallel.dp_shard": 1, "parallel.tp": 2}
NAME, SINGLE_MB, DP_MB, EXTRA = GRPO_JOB
# PPO's jobs: (test_ppo_layouts job, steps). The head's: the warm-up, then 3 of the 4 steps on one batch of rollouts
PPO_HEAD, PPO_CRITIC = "ppo-head", "ppo-critic"
PPO_JOBS = {PPO_HEAD: ("reward-kl-2x2", 4), PPO_CRITIC: ("critic-loss-kl-acc", 6)}
# a mixture of experts with its balance loss (the default weight): the warm-up and two steps of each objective
MOE = {"model.flavor": "debug_moe", "training.steps": 3}


def ppo_job(tmp, name: str, rank: int | None, layout: dict, dp: int) -> dict:
    """PPO job ``name`` on ``dp`` data-parallel ranks (1: the single process's micro-batch) in ``layout``."""
    base, steps = PPO_JOBS[name]
    single_mb, dp_mb, extra = ppo.JOBS[base]
    job = ppo.overrides(
        tmp,
        name if rank is None else f"{name}-{rank}",
        single_mb if dp == 1 else dp_mb,
        **{**extra, "training.steps": steps},
        **layout,
    )
    if rank is not None:
        job["run.dir"] = f"{tmp}/{name}"
    return job


def tp_jobs(rank: int, world: int) -> dict:
    from loom.runtime.env import init_distributed

    tmp = f"{job_tmp()}/ranks"  # apart from the single-process runs of the same names
    env = init_distributed("cpu", "gloo")
    layout = TP if world == 2 else FSDP_TP
    mb = SINGLE_MB if world == 2 else DP_MB  # the data-parallel ranks: 1 under TP x2, 2 under FSDP2 x TP
    job = grpo.overrides(tmp, f"{NAME}-{rank}", mb, **EXTRA, **layout)
    job["run.dir"] = f"{tmp}/{NAME}"
    out = {NAME: train(grpo, job, env)}
    for lora in (False, True):
        out[f"engine-lora{int(lora)}"] = engine_check(f"{tmp}/engine-{int(lora)}-{rank}", lora, env, layout)
    if world == 2:
        out[PPO_HEAD] = train(ppo, ppo_job(tmp, PPO_HEAD, rank, TP, 1), env)
        for name, job in method_jobs(tmp, rank, TP).items():
            out[name] = grpo.train(job, env)
        out.update({name: train(module, job, env) for name, (module, job) in moe_jobs(tmp, rank, TP).items()})
        out.update(
            {
                f"{name}-fsdp": train(module, job, env)
                for name, (module, job) in moe_jobs(f"{tmp}/fsdp", rank, FSDP, dp=2).items()
            }
        )
    else:
        for name in PPO_JOBS:
            out[name] = train(ppo, ppo_job(tmp, name, rank, FSDP_TP, 2), env)
        out[f"{PPO_HEAD}-ddp"] = train(ppo, ppo_job(f"{tmp}/ddp", PPO_HEAD, rank, DDP_TP, 2), env)
    return out


# RLOO's and online DPO's drivers on test_grpo_layouts' fixed completions (RLOO: the KL penalty and two iterations)
METHODS = {"rloo-tp": grpo.RLOO, "online_dpo-tp": grpo.ONLINE}


def method_jobs(tmp, rank: int | None, layout: dict) -> dict:
    """RLOO's and online DPO's jobs (``METHODS``) in ``layout`` with one data-parallel rank (rank None: one
    process): name -> job."""
    jobs = {}
    for name, extra in METHODS.items():
        job = grpo.overrides(tmp, name if rank is None else f"{name}-{rank}", SINGLE_MB, **extra, **layout)
        if rank is not None:  # one run folder for the group
            job["run.dir"] = f"{tmp}/{name}"
        jobs[name] = job
    return jobs


def moe_jobs(tmp, rank: int | None, layout: dict, dp: int = 1) -> dict:
    """GRPO's and PPO's (value head) jobs on the debug_moe flavor (``MOE``) in ``layout`` on ``dp`` data-parallel
    ranks (rank None: one process): name -> (test module, job)."""
    suffix = "" if rank is None else f"-{rank}"
    mb = SINGLE_MB if dp == 1 else DP_MB
    jobs = {
        f"{NAME}-moe": (grpo, grpo.overrides(tmp, f"{NAME}-moe{suffix}", mb, **EXTRA, **MOE, **layout)),
        f"{PPO_HEAD}-moe": (
            ppo,
            {**ppo_job(tmp, PPO_HEAD, rank, layout, dp), **MOE, "run.dir": f"{tmp}/{PPO_HEAD}-moe{suffix}"},
        ),
    }
    if rank is not None:  # one run folder for the group
        for name, (_, job) in jobs.items():
            job["run.dir"] = f"{tmp}/{name}"
    return jobs


def single(tmp, ppo_names=(PPO_HEAD,), moe: bool = False) -> dict:
    """The single process's records: GRPO's job and PPO's ``ppo_names`` (and with ``moe`` both on debug_moe, and
    RLOO's and online DPO's)."""
    return {
        **({name: grpo.train(job) for name, job in method_jobs(tmp, None, {}).items()} if moe else {}),
        NAME: train(grpo, grpo.overrides(tmp, NAME, SINGLE_MB, **EXTRA)),
        **{name: train(ppo, ppo_job(tmp, name, None, {}, 1)) for name in ppo_names},
        **(
            {name: train(module, job) for name, (module, job) in moe_jobs(tmp, None, {}).items()}
            if moe
            else {}
        ),
    }


def check_steps(ref: list[dict], got: list[dict], keys=grpo.KEYS, floor: float = 0.01) -> None:
    """Every step trains (gradient norm above ``floor``) and its figures ``keys`` equal the reference's."""
    assert len(ref) == len(got) and all(r["grad_norm"] > floor for r in ref)
    for a, b in zip(got, ref):
        for key in keys:
            if b[key] is None:
                assert a[key] is None, (key, a, b)
                continue
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (key, a, b)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_tp")
    return single(tmp, moe=True), run_fn(2, tp_jobs, str(tmp))


def test_tp2_step_equals_single_process(tp2):
    ref, got = tp2
    check_steps(ref[NAME], got[NAME])
    assert all(not r["weight_sync_bytes"] for r in got[NAME])  # the engine shares the shards: nothing synced


def test_ppo_tp2_step_equals_single_process(tp2):
    """PPO with its value head under TP x2: losses, values, returns, KL and clip fractions at every step."""
    ref, got = tp2
    check_steps(ref[PPO_HEAD], got[PPO_HEAD], ppo.KEYS)
    assert max(r["ppo/clipfrac"] for r in ref[PPO_HEAD][1:]) > 0.05 and ref[PPO_HEAD][1]["ppo/values"] != 0
    assert all(not r["weight_sync_bytes"] for r in got[PPO_HEAD])  # the value head is not the engine's


@pytest.mark.parametrize("name", sorted(METHODS))
def test_rloo_and_online_dpo_tp2_step_equals_single_process(tp2, name):
    """RLOO (its KL penalty live, two iterations per batch of rollouts) and online DPO under TP x2: every step's
    loss, gradient norm and the method's figures (test_grpo_layouts' METHOD_KEYS)."""
    ref, got = tp2
    method = name.removesuffix("-tp")
    check_steps(ref[name], got[name], grpo.METHOD_KEYS[method], floor=1e-3)
    if method == "rloo":
        assert max(abs(r["kl"]) for r in ref[name][2:]) > 1e-4
    else:
        assert max(abs(r["rewards/margins"]) for r in ref[name][2:]) > 1e-4


@pytest.mark.parametrize("name", [f"{NAME}-moe", f"{PPO_HEAD}-moe"])
def test_moe_tp2_step_equals_single_process(tp2, name):
    """A mixture of experts with its balance loss: its gradient is the single process's at the warm-up (the engine
    built on the one process's policy left it in eval mode, without the balance loss) and on rollouts (the rows'
    padding to a multiple of tp counted in it)."""
    ref, got = tp2
    check_steps(ref[name], got[name], grpo.KEYS if name.startswith(NAME) else ppo.KEYS)


@pytest.mark.parametrize("name", [f"{NAME}-moe", f"{PPO_HEAD}-moe"])
def test_moe_fsdp2_step_equals_single_process(tp2, name):
    """The same mixture of experts under FSDP2 x2 (each rank its own rollout rows): the balance loss's counts and
    the gradient are the global batch's."""
    ref, got = tp2
    check_steps(ref[name], got[f"{name}-fsdp"], grpo.KEYS if name.startswith(NAME) else ppo.KEYS)


@pytest.mark.parametrize("lora", [False, True])
def test_tp2_engine_runs_on_the_trainers_shards(tp2, lora):
    got = tp2[1][f"engine-lora{int(lora)}"]
    assert got["copied"] and got["moved"] > 1e-3  # the engine's own module, and the updates reached it
    assert got["shared"] == got["params"] and got["total_bytes"] == 0 and not any(got["bytes"]), got
    assert got["prefill"] < 1e-5 and got["step"] < 1e-5 and got["whole"] < 1e-5, got


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_fsdp_tp")
    return single(tmp, tuple(PPO_JOBS)), run_fn(4, tp_jobs, str(tmp))


@pytest.mark.exhaustive
def test_fsdp2_x_tp_step_equals_single_process(fsdp_tp):
    ref, got = fsdp_tp
    check_steps(ref[NAME], got[NAME])
    assert got[NAME][1]["weight_sync_bytes"] > 0


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", [PPO_HEAD, PPO_CRITIC, f"{PPO_HEAD}-ddp"])
def test_ppo_fsdp2_or_ddp_x_tp_step_equals_single_process(fsdp_tp, name):
    """dp_shard 2 x tp 2 (the value head; the critic model), dp_replicate 2 x tp 2 (the value head): the engine's
    TP shards are filled from FSDP2's at each batch of rollouts, the value function's parameters are not."""
    ref, got = fsdp_tp
    check_steps(ref[name.removesuffix("-ddp")], got[name], ppo.KEYS)
    assert got[name][1]["weight_sync_bytes"] > 0


def ppo_critic_jobs(rank: int, world: int) -> dict:
    from loom.runtime.env import init_distributed

    tmp = f"{job_tmp()}/ranks"  # apart from the single-process runs of the same names
    env = init_distributed("cpu", "gloo")
    return {
        PPO_CRITIC: train(ppo, ppo_job(tmp, PPO_CRITIC, rank, TP, 1), env),
        "engine": ppo_engine_check(f"{tmp}/engine-{rank}", env),
    }


def ppo_engine_check(tmp: str, env) -> dict:
    """PPO with the critic model and the real engine under TP x2 for 3 steps: what the engine holds, and its prefill
    logits against the trained policy's."""
    import torch

    from loom.config import build_config
    from loom.methods.ppo import ProximalPolicy
    from loom.train.trainer import Trainer

    job = ppo.overrides(
        tmp, "engine", 2, **{"training.steps": 3, "ppo.critic": "model", "ppo.kl_coef": 0.05, **TP}
    )
    cfg = build_config(None, {k: str(v) for k, v in job.items()})
    trainer = Trainer(cfg, env=env, objective=ProximalPolicy(cfg))
    records = trainer.fit()
    model, weights = trainer.parts[0], trainer.objective.rollouts.weights
    tokens = torch.tensor([trainer.tokenizer.encode("3+4=77"), trainer.tokenizer.encode("9*9=81")])  # (2, 6)
    model.eval()
    engine = trainer.objective.rollouts.generator.engine
    with torch.no_grad():
        after = model(tokens)  # (2, 6, V)
        # loss parallel's vocab shards
        after = after.full_tensor() if hasattr(after, "full_tensor") else after
        engine.allocate(2, tokens.shape[1])
        prefill = engine.prefill(tokens[:, :-1], torch.tensor([4, 4]))  # (2, V) at position 4
        engine.release()
    names = [n for n, _ in weights.model.named_parameters()]
    return {
        "prefill": (prefill - after[:, 4]).abs().max().item(),
        "shared": len(weights.shared),
        "filled": len(weights.fills),
        "params": len(names),
        "value_function": [n for n in names if "value_head" in n or "critic" in n],
        "sampled": [r["loss"] for r in records if r.get("time/generation_s")],
        "bytes": [r.get("weight_sync_bytes") for r in records],
    }


@pytest.fixture(scope="module")
def ppo_critic_tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppo_critic_tp")
    return train(ppo, ppo_job(tmp, PPO_CRITIC, None, {}, 1)), run_fn(2, ppo_critic_jobs, str(tmp))


@pytest.mark.exhaustive
def test_ppo_critic_model_tp2_step_equals_single_process(ppo_critic_tp2):
    ref, got = ppo_critic_tp2
    check_steps(ref, got[PPO_CRITIC], ppo.KEYS)


@pytest.mark.exhaustive
def test_ppo_tp2_engine_runs_on_the_policys_shards(ppo_critic_tp2):
    """The real engine under PPO's TP: the policy's shards only (the critic is no part of it), nothing synced,
    and after the updates its logits are the trained policy's."""
    got = ppo_critic_tp2[1]["engine"]
    assert got["shared"] == got["params"] and got["filled"] == 0 and not got["value_function"], got
    assert got["sampled"] and all(math.isfinite(x) for x in got["sampled"]) and not any(got["bytes"]), got
    assert got["prefill"] < 1e-5, got


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


MODELS = {
    "moe": {"model.flavor": "debug_moe"},
    "mla": {"model.flavor": "debug_mla"},
    "moe-etp": {"model.flavor": "debug_moe", "parallel.etp": 2},
}


def model_jobs(rank: int, world: int) -> dict:
    from loom.runtime.env import init_distributed

    env = init_distributed("cpu", "gloo")
    return {
        name: engine_check(f"{job_tmp()}/ranks/{name}-{rank}", False, env, {**TP, **extra})
        for name, extra in MODELS.items()
    }


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
    assert (got["total_bytes"] > 0) == (name == "moe-etp") and (got["last_bytes"] > 0) == (
        name == "moe-etp"
    ), got
    assert got["prefill"] < 1e-5 and got["step"] < 1e-5 and got["whole"] < 1e-5, got
