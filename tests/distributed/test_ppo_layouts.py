"""Layout invariance of PPO's step given the same rollouts: completions fixed by (step, global row) in place of the
engine's samples (generation randomness is out of the comparison; everything after it is the real path: rewards,
the rollout-time log-probabilities and values, the frozen-copy reference, the gather of the global batch, GAE and
whitening, the shuffled mini-batches, the loss over the global token count), DDP x2 gives the single process's
loss, gradient norm and PPO statistics at every step (fp32, 1e-5 relative): two passes over two mini-batches per
batch of rollouts with the KL in the rewards and a value head, and the KL as a loss term with a separate critic
model and accumulation."""

from __future__ import annotations

import pytest

from loom.methods.ppo import ProximalPolicy
from loom.rl.ppo_objective import PpoRollouts
from tests.distributed.harness import job_tmp, run_fn
from tests.distributed.test_grpo_layouts import FixedRollouts
from tests.tiny import tiny_overrides

KEYS = (
    "loss",
    "grad_norm",
    "ppo/policy_loss",
    "ppo/value_loss",
    "ppo/clipfrac",
    "ppo/approx_kl",
    "ppo/values",
    "ppo/returns",
    "ppo/rollout_kl",
    "kl",
    "reward",
    "targets",
)


class FixedPpoRollouts(PpoRollouts):
    generate = FixedRollouts.generate  # completions by (step, global row), not the engine's


class FixedPPO(ProximalPolicy):
    def build_loader(self, trainer):
        self.rollouts = FixedPpoRollouts(
            self.cfg, trainer.tokenizer, trainer.dims.dp_rank(), trainer.dims.dp_size
        )
        return self.rollouts


def overrides(tmp, name, mb, **extra):
    return tiny_overrides(
        f"{tmp}/{name}",
        None,
        **{
            "training.objective": "ppo",
            "run.seed": 3,
            "training.steps": 6,
            "training.global_batch_size": 8,
            "training.micro_batch_size": mb,
            "grpo.group_size": 4,
            "grpo.warmup_steps": 1,
            "grpo.max_new_tokens": 4,
            "ppo.cliprange": 0.1,
            "ppo.cliprange_value": 0.05,
            "optimizer.lr": 3e-2,
            "optimizer.warmup_steps": 1,
            "metrics.progress": "false",
            **extra,
        },
    )


JOBS = {  # name: (micro-batch on one process, micro-batch per DDP rank, extra overrides)
    "reward-kl-2x2": (8, 4, {"ppo.kl_coef": 0.1, "ppo.epochs": 2, "ppo.mini_batches": 2}),
    "critic-loss-kl-acc": (
        2,
        2,
        {
            "ppo.critic": "model",
            "ppo.kl_coef": 0.1,
            "ppo.kl_penalty": "loss",
            "ppo.epochs": 2,
            "ppo.whiten_rewards": "true",
        },
    ),
}


def train(job: dict, env=None) -> list[dict]:
    from loom.config import build_config
    from loom.train.trainer import Trainer

    cfg = build_config(None, {k: str(v) for k, v in job.items()})
    trainer = Trainer(cfg, env=env, objective=FixedPPO(cfg))
    return [{k: r.get(k) for k in KEYS} for r in trainer.fit()]


def ddp_jobs(rank: int, world: int) -> dict:
    from loom.runtime.env import init_distributed

    tmp = f"{job_tmp()}/ranks"  # apart from the single-process runs of the same names
    out = {}
    for name, (_, mb, extra) in JOBS.items():
        job = overrides(
            tmp, f"{name}-{rank}", mb, **extra, **{"parallel.dp_replicate": world, "parallel.dp_shard": 1}
        )
        job["run.dir"] = f"{tmp}/{name}"
        out[name] = train(job, init_distributed("cpu", "gloo"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppo_layouts")
    single = {name: train(overrides(tmp, name, mb, **extra)) for name, (mb, _, extra) in JOBS.items()}
    return single, run_fn(2, ddp_jobs, str(tmp))


@pytest.mark.parametrize("name", sorted(JOBS))
def test_ddp2_step_equals_single_process(results, name):
    single, ddp = results
    ref, got = single[name], ddp[name]
    assert len(ref) == len(got) == 6
    assert all(r["grad_norm"] > 0.01 for r in ref)  # every step trains (the first is the warm-up's)
    assert max(r["ppo/clipfrac"] for r in ref[1:]) > 0.05  # later steps on a batch of rollouts clip
    if name == "reward-kl-2x2":  # the reference: the policy as PPO starts, then the policy moves away from it
        assert abs(ref[1]["ppo/rollout_kl"]) < 1e-6 < abs(ref[5]["ppo/rollout_kl"])
    else:
        assert abs(ref[1]["kl"]) < 1e-6 < min(r["kl"] for r in ref[2:])
    for a, b in zip(got, ref):
        for key in KEYS:
            if b[key] is None:
                assert a[key] is None, (key, a, b)
                continue
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (name, key, a, b)
