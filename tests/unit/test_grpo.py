"""GRPO's math (loom.rl.grpo): the loss of every normalization, with and without the KL term, equals TRL 1.16's
GRPOTrainer._compute_loss (called on a stand-in object) on the same log-probabilities, advantages and masks; the
clip fractions and KL equal its logged metrics; advantages per group equal TRL's formula; sum / count layout."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from loom.rl.grpo import LOSS_TYPES, group_advantages, grpo_loss, loss_count, loss_sum, token_losses

B, T, MAX_LEN = 6, 9, 12


def rollouts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3 - 0.1  # (B, T) log-probabilities
    logps = old + torch.randn(B, T, generator=g) * 0.4  # the policy moved: some ratios leave [0.8, 1.28]
    ref = old + torch.randn(B, T, generator=g) * 0.2
    lengths = torch.tensor([9, 3, 7, 1, 5, 9])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.int64)  # (B, T)
    adv = torch.randn(B, generator=g)
    return logps, old, ref, mask, adv


def trl_loss(loss_type: str, beta: float, logps, old, ref, mask, adv, eps_low=0.2, eps_high=0.28):
    """TRL's _compute_loss on a stand-in trainer whose model returns ``logps`` as the per-token log-probabilities."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    model = types.SimpleNamespace(training=True)
    fake = types.SimpleNamespace(
        model=model,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        accelerator=types.SimpleNamespace(
            num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x
        ),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )
    inputs = {
        "prompt_ids": torch.ones(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    loss = trl_grpo.GRPOTrainer._compute_loss(fake, model, inputs)
    return loss, fake._metrics["train"]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_equals_trl(loss_type, beta):
    logps, old, ref, mask, adv = rollouts()
    expected, metrics = trl_loss(loss_type, beta, logps, old, ref, mask, adv)
    got = grpo_loss(logps, old, adv, mask, loss_type, 0.2, 0.28, MAX_LEN, ref, beta)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    losses, kl, low, high = token_losses(logps, old, adv, 0.2, 0.28, ref, beta)
    tokens = mask.sum()
    assert float((low * mask).sum() / tokens) == pytest.approx(metrics["clip_ratio/low_mean"][0], abs=1e-6)
    assert float((high * mask).sum() / tokens) == pytest.approx(metrics["clip_ratio/high_mean"][0], abs=1e-6)
    # both regions occur
    assert metrics["clip_ratio/low_mean"][0] > 0 and metrics["clip_ratio/high_mean"][0] > 0
    if beta:
        assert float((kl * mask).sum() / tokens) == pytest.approx(metrics["kl"][0], rel=1e-5)
    # the gradient too: the same function of logps
    mine = logps.clone().requires_grad_(True)
    grpo_loss(mine, old, adv, mask, loss_type, 0.2, 0.28, MAX_LEN, ref, beta).backward()
    theirs = logps.clone().requires_grad_(True)
    trl_loss(loss_type, beta, theirs, old, ref, mask, adv)[0].backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)


def test_on_policy_loss_is_minus_the_mean_advantage():
    """One iteration per batch (old = logps detached): ratio 1, no clipping; the 'grpo' loss is -mean(A)."""
    logps, _, _, mask, adv = rollouts(1)
    loss = grpo_loss(logps, logps.detach(), adv, mask, "grpo", 0.2, 0.2, MAX_LEN)
    assert float(loss) == pytest.approx(-float(adv.mean()), rel=1e-6)
    expected, _ = trl_loss("grpo", 0.0, logps, logps.detach(), logps, mask, adv)
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sums_over_parts_divided_by_the_global_count_give_the_whole_loss(loss_type):
    """Split the rows over 'ranks' / micro-batches: the summed loss over the summed count is the whole batch's."""
    logps, old, ref, mask, adv = rollouts(2)
    whole = grpo_loss(logps, old, adv, mask, loss_type, 0.2, 0.28, MAX_LEN, ref, 0.04)
    total, count = 0.0, 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        losses = token_losses(logps[rows], old[rows], adv[rows], 0.2, 0.28, ref[rows], 0.04)[0]
        total = total + loss_sum(losses, mask[rows], loss_type)
        count = count + loss_count(mask[rows], loss_type, MAX_LEN)
    torch.testing.assert_close(total / count, whole)


def trl_advantages(rewards: torch.Tensor, g: int, scale: str) -> torch.Tensor:
    """TRL 1.16's advantage lines (sum_then_normalize, one reward function), with its own nanstd."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    return adv / (std + 1e-4) if scale != "none" else adv


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_per_group(scale):
    pytest.importorskip("trl")
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 2.0, 0.0])
    adv = group_advantages(rewards, 4, scale)
    torch.testing.assert_close(adv, trl_advantages(rewards, 4, scale), rtol=1e-6, atol=1e-6)
    groups = adv.view(3, 4)
    torch.testing.assert_close(
        groups.sum(dim=1), torch.zeros(3), atol=1e-5, rtol=0
    )  # centred within each group
    assert torch.equal(groups[1], torch.zeros(4))  # equal rewards: no signal
    if scale == "group":  # unit (unbiased) std within each group whose rewards differ
        torch.testing.assert_close(groups[[0, 2]].std(dim=1), torch.ones(2), atol=1e-3, rtol=0)
    # a global batch std handed in (rollouts spread over ranks) replaces the local one
    if scale == "batch":
        torch.testing.assert_close(group_advantages(rewards[:4], 4, "batch", rewards.std()), adv[:4])


@pytest.mark.parametrize("objective", ["grpo", "ppo"])
def test_rollouts_refuse_document_positions(tiny, objective):
    """A rollout is one sequence whose positions start at 0: a packed-documents setting would do nothing."""
    from loom.config import ConfigError
    from loom.methods import check_config

    with pytest.raises(
        ConfigError, match=f"data.document_positions = True: not with training.objective {objective}"
    ):
        check_config(tiny(**{"training.objective": objective, "data.document_positions": "true"}))


def test_a_rollout_batch_moves_with_every_field():
    """``to(device)`` keeps every field of a micro-batch subclass (a field added to MicroBatch once shifted a
    positional copy and dropped the reference's log-probabilities)."""
    from dataclasses import fields

    from loom.rl.ppo_objective import PpoBatch

    t = lambda: torch.randn(2, 3)
    mb = PpoBatch(t(), t(), t(), t(), ref_logps=t(), desirable=t(), advantages=t(), old_logps=t())
    mb.ref_token_logps, mb.old_values, mb.returns, mb.warmup = t(), t(), t(), True
    mb.sampler_logps = t()  # asynchronous GRPO's
    moved = mb.to("cpu")
    assert type(moved) is PpoBatch and moved.warmup
    for f in fields(mb):
        value = getattr(mb, f.name)
        assert value is True or torch.equal(getattr(moved, f.name), value), f.name
