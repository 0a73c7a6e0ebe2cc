"""Layout invariance of GRPO's step given the same rollouts: completions fixed by (step, global row) in place of the
engine's samples (generation randomness is out of the comparison; everything after it is the real path: rewards,
advantages, the rollout-time and reference log-probabilities, the loss over the global count), DDP x2 gives the
single process's loss, gradient norm, KL and clip fractions at every step (fp32, 1e-5 relative), for a per-token
normalization with a frozen-copy reference and two iterations per batch of rollouts, and for the per-completion
one with accumulation. RLOO and online DPO (their own drivers on the same fixed completions) under DDP x2 and
FSDP2 x2 with accumulation, and under LoRA (the reference: the adapters off) with FSDP2 x2 and accumulation, and
asynchronous GRPO (grpo.max_staleness 1: a snapshot refreshed from FSDP2's shards, its log-probabilities and the
importance weights) under FSDP2 x2 with accumulation, give the single process's loss, gradient norm and figures
too, in the same process group."""

from __future__ import annotations

import random

import pytest

from loom.config.errors import SharedError
from loom.infer.generator import Completion
from loom.methods.grpo import GroupRelative
from loom.methods.online_dpo import OnlinePreference, paired
from loom.methods.rloo import LeaveOneOut
from loom.rl.rollout import Rollouts
from tests.distributed.harness import job_tmp, run_fn
from tests.tiny import tiny_overrides

KEYS = ("loss", "grad_norm", "kl", "clip_ratio/low", "clip_ratio/high", "reward", "targets", "is_weight")


class FixedRollouts(Rollouts):
    """The engine's sampling replaced by completions that depend only on (step, global row): the right answer
    (and EOS) for some, random digits for others, some cut without an EOS."""

    def generate(self, prompts, step=None, generator=None, weights=None):
        # asynchronous GRPO's sampler names the step it samples for
        step = self.step if step is None else step
        out = []
        for i, p in enumerate(prompts):
            rng = random.Random(repr((step, self.dp_rank * len(prompts) + i)))
            text = bytes(p).decode()
            answer = (
                str(eval(text[:-1]))
                if rng.random() < 0.4
                else "".join(
                    rng.choice("0123456789") for _ in range(rng.randint(1, self.g.max_new_tokens - 1))
                )
            )
            ids = list(answer.encode())
            eos = rng.random() < 0.8
            ids = ids + [self.tokenizer.eos_id] if eos else ids
            out.append(Completion(answer, ids, "eos" if eos else "length", len(p)))
        return out


class FixedGRPO(GroupRelative):
    def build_loader(self, trainer):
        self.rollouts = FixedRollouts(
            self.cfg, trainer.tokenizer, trainer.dims.dp_rank(), trainer.dims.dp_size
        )
        return self.rollouts


class FixedRLOO(LeaveOneOut):
    def build_loader(self, trainer):
        self.rollouts = FixedRollouts(
            self.cfg, trainer.tokenizer, trainer.dims.dp_rank(), trainer.dims.dp_size
        )
        return self.rollouts


class FixedOnlineDPO(OnlinePreference):
    def build_loader(self, trainer):
        self.rollouts = FixedRollouts(
            paired(self.cfg), trainer.tokenizer, trainer.dims.dp_rank(), trainer.dims.dp_size
        )
        return self.rollouts


FIXED = {"grpo": FixedGRPO, "rloo": FixedRLOO, "online_dpo": FixedOnlineDPO}
METHOD_KEYS = {
    "grpo": KEYS,
    "rloo": (
        "loss",
        "grad_norm",
        "kl",
        "clip_ratio/low",
        "clip_ratio/region",
        "reward",
        "frac_reward_zero_std",
    ),
    "online_dpo": (
        "loss",
        "grad_norm",
        "rewards/margins",
        "rewards/accuracy",
        "objective/kl",
        "objective/scores",
        "reward",
    ),
}


def overrides(tmp, name, mb, **extra):
    return tiny_overrides(
        f"{tmp}/{name}",
        None,
        **{
            "training.objective": "grpo",
            "run.seed": 3,
            "training.steps": 5,
            "training.global_batch_size": 8,
            "training.micro_batch_size": mb,
            "grpo.group_size": 4,
            "grpo.warmup_steps": 1,
            "grpo.max_new_tokens": 4,
            "grpo.epsilon": 0.1,
            "optimizer.lr": 3e-2,
            "optimizer.warmup_steps": 1,
            "metrics.progress": "false",
            **extra,
        },
    )


JOBS = {  # name: (micro-batch on one process, micro-batch per DDP rank, extra overrides)
    "dapo-copy-iter2": (8, 4, {"grpo.loss_type": "dapo", "grpo.beta": 0.1, "grpo.iterations": 2}),
    "grpo-acc": (2, 2, {"grpo.loss_type": "grpo", "grpo.scale_rewards": "batch"}),
}
DDP, FSDP = (
    {"parallel.dp_replicate": 2, "parallel.dp_shard": 1},
    {"parallel.dp_replicate": 1, "parallel.dp_shard": 2},
)
RLOO = {
    "training.objective": "rloo",
    "grpo.beta": 0.1,
    "grpo.iterations": 2,
    "rloo.normalize_advantages": "true",
}
ONLINE = {
    "training.objective": "online_dpo",
    "grpo.group_size": None,
    "grpo.epsilon": None,
    "online_dpo.beta": 0.5,
}
# RLOO and online DPO, name: (micro-batch on one process, micro-batch per rank, the 2-rank layout, extra overrides)
METHOD_JOBS = {
    "rloo-ddp": (8, 4, DDP, RLOO),
    "rloo-fsdp-acc": (2, 2, FSDP, {**RLOO, "grpo.iterations": 1}),
    "online_dpo-ddp": (8, 4, DDP, ONLINE),
    "online_dpo-fsdp-acc": (2, 2, FSDP, ONLINE),
    # under LoRA the reference is the policy with its adapters off (RLOO's KL penalty, online DPO's pairs)
    "rloo-lora-fsdp-acc": (2, 2, FSDP, {**RLOO, "grpo.iterations": 1, "lora.rank": 4}),
    "online_dpo-lora-fsdp-acc": (2, 2, FSDP, {**ONLINE, "lora.rank": 4}),
    # asynchronous GRPO: the snapshot refreshed from FSDP2's shards, its log-probabilities, the importance weights
    "grpo-async-fsdp-acc": (2, 2, FSDP, {"grpo.max_staleness": 1, "grpo.loss_type": "grpo"}),
}


def train(job: dict, env=None) -> list[dict]:
    from loom.config import build_config
    from loom.train.trainer import Trainer

    cfg = build_config(None, {k: str(v) for k, v in job.items()})
    method = cfg.training.objective
    trainer = Trainer(cfg, env=env, objective=FIXED[method](cfg))
    return [{k: r.get(k) for k in METHOD_KEYS[method]} for r in trainer.fit()]


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
    for name, (_, mb, layout, extra) in METHOD_JOBS.items():
        job = overrides(tmp, f"{name}-{rank}", mb, **extra, **layout)
        job["run.dir"] = f"{tmp}/{name}"
        out[name] = train(job, init_distributed("cpu", "gloo"))
    # issue 49: a reward function that raises on rank 1 alone stops both ranks with its line, rank 0 included
    # (which prints it, once: a SharedError), instead of rank 0 waiting in the step's collectives
    job = overrides(tmp, f"raises-{rank}", 4, **{"parallel.dp_replicate": world, "parallel.dp_shard": 1})
    job.update({"run.dir": f"{tmp}/raises", "grpo.warmup_steps": 0, "training.steps": 1})
    job["grpo.rewards"] = "tests.unit.test_nothing_silent:raises_on_rank_1"
    try:
        train(job, init_distributed("cpu", "gloo"))
    except SharedError as err:
        out["raises"] = str(err)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_layouts")
    single = {name: train(overrides(tmp, name, mb, **extra)) for name, (mb, _, extra) in JOBS.items()}
    for name, (mb, _, _, extra) in METHOD_JOBS.items():
        single[name] = train(overrides(tmp, name, mb, **extra))
    return single, run_fn(2, ddp_jobs, str(tmp))


def test_a_reward_function_raising_on_one_rank_stops_every_rank_with_its_line(results):
    _, ddp = results
    assert "tests.unit.test_nothing_silent:raises_on_rank_1 (defined at " in ddp["raises"], ddp.get("raises")
    assert "raised TimeoutError: the grader timed out at " in ddp["raises"]


@pytest.mark.parametrize("name", sorted(JOBS))
def test_ddp2_step_equals_single_process(results, name):
    single, ddp = results
    ref, got = single[name], ddp[name]
    assert len(ref) == len(got) == 5
    assert all(r["grad_norm"] > 0.1 for r in ref)  # every step trains (the first is the warm-up's)
    if name == "dapo-copy-iter2":  # the second iteration on a batch of rollouts clips; the KL term is live
        assert max(r["clip_ratio/low"] + r["clip_ratio/high"] for r in ref[1:]) > 0.1
        # the reference: the policy as GRPO starts
        assert abs(ref[1]["kl"]) < 1e-6 < min(r["kl"] for r in ref[2:])
    for a, b in zip(got, ref):
        for key in KEYS:
            if b[key] is None:
                assert a[key] is None, (key, a, b)
                continue
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (name, key, a, b)


@pytest.mark.parametrize("name", sorted(METHOD_JOBS))
def test_rloo_and_online_dpo_two_ranks_equal_single_process(results, name):
    """DDP x2, and FSDP2 x2 with two micro-batches per rank (full fine-tuning and LoRA; asynchronous GRPO), against
    one process: every step's figures."""
    single, ranks = results
    ref, got = single[name], ranks[name]
    assert len(ref) == len(got) == 5
    assert all(r["grad_norm"] > 1e-3 for r in ref)  # every step trains (the first is the warm-up's)
    if name.startswith("rloo"):
        assert (
            max(abs(r["kl"]) for r in ref[2:]) > 1e-4
        )  # the KL penalty (k1: signed) is live once the reference is taken
    elif name.startswith("grpo-async"):  # steps 3 to 5 train on rows sampled one step back: weights off 1
        assert min(abs(r["is_weight"] - 1) for r in ref[2:]) > 1e-5, ref
    else:  # the first step's reference is the policy itself, but under LoRA the warm-up moved the adapters
        assert max(abs(r["rewards/margins"]) for r in ref[2:]) > 1e-4
        assert (ref[1]["objective/kl"] == 0.0) == ("lora" not in name), ref[1]
    for a, b in zip(got, ref):
        for key, want in b.items():
            if want is None:
                assert a[key] is None, (key, a, b)
                continue
            assert abs(a[key] - want) <= 1e-5 * max(1.0, abs(want)), (name, key, a, b)
