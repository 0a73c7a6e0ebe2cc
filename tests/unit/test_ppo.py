"""PPO (loom.rl.ppo, loom.rl.ppo_objective): the per-token rewards with the KL penalty, GAE, whitening, and the
clipped policy and value losses equal TRL's PPOTrainer on the same log-probabilities, values, rewards and masks
(1e-5); GAE equals a direct per-row loop; `loom train --training.objective ppo` runs out of the box; the config rules.

TRL 1.16 (the dev dependency) no longer ships PPO: ``trl_*`` below restate the computations of
``trl/experimental/ppo/ppo_trainer.py`` (huggingface/trl at d6196b6, ``PPOTrainer.train``: steps 4-6 of the
rollout and the mini-batch loss), written out here as the reference on tensors laid out as TRL lays them out
(completions only, right-padded, the masks TRL derives from ``sequence_lengths``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loom.rl.ppo import (
    gae,
    kl_estimate,
    last_token_index,
    policy_losses,
    ppo_loss,
    token_rewards,
    value_losses,
    whiten,
)

B, T = 5, 7


# ---- TRL's computations (trl/experimental/ppo/ppo_trainer.py), as references --------------------------------------


def trl_masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


def trl_masked_whiten(values, mask, shift_mean=True):
    mean = trl_masked_mean(values, mask)
    var = trl_masked_mean((values - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def trl_rewards_and_gae(
    logprobs, ref_logprobs, values, scores, lengths, kl_coef, estimator, gamma, lam, whiten_rewards
):
    """TRL's steps 4-6 with the score on each completion's last token: TRL adds it at ``sequence_lengths_p1`` (one
    past the last token, a position whose value it keeps); given ``sequence_lengths`` one less than loom's last
    index, TRL's p1 masks are loom's completion masks, so both compute on the same masks."""
    idx = torch.arange(T).repeat(B, 1)
    # TRL's sequence_lengths: sequence_lengths_p1 = lengths - 1 = the last token's index
    seq_len = lengths - 2
    p1 = seq_len + 1
    padding_mask_p1 = idx > p1[:, None]
    logprobs = torch.masked_fill(logprobs, padding_mask_p1, 1.0)  # INVALID_LOGPROB, beyond every mask used
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask_p1, 1.0)
    values = torch.masked_fill(values, padding_mask_p1, 0)
    logr = ref_logprobs - logprobs
    kl = -logr if estimator == "k1" else (logr.exp() - 1) - logr
    rewards = (-kl_coef * kl).clone()
    end = torch.where(p1 < T, p1, seq_len)
    rewards[torch.arange(B), end] += scores
    rewards = torch.masked_fill(rewards, padding_mask_p1, 0)  # (TRL keeps -kl_coef x INVALID past p1: unused)
    if whiten_rewards:
        rewards = trl_masked_whiten(rewards, ~padding_mask_p1, shift_mean=False)
        rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
    last, reversed_ = 0, []
    for t in reversed(range(T)):
        next_values = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        reversed_.append(last)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + values
    return kl, rewards, advantages, returns, ~padding_mask_p1


def trl_minibatch_loss(
    new_logprobs, logprobs, advantages, vpred, values, returns, mask, cliprange, cliprange_value, vf_coef
):
    """TRL's mini-batch loss (one micro-batch, policy and value on the same mask) and its clip fractions."""
    vpredclipped = torch.clamp(vpred, values - cliprange_value, values + cliprange_value)
    vf_losses1, vf_losses2 = torch.square(vpred - returns), torch.square(vpredclipped - returns)
    vf_loss = 0.5 * trl_masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    vf_clipfrac = trl_masked_mean((vf_losses2 > vf_losses1).float(), mask)
    ratio = torch.exp(new_logprobs - logprobs)
    pg_losses, pg_losses2 = (
        -advantages * ratio,
        -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange),
    )
    pg_loss = trl_masked_mean(torch.max(pg_losses, pg_losses2), mask)
    pg_clipfrac = trl_masked_mean((pg_losses2 > pg_losses).float(), mask)
    return pg_loss + vf_coef * vf_loss, pg_loss, vf_loss, pg_clipfrac, vf_clipfrac


def rollouts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3 - 0.1  # (B, T) log-probabilities
    ref = old + torch.randn(B, T, generator=g) * 0.3
    new = old + torch.randn(B, T, generator=g) * 0.4  # the policy moved: some ratios leave [0.8, 1.2]
    values = torch.randn(B, T, generator=g)
    vpred = values + torch.randn(B, T, generator=g) * 0.5
    scores = torch.randn(B, generator=g) * 2
    lengths = torch.tensor([7, 3, 5, 2, 6])  # completion tokens per row (one row fills the width)
    mask = torch.arange(T)[None] < lengths[:, None]
    return old, ref, new, values, vpred, scores, lengths, mask


# ---- the math ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator,whiten_rewards", [("k1", False), ("k3", True)])
def test_rewards_gae_and_whitening_equal_trl(estimator, whiten_rewards):
    old, ref, _, values, _, scores, lengths, mask = rollouts()
    kl_ref, rewards_ref, adv_ref, ret_ref, trl_mask = trl_rewards_and_gae(
        old, ref, values, scores, lengths, 0.05, estimator, 0.99, 0.95, whiten_rewards
    )
    assert torch.equal(trl_mask, mask)
    m = mask.float()
    kl = kl_estimate(old, ref, estimator)
    torch.testing.assert_close(kl * m, kl_ref * m, rtol=1e-5, atol=1e-6)
    rewards = token_rewards(scores, mask, kl, 0.05)
    if whiten_rewards:
        rewards = whiten(rewards, mask, shift_mean=False)
    torch.testing.assert_close(rewards, rewards_ref * m, rtol=1e-5, atol=1e-6)
    adv, ret = gae(rewards, values * m, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, adv_ref * m, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret, ret_ref * m, rtol=1e-5, atol=1e-6)
    # TRL whitens the advantages over ~padding_mask (its sequence_lengths: one token less than this mask); on the
    # same mask the two whitenings agree
    torch.testing.assert_close(whiten(adv, mask), trl_masked_whiten(adv_ref, mask) * m, rtol=1e-5, atol=1e-6)


def test_gae_equals_a_direct_loop():
    """A_t = sum_k (gamma lam)^k delta_{t+k} over each row's own tokens, V after the last token 0; completions that
    start at different positions (after prompts of different lengths), as the rollouts lay them out."""
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    spans = [(2, 9), (0, 10), (5, 6), (3, 7)]  # [start, end) of each row's completion
    mask = torch.zeros(4, 10, dtype=torch.bool)
    for i, (s, e) in enumerate(spans):
        mask[i, s:e] = True
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i, (s, e) in enumerate(spans):
        r, v = rewards[i, s:e].double().tolist(), values[i, s:e].double().tolist() + [0.0]
        deltas = [r[t] + gamma * v[t + 1] - v[t] for t in range(e - s)]
        for t in range(e - s):
            expected = sum((gamma * lam) ** k * deltas[t + k] for k in range(e - s - t))
            assert adv[i, s + t].item() == pytest.approx(expected, abs=1e-5)
            assert ret[i, s + t].item() == pytest.approx(expected + v[t], abs=1e-5)
    assert not adv[~mask].any() and not ret[~mask].any()


def test_losses_equal_trl():
    old, ref, new, values, vpred, scores, lengths, mask = rollouts(2)
    m = mask.float()
    adv, ret = gae(token_rewards(scores, mask), values * m, mask, 1.0, 0.95)
    adv = whiten(adv, mask)
    expected, pg_ref, vf_ref, pg_clip_ref, vf_clip_ref = trl_minibatch_loss(
        new, old, adv, vpred, values * m, ret, m, 0.2, 0.2, 0.1
    )
    got = ppo_loss(new, old, adv, vpred, values * m, ret, mask, 0.2, 0.2, 0.1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    pg, pg_clipped = policy_losses(new, old, adv, 0.2)
    vf, vf_clipped = value_losses(vpred, values * m, ret, 0.2)
    tokens = m.sum()
    torch.testing.assert_close((pg * m).sum() / tokens, pg_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close((vf * m).sum() / tokens, vf_ref, rtol=1e-5, atol=1e-6)
    assert 0 < float((pg_clipped * m).sum() / tokens) == pytest.approx(float(pg_clip_ref), abs=1e-6)
    assert 0 < float((vf_clipped * m).sum() / tokens) == pytest.approx(float(vf_clip_ref), abs=1e-6)


def test_last_token_takes_the_score():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    assert last_token_index(mask).tolist() == [2, 3, 2]
    rewards = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert rewards.tolist() == [[0, 0, 1, 0], [0, 0, 0, 2], [0, 0, 3, 0]]


# ---- the objective in a run ---------------------------------------------------------------------------------------


def run(tmp_path, name: str, steps: int, **extra) -> list[dict]:
    from loom.config import build_config
    from loom.methods.ppo import ProximalPolicy
    from loom.train.trainer import Trainer
    from tests.tiny import tiny_overrides

    over = tiny_overrides(
        str(tmp_path / name),
        None,
        **{
            "training.objective": "ppo",
            "training.steps": steps,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 4,
            "grpo.group_size": 4,
            "grpo.max_new_tokens": 4,
            "metrics.progress": "false",
            **extra,
        },
    )
    cfg = build_config(None, {k: str(v) for k, v in over.items()})
    return Trainer(cfg, objective=ProximalPolicy(cfg)).fit()


def test_embedded_default_runs(tmp_path):
    """`loom train --training.objective ppo`'s path: the warm-up, then PPO with a frozen-copy reference, two passes
    over two mini-batches of each batch of rollouts; every figure finite, the first PPO step's KL 0."""
    records = run(
        tmp_path,
        "ppo",
        6,
        **{"grpo.warmup_steps": 1, "ppo.epochs": 2, "ppo.mini_batches": 2, "ppo.kl_coef": 0.1},
    )
    assert [("grpo/warmup" in r) for r in records] == [True] + [False] * 5
    ppo = records[1:]
    for r in ppo:
        for key in (
            "loss",
            "grad_norm",
            "ppo/policy_loss",
            "ppo/value_loss",
            "ppo/approx_kl",
            "reward",
            "ppo/values",
            "ppo/returns",
            "ppo/rollout_kl",
        ):
            assert r[key] is not None and r[key] == r[key] and abs(r[key]) < 1e3, (key, r)
    assert ppo[0]["ppo/rollout_kl"] == 0.0 and ppo[0]["ppo/approx_kl"] < 1e-8  # reference = policy; ratio 1
    # one batch of rollouts, 4 steps
    assert ppo[0]["time/generation_s"] > 0 and ppo[1]["time/generation_s"] == 0
    assert ppo[4]["time/generation_s"] > 0
    assert ppo[3]["ppo/approx_kl"] > 0  # later steps on the same rollouts have moved the policy


def test_cli_default_runs(tmp_path, capsys):
    """`loom train --training.objective ppo` with nothing else but a short run: the embedded task and rewards."""
    from loom.cli.train import main

    rd = tmp_path / "cli"
    assert main(
        [
            "--training.objective",
            "ppo",
            "--training.steps",
            "3",
            "--grpo.warmup_steps",
            "1",
            "--run.dir",
            str(rd),
            "--metrics.progress",
            "false",
            "--metrics.every",
            "1",
            "--checkpoint.at_end",
            "false",
        ]
    ) in (0, None)
    with open(os.path.join(rd, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    assert len(records) == 3 and "rewards/exact_answer" in records[-1] and "ppo/value_loss" in records[-1]
    last = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")][
        -1
    ]  # reward, accuracy
    assert (
        f"| reward {records[-1]['reward']:.3f} | acc {records[-1]['rewards/exact_answer']:.3f} |" in last
    ), last


def test_config_rules():
    from loom.config import build_config
    from loom.config.errors import ConfigError
    from loom.methods import check_config

    def check(**over):
        check_config(build_config(None, {k: str(v) for k, v in over.items()}))

    check(**{"training.objective": "ppo", "ppo.kl_coef": 0.1, "grpo.group_size": 2})
    with pytest.raises(ConfigError, match="ppo.vf_coef"):
        check(**{"ppo.vf_coef": 0.5})  # a [ppo] field without the objective
    with pytest.raises(ConfigError, match="grpo.beta"):
        check(**{"training.objective": "ppo", "grpo.beta": 0.1})  # GRPO's loss fields do nothing under PPO
    with pytest.raises(ConfigError, match="ppo.kl_estimator"):
        check(**{"training.objective": "ppo", "ppo.kl_penalty": "loss", "ppo.kl_estimator": "k3"})
    check(
        **{"training.objective": "ppo", "parallel.tp": 2}
    )  # the TP plan splits the value head and the critic
    with pytest.raises(ConfigError, match="parallel.pp"):
        check(**{"training.objective": "ppo", "parallel.pp": 2})


@pytest.mark.exhaustive
def test_recipe_raises_the_accuracy(tmp_path):
    """recipes/ppo_debug.toml, shortened to 40 PPO steps after its supervised warm-up: the greedy exact-match
    accuracy (loom.rl.arithmetic:greedy_accuracy, the recipe's eval hook) rises by a clear margin: at least a third
    of the warm-up's errors are gone (as GRPO's test_embedded_default_raises_the_accuracy asks)."""
    import pathlib

    from loom.config import build_config
    from loom.methods.ppo import ProximalPolicy
    from loom.train.trainer import Trainer

    root = pathlib.Path(__file__).resolve().parents[2]
    cfg = build_config(
        str(root / "recipes" / "ppo_debug.toml"),
        {
            "run.dir": str(tmp_path / "run"),
            "training.steps": "160",
            "metrics.every": "1",
            "metrics.progress": "false",
            "metrics.tensorboard": "false",
            "checkpoint.at_end": "false",
        },
    )
    records = Trainer(cfg, objective=ProximalPolicy(cfg)).fit()
    accuracy = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    rewards = [round(r["reward"], 3) for r in records if "reward" in r]
    assert len(rewards) == 40 and sorted(accuracy) == [40, 80, 120, 160]
    assert accuracy[120] > 0.3, accuracy  # the warm-up taught the format
    assert 1 - accuracy[160] < (1 - accuracy[120]) * 2 / 3, (accuracy, rewards)


def test_reward_model_scores_the_rollouts(tmp_path):
    """A reward model's scorer (what grpo.reward_model loads with loom.train.reward.load_reward_model, tested in
    test_reward) scores prompt + completion; alone (no reward functions) it is the reward: rewards/reward_model."""
    from loom.config import build_config
    from loom.infer.reward import RewardScorer, attach_score_head
    from loom.methods.ppo import ProximalPolicy
    from loom.models.llama import Llama
    from loom.train.trainer import Trainer
    from tests.tiny import tiny_overrides

    over = tiny_overrides(
        str(tmp_path / "ppo-rm"),
        None,
        **{
            "training.objective": "ppo",
            "training.steps": 2,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 4,
            "grpo.group_size": 4,
            "grpo.max_new_tokens": 4,
            "grpo.warmup_steps": 0,
            "grpo.prompts": str(tmp_path / "prompts.jsonl"),
            "metrics.progress": "false",
        },
    )
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(9))
    )
    cfg = build_config(None, {k: str(v) for k, v in over.items()})
    trainer = Trainer(cfg, objective=ProximalPolicy(cfg))
    torch.manual_seed(0)
    scorer = attach_score_head(Llama(trainer.model_args))
    torch.nn.init.normal_(scorer.output.weight, std=1.0)
    rollouts = trainer.objective.rollouts
    rollouts.reward_model, rollouts.rewards = RewardScorer(scorer.eval()), None
    records = trainer.fit()
    assert all(r["reward"] == pytest.approx(r["rewards/reward_model"]) for r in records)
    assert "rewards/exact_answer" not in records[0] and records[0]["reward_std"] > 0


def test_critic_model_is_materialized_and_starts_as_the_policy(tmp_path):
    """ppo.critic model: the critic inside the policy is materialized with it (its RoPE table too), copies the
    policy's trunk (not the head) as PPO starts, and one forward of the policy gives its values."""
    from loom.config import build_config
    from loom.methods.ppo import ProximalPolicy
    from loom.rl.ppo_objective import copy_trunk, forward_with_values
    from loom.train.trainer import Trainer
    from tests.tiny import tiny_overrides

    over = tiny_overrides(
        str(tmp_path / "critic"),
        None,
        **{
            "training.objective": "ppo",
            "ppo.critic": "model",
            "training.global_batch_size": 8,
            "grpo.group_size": 4,
            "metrics.progress": "false",
        },
    )
    cfg = build_config(None, {k: str(v) for k, v in over.items()})
    model = Trainer(cfg, objective=ProximalPolicy(cfg)).parts[0]
    critic = model.critic
    assert torch.equal(critic.rope, model.rope)
    head = critic.output.weight.clone()
    assert not torch.equal(critic.tok_embeddings.weight, model.tok_embeddings.weight)
    copy_trunk(model, critic)
    assert torch.equal(critic.tok_embeddings.weight, model.tok_embeddings.weight)
    assert torch.equal(critic.layers["1"].feed_forward.w2.weight, model.layers["1"].feed_forward.w2.weight)
    assert torch.equal(critic.output.weight, head) and critic.output.weight.shape == (1, model.args.dim)
    tokens = torch.randint(0, 100, (2, 9))
    logits, values = forward_with_values(model, tokens)
    assert logits.shape[:2] == values.shape == (2, 9)
    torch.testing.assert_close(values, critic(tokens).squeeze(-1))
    torch.testing.assert_close(logits, model(tokens))


def test_resumed_run_continues_with_its_critic(tmp_path):
    """A checkpoint between two batches of rollouts holds the value function (here a separate critic): the resumed
    run's steps equal the uninterrupted run's (the rollouts are seeded by step; no KL: a resumed run takes its
    reference from the resumed policy)."""
    extra = {
        "grpo.warmup_steps": 1,
        "ppo.critic": "model",
        "ppo.kl_coef": 0.0,
        "ppo.epochs": 2,
        "run.deterministic": "true",
    }
    import shutil

    whole = run(tmp_path, "run", 5, **extra, **{"checkpoint.every": 3})  # steps 2-3: one batch of rollouts
    shutil.rmtree(
        tmp_path / "run" / "checkpoints" / "step_00000005", ignore_errors=True
    )  # (none without at_end)
    resumed = run(tmp_path, "run", 5, **extra, **{"checkpoint.every": 3})
    assert [r["step"] for r in resumed] == [4, 5]
    for a, b in zip(resumed, whole[3:]):
        for key in ("loss", "grad_norm", "ppo/value_loss", "ppo/values", "reward"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (key, a, b)


@pytest.mark.parametrize("critic", ["head", "model"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_recipe_on_cuda_raises_the_accuracy(tmp_path, critic):
    """recipes/ppo_debug.toml on CUDA in bfloat16 (the engine with CUDA graphs), with either value function: the
    greedy accuracy's errors after the warm-up fall by a third by the end."""
    import pathlib

    from loom.config import build_config
    from loom.methods.ppo import ProximalPolicy
    from loom.train.trainer import Trainer

    root = pathlib.Path(__file__).resolve().parents[2]
    cfg = build_config(
        str(root / "recipes" / "ppo_debug.toml"),
        {
            "run.dir": str(tmp_path / "run"),
            "run.device": "cuda",
            "training.dtype": "bfloat16",
            "ppo.critic": critic,
            "metrics.every": "1",
            "metrics.progress": "false",
            "metrics.tensorboard": "false",
            "checkpoint.at_end": "false",
        },
    )
    records = Trainer(cfg, objective=ProximalPolicy(cfg)).fit()
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    accuracy = {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}
    assert 1 - accuracy[200] < (1 - accuracy[120]) * 2 / 3, accuracy


@pytest.mark.parametrize("critic", ["head", "model"])
def test_init_from_loads_the_policy_beside_its_value_function(tmp_path, critic):
    """model.init_from: the folder's weights load into the policy (the value function is hidden while they load:
    the folder has none); the value function keeps its seeded init."""
    from loom.checkpoint.hf.export import export_hf
    from loom.config import build_config
    from loom.methods.ppo import ProximalPolicy
    from loom.models.llama import FLAVORS, Llama
    from loom.train.trainer import Trainer
    from tests.tiny import tiny_overrides

    args = FLAVORS["debug"].with_(vocab_size=384)
    torch.manual_seed(5)
    base = Llama(args)
    export_hf(base.state_dict(), args, str(tmp_path / "hf"))
    over = tiny_overrides(
        str(tmp_path / "run"),
        None,
        **{
            "training.objective": "ppo",
            "ppo.critic": critic,
            "model.init_from": str(tmp_path / "hf"),
            "training.global_batch_size": 8,
            "grpo.group_size": 4,
            "metrics.progress": "false",
        },
    )
    cfg = build_config(None, {k: str(v) for k, v in over.items()})
    model = Trainer(cfg, objective=ProximalPolicy(cfg)).parts[0]
    assert torch.equal(model.layers["0"].attention.wq.weight, base.layers["0"].attention.wq.weight)
    value = model.value_head.weight if critic == "head" else model.critic.output.weight
    # its seeded init (std 0.02)
    assert value.shape == (1, args.dim) and 0 < float(value.detach().std()) < 0.1
