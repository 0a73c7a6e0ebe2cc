"""RLOO (``training.objective rloo``): TRL 1.16's RLOOTrainer, its own code called on a stand-in object, gives the
same advantages (leave-one-out, the KL penalty in the reward, normalization), logged reward figures and KL as loom's
functions on the same rewards and log-probabilities; its ``_compute_loss`` the same loss, clip fractions and
gradient as the objective's forward on a tiny model; the embedded default trains from ``loom train``; the config
rules; a resumed run continues bitwise."""

from __future__ import annotations

import functools
import json
import shutil
import types
from collections import defaultdict

import pytest
import torch

from loom.checkpoint.manager import step_dir_name
from loom.config.errors import ConfigError
from loom.methods import check_config
from loom.methods.rloo import LeaveOneOut, rloo_advantages, sequence_kl
from loom.numerics import IGNORE
from loom.rl.rewards import Rewards
from loom.rl.rollout import RolloutBatch, std_of, token_logps
from loom.train.trainer import Trainer
from tests.tiny import tiny_config

B, T, K = 8, 6, 4
TRL_VERSION = "1.16.0"  # the version compared; another may move RLOO's math


def trl():
    import trl as trl_

    assert trl_.__version__ == TRL_VERSION, trl_.__version__
    from trl.trainer.rloo_trainer import RLOOTrainer

    return RLOOTrainer


def exact(prompts, completions, completion_ids, answer, **fields):
    return [float(c == a) for c, a in zip(completions, answer)]


def length(prompts, completions, completion_ids, **fields):
    return [0.1 * len(c) for c in completions]


def rollouts(seed: int = 0, completions=("1", "2", "1", "22", "2", "2", "3", "9")):
    """B completions of B / K prompts, K each: texts, ids, rollout-time and reference log-probabilities (B, T)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    ref = old + torch.randn(B, T, generator=g) * 0.3
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(B // K) for _ in range(K)]
    ids = [[5] * (1 + i % T) for i in range(B)]
    return rows, list(completions), ids, old, ref


def stand_in(RLOOTrainer, beta: float, normalize: bool, clip, old, ref, rows, completions, ids):
    """The attributes _generate_and_score_completions reads (one process), _generate returning ``completions``."""
    model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    ref_model = types.SimpleNamespace(training=False, is_gradient_checkpointing=False)
    fake = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(
            device=torch.device("cpu"),
            process_index=0,
            is_main_process=True,
            num_processes=1,
            reduce=lambda t, reduction: t,
            gather=lambda t: t,
            gather_for_metrics=lambda t: t,
        ),
        model=model,
        ref_model=ref_model,
        _generate=lambda prompts: ([[1, 2]] * len(prompts), ids, completions),
        _tokenizer=types.SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        eos_token_ids=[3],
        args=types.SimpleNamespace(
            per_device_train_batch_size=B, gradient_checkpointing_kwargs=None, report_to=[]
        ),
        beta=beta,
        num_generations=K,
        reward_weights=torch.tensor([1.0, 0.5]),
        reward_clip_range=clip,
        normalize_advantages=normalize,
        reward_funcs=[exact, length],
        reward_processing_classes=[None, None],
        reward_func_names=["exact", "length"],
        state=types.SimpleNamespace(global_step=0),
        _log_completion_extra=None,
        _log_metric=None,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
            "images": [],
        },
        _pending_extra_logs={},
        _pending_metrics={},
        log_multimodal=False,
    )
    table = {id(model): old, id(ref_model): ref}
    fake._get_per_token_logps_and_entropies = lambda m, *a, **k: (table[id(m)][:, : a[2]], None, None)
    fake._calculate_rewards = functools.partial(RLOOTrainer._calculate_rewards, fake)
    return fake


@pytest.mark.parametrize(
    "beta,normalize,clip", [(0.0, False, None), (0.05, False, None), (0.05, True, (0.0, 1.0))]
)
def test_advantages_and_reward_figures_equal_trl(beta, normalize, clip):
    RLOOTrainer = trl()
    rows, completions, ids, old, ref = rollouts()
    fake = stand_in(RLOOTrainer, beta, normalize, clip, old, ref, rows, completions, ids)
    out = RLOOTrainer._generate_and_score_completions(fake, rows)
    got = fake._metrics["train"]

    rewards = Rewards(["tests.unit.test_rloo:exact", "tests.unit.test_rloo:length"], [1.0, 0.5])
    total, per = rewards.score(
        [r["prompt"] for r in rows], completions, ids, {"answer": [r["answer"] for r in rows]}
    )
    mask = out["completion_mask"].float()  # (B, T): each completion's own tokens
    kl = sequence_kl(old, ref, mask)
    advantages, zero_std = rloo_advantages(total, K, kl, beta, normalize, clip)
    torch.testing.assert_close(advantages, out["advantages"], rtol=1e-5, atol=1e-6)
    assert advantages.abs().min() > 1e-3  # no advantage is trivially 0
    assert float(zero_std.float().mean()) == pytest.approx(got["frac_reward_zero_std"][0], abs=1e-7)
    # the reward figures loom logs (loom.rl.rollout.Rollouts.set_stats) from the same sums
    n = float(len(total))
    assert float(total.mean()) == pytest.approx(got["reward"][0], rel=1e-6)
    assert std_of(float(total.sum()), float((total.double() ** 2).sum()), n) == pytest.approx(
        got["reward_std"][0], rel=1e-5
    )
    for k, name in enumerate(("exact", "length")):
        col = per[:, k].double()
        assert float(col.mean()) == pytest.approx(got[f"rewards/{name}/mean"][0], rel=1e-6)
        assert std_of(float(col.sum()), float((col**2).sum()), n) == pytest.approx(
            got[f"rewards/{name}/std"][0], rel=1e-5
        )
    if beta:  # per completion token over the batch
        assert float(kl.sum() / mask.sum()) == pytest.approx(got["kl"][0], rel=1e-5)


def test_equal_rewards_in_a_group_give_zero_std_and_zero_advantages():
    RLOOTrainer = trl()
    rows, _, ids, old, ref = rollouts(completions=("1",) * 4 + ("2", "2", "3", "9"))
    fake = stand_in(RLOOTrainer, 0.0, False, None, old, ref, rows, ["1"] * 4 + ["2", "2", "3", "9"], ids)
    out = RLOOTrainer._generate_and_score_completions(fake, rows)
    total = torch.tensor([1.05] * 4 + [1.05, 1.05, 0.05, 0.05])
    advantages, zero_std = rloo_advantages(total, K)
    torch.testing.assert_close(advantages, out["advantages"], rtol=1e-5, atol=1e-6)
    assert zero_std.tolist() == [True, False] and fake._metrics["train"]["frac_reward_zero_std"] == [0.5]


def tiny_model(tmp_path):
    from tests.unit.test_orpo import models

    return models(tmp_path)[1]


def batch(seed: int = 0) -> RolloutBatch:
    """B rows of prompt (3 tokens) + completion (1..6 tokens), right-padded; advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    s = 3 + T
    inputs = torch.randint(1, 200, (B, s), generator=g)
    labels = torch.full((B, s), IGNORE)
    for i in range(B):
        n = 1 + i % T
        labels[i, 2 : 2 + n] = (
            inputs[i, 3 : 3 + n] if 3 + n <= s else torch.randint(1, 200, (n,), generator=g)
        )
    positions = torch.arange(s).expand(B, s).contiguous()
    return RolloutBatch(
        inputs, labels, positions, torch.zeros_like(positions), advantages=torch.randn(B, generator=g)
    )


def test_loss_clip_fractions_and_gradient_equal_trl(tmp_path):
    """A second iteration on a batch (the rollout-time log-probabilities moved away): the objective's forward on a
    tiny model equals TRL's _compute_loss given the same model's per-token log-probabilities; so do the clip
    fractions (both regions occur) and the gradient."""
    RLOOTrainer = trl()
    model = tiny_model(tmp_path)
    mb = batch(4)
    mask = (mb.labels != IGNORE).float()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        now = token_logps(model(mb.inputs), mb.labels)
    mb.old_logps = (now + torch.randn(now.shape, generator=g) * 0.3) * mask
    cfg = types.SimpleNamespace(grpo=types.SimpleNamespace(temperature=1.0, epsilon=0.2, epsilon_high=0.28))
    objective = LeaveOneOut(cfg)
    loss = objective.forward(model, mb, None) / B
    stats = {k: float(v) / B for k, v in objective.step_stats().items()}
    loss.backward()
    mine = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    def per_token(m, *a, **k):
        return token_logps(model(mb.inputs), mb.labels) * mask, torch.zeros_like(mask), None

    fake = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        aux_loss_enabled=False,
        epsilon_low=0.2,
        epsilon_high=0.28,
        accelerator=types.SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=per_token,
    )
    inputs = {
        "prompt_ids": torch.ones(B, 0, dtype=torch.long),
        "prompt_mask": torch.ones(B, 0, dtype=torch.long),
        "completion_ids": mb.labels.clamp(min=0),
        "completion_mask": mask.long(),
        "old_logps": (mb.old_logps * mask).sum(1),
        "advantages": mb.advantages,
    }
    theirs = RLOOTrainer._compute_loss(fake, fake.model, inputs)
    torch.testing.assert_close(loss, theirs, rtol=1e-5, atol=1e-6)
    got = fake._metrics["train"]
    assert got["clip_ratio/low_mean"][0] > 0 and got["clip_ratio/high_mean"][0] > 0  # both regions occur
    for name, key in (("low", "low_mean"), ("high", "high_mean"), ("region", "region_mean")):
        assert stats[f"clip_ratio/{name}"] == pytest.approx(got[f"clip_ratio/{key}"][0], abs=1e-6)
    theirs.backward()
    for a, p in zip(mine, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)


def rl_config(tmp_path, name: str, objective: str, **overrides):
    """A few steps of ``objective`` on the embedded task: one warm-up step, then RL."""
    return tiny_config(
        tmp_path / name,
        None,
        **{
            "training.objective": objective,
            "training.steps": 4,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 4,
            "grpo.warmup_steps": 1,
            "grpo.max_new_tokens": 4,
            "metrics.progress": "false",
            **overrides,
        },
    )


def test_config_rules(tmp_path):
    with pytest.raises(ConfigError, match="rloo.normalize_advantages"):
        check_config(rl_config(tmp_path, "a", "grpo", **{"rloo.normalize_advantages": "true"}))
    with pytest.raises(ConfigError, match="grpo.loss_type"):
        check_config(rl_config(tmp_path, "b", "rloo", **{"grpo.loss_type": "grpo"}))
    for bad in ("2,1", "1", "a,b", "nan,1"):
        with pytest.raises(ConfigError, match="rloo.reward_clip"):
            check_config(rl_config(tmp_path, "c", "rloo", **{"rloo.reward_clip": bad}))
    with pytest.raises(ConfigError, match="parallel.pp"):
        check_config(rl_config(tmp_path, "d", "rloo", **{"parallel.pp": 2}))
    check_config(
        rl_config(
            tmp_path,
            "e",
            "rloo",
            **{"rloo.normalize_advantages": "true", "rloo.reward_clip": "-1,1", "grpo.beta": 0.1},
        )
    )


def test_embedded_default_trains_from_the_cli(tmp_path, capsys):
    """`loom train --training.objective rloo` with nothing but the tiny sizes: the warm-up, then RLOO's steps with
    its figures (the KL term on)."""
    from loom.cli.main import main as loom_main
    from tests.tiny import tiny_args

    args = tiny_args(
        tmp_path / "run", None, **{"training.steps": 3, "grpo.warmup_steps": 1, "grpo.beta": 0.05}
    )
    assert loom_main(["train", "--training.objective", "rloo", *args]) in (0, None)
    assert "data: rloo rollouts from " in capsys.readouterr().out  # the startup line names the method
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and steps[0].get("grpo/warmup") == 1.0
    for r in steps[1:]:
        assert torch.isfinite(torch.tensor(r["loss"]))
        assert {"reward", "kl", "frac_reward_zero_std", "clip_ratio/region"} <= set(r)


def test_resume_mid_run_continues_bitwise(tmp_path):
    """Saved at step 3 (the reference taken at step 2), resumed: steps 4-5 equal the uninterrupted run's bitwise."""
    over = {
        "training.steps": 5,
        "grpo.beta": 0.2,
        "grpo.iterations": 2,
        "run.deterministic": "true",
        "checkpoint.every": 3,
        "checkpoint.keep": 0,
    }
    whole = Trainer(rl_config(tmp_path, "whole", "rloo", **over)).fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "part", ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(tmp_path / "part" / "checkpoints" / step_dir_name(5), ignore_errors=True)
    resumed = Trainer(rl_config(tmp_path, "part", "rloo", **over)).fit()
    keys = ("step", "loss", "grad_norm", "reward", "kl")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole[3:]]
