"""Online DPO (``training.objective online_dpo``): TRL 1.16's OnlineDPOTrainer.training_step, its own code called on a
stand-in object (its sampling, decoding and forwards replaced by the same completions and the same tiny model's
per-token log-probabilities), gives the same loss, gradient and logged figures as loom's ranking (``pair_order``)
and the objective's forward, for the sigmoid and IPO losses, with and without the missing-EOS penalty; the embedded
default trains from ``loom train``; the config rules."""

from __future__ import annotations

import functools
import json
import math
import shutil
import types
from collections import defaultdict

import pytest
import torch

from loom.checkpoint.manager import step_dir_name
from loom.config.errors import ConfigError
from loom.methods import check_config
from loom.methods.online_dpo import OnlinePreference, PairRollouts, pair_order
from loom.numerics import IGNORE
from loom.rl.rewards import Rewards
from loom.rl.rollout import rows_to_batches, token_logps
from loom.train.trainer import Trainer

N = 4  # prompts: 2N completions
EOS = 2
TRL_VERSION = "1.16.0"  # the version compared; another may move online DPO's math


def trl():
    import trl as trl_

    assert trl_.__version__ == TRL_VERSION, trl_.__version__
    from trl.experimental.online_dpo import OnlineDPOTrainer

    return OnlineDPOTrainer


def exact(prompts, completions, completion_ids, answer, **fields):
    return [float(c == a) for c, a in zip(completions, answer)]


def length(prompts, completions, completion_ids, **fields):
    return [0.1 * len(c) for c in completions]


def sampled():
    """N prompts and two completions each, loom's layout (prompt p's at rows 2p, 2p + 1): texts, token ids (some
    without an EOS), one tie."""
    prompts = [f"{i}+1=" for i in range(N)]
    answers = [str(i + 1) for i in range(N)]
    texts = ["1", "11", "2", "2", "33", "3", "5", "4"]  # pair 1 ties: the first is chosen
    ids = [[40 + len(t)] * len(t) + ([EOS] if i % 3 else []) for i, t in enumerate(texts)]
    return prompts, answers, texts, ids


def tiny_model(tmp_path):
    from tests.unit.test_orpo import models

    return models(tmp_path)[1]


@pytest.mark.parametrize("loss,penalty", [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.7)])
def test_loss_gradient_and_figures_equal_trl(tmp_path, loss, penalty):
    OnlineDPOTrainer = trl()
    model = tiny_model(tmp_path)
    beta = 0.3 if loss == "sigmoid" else 0.5
    prompts, answers, texts, ids = sampled()
    prompt_ids = [[30 + i, 43, 49, 61] for i in range(N)]  # "i+1="
    rows = [prompt_ids[p] for p in range(N) for _ in range(2)]

    # loom: the rewards, the ranking, one micro-batch of the N pairs (chosen rows first)
    rewards = Rewards(["tests.unit.test_online_dpo:exact", "tests.unit.test_online_dpo:length"], [1.0, 0.5])
    total, _ = rewards.score(
        [p for p in prompts for _ in range(2)],
        texts,
        ids,
        {"answer": [a for a in answers for _ in range(2)]},
    )
    eos = torch.tensor([EOS in i for i in ids])
    total = total - penalty * (~eos).float()
    order, first_chosen = pair_order(total, N)
    assert penalty or (first_chosen[1] and total[2] == total[3])  # the tie
    (mb,) = rows_to_batches([rows[i] for i in order], [ids[i] for i in order], 2 * N, 0, 64)
    mask = (mb.labels != IGNORE).float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref = (token_logps(model(mb.inputs), mb.labels) + torch.randn(mask.shape, generator=g) * 0.5) * mask
    ref[0, 3] += 3.0  # pair 0's chosen completion far likelier under the reference: its implicit margin < 0
    ref[N + 1, 3] += 3.0  # pair 1's rejected one: its margin > 0
    mb = PairRollouts(
        mb.inputs, mb.labels, mb.positions, mb.document_ids, ref_token_logps=ref, scores=total[order]
    )
    cfg = types.SimpleNamespace(
        online_dpo=types.SimpleNamespace(beta=beta, loss=loss), grpo=types.SimpleNamespace()
    )
    objective = OnlinePreference(cfg)
    mine = objective.forward(model, mb, None) / N
    stats = {k: float(v) / N for k, v in objective.step_stats().items()}
    mine.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    # TRL: rows 0..N-1 the prompts' first completions, N..2N-1 their second (loom's rows 2p, 2p + 1)
    trl_rows = [2 * p for p in range(N)] + [2 * p + 1 for p in range(N)]
    where = [order.index(r) for r in trl_rows]  # each TRL row's place in loom's micro-batch
    width = max(len(i) for i in ids)
    completion_ids = torch.tensor([ids[r] + [0] * (width - len(ids[r])) for r in trl_rows])
    policy_model = types.SimpleNamespace(train=lambda: None)
    ref_model = object()

    def forward(m, *args):
        """TRL's per-token log-probabilities (2N, width) of its rows: loom's, whose completions start at column 3
        (every prompt is 4 tokens), 0 after a completion's end (the positions TRL masks out of the loss)."""
        if m is ref_model:
            return ref[where][:, 3:]
        return (token_logps(model(mb.inputs), mb.labels) * mask)[where][:, 3:]

    captured = {}
    fake = types.SimpleNamespace(
        args=types.SimpleNamespace(
            use_vllm=False,
            missing_eos_penalty=penalty or None,
            loss_type=loss,
            torch_empty_cache_steps=None,
            optim="adamw_torch",
            n_gpu=1,
            gradient_accumulation_steps=1,
        ),
        accelerator=types.SimpleNamespace(
            device=torch.device("cpu"),
            gather_for_metrics=lambda t: t,
            backward=lambda t, **k: captured.setdefault("loss", t),
        ),
        _generate=lambda m, p, images=None: (None, None, completion_ids, (completion_ids != 0).long(), None),
        _forward=forward,
        ref_model=ref_model,
        eos_token_ids=[EOS],
        processing_class=types.SimpleNamespace(batch_decode=lambda t, **k: [texts[r] for r in trl_rows]),
        reward_funcs=[exact, length],
        reward_processing_classes=[None, None],
        reward_weights=torch.tensor([1.0, 0.5]),
        state=types.SimpleNamespace(epoch=0),
        beta=beta,
        stats=defaultdict(list),
    )
    fake._calculate_rewards_from_functions = functools.partial(
        OnlineDPOTrainer._calculate_rewards_from_functions, fake
    )
    OnlineDPOTrainer.training_step(fake, policy_model, {"prompt": prompts, "answer": answers})
    theirs = captured["loss"]
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    theirs.backward()
    for a, p in zip(grads, model.parameters()):
        # the same terms summed in another order: fp32 rounding at the scale of the gradient's largest entries
        # (5e-7 of it measured on an AMD EPYC, where an atol of 1e-6 failed for gradients of up to 7)
        scale = max(1.0, float(p.grad.abs().max()))
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=2e-6 * scale)
    got = {k: v[0] for k, v in fake.stats.items()}
    assert 0 < got["rewards/accuracies"] < 1 and got["objective/kl"] != 0
    names = {"rewards/accuracy": "rewards/accuracies"}
    for name in OnlinePreference.STATS:
        want = got[names.get(name, name)]
        assert abs(stats[name] - want) <= 1e-5 * max(1.0, abs(want)), (name, stats[name], want)


def test_pair_order_puts_each_micro_batchs_chosen_rows_first():
    rewards = torch.tensor(
        [0.0, 1.0, 2.0, 2.0, 3.0, 1.0, 0.5, 0.7]
    )  # pairs: second, tie (first), first, second
    order, first = pair_order(rewards, 2)
    assert first.tolist() == [False, True, True, False]
    assert order == [1, 2, 0, 3, 4, 7, 5, 6]


def test_config_rules(tmp_path):
    from tests.unit.test_rloo import rl_config

    with pytest.raises(ConfigError, match="online_dpo.beta"):
        check_config(rl_config(tmp_path, "a", "grpo", **{"online_dpo.beta": 0.5}))
    for key, value in (("grpo.group_size", 8), ("grpo.beta", 0.1), ("grpo.iterations", 2)):
        with pytest.raises(ConfigError, match=key):
            check_config(rl_config(tmp_path, "b", "online_dpo", **{key: value}))
    with pytest.raises(ConfigError, match="training.micro_batch_size"):
        check_config(rl_config(tmp_path, "c", "online_dpo", **{"training.micro_batch_size": 1}))
    check_config(
        rl_config(tmp_path, "d", "online_dpo", **{"online_dpo.loss": "ipo", "grpo.temperature": 0.9})
    )


def test_embedded_default_trains_from_the_cli(tmp_path, capsys):
    """`loom train --training.objective online_dpo` with nothing but the tiny sizes: the warm-up, then online DPO's
    steps with TRL's figures; the first step's policy is its own reference (loss ln 2, KL 0)."""
    from loom.cli.main import main as loom_main
    from tests.tiny import tiny_args

    args = tiny_args(tmp_path / "run", None, **{"training.steps": 3, "grpo.warmup_steps": 1})
    assert loom_main(["train", "--training.objective", "online_dpo", *args]) in (0, None)
    assert "data: online_dpo rollouts from " in capsys.readouterr().out  # the startup line names the method
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and steps[0].get("grpo/warmup") == 1.0
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-6) and steps[1]["objective/kl"] == 0.0
    for r in steps[1:]:
        assert set(OnlinePreference.STATS) | {"reward", "val/contain_eos_token"} <= set(r)


@pytest.mark.slow
def test_resume_mid_run_continues_bitwise(tmp_path):
    """Saved at step 3 (the reference taken at step 2), resumed: steps 4-5 equal the uninterrupted run's bitwise."""
    from tests.unit.test_rloo import rl_config

    over = {"training.steps": 5, "run.deterministic": "true", "checkpoint.every": 3, "checkpoint.keep": 0}
    whole = Trainer(rl_config(tmp_path, "whole", "online_dpo", **over)).fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "part", ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(tmp_path / "part" / "checkpoints" / step_dir_name(5), ignore_errors=True)
    resumed = Trainer(rl_config(tmp_path, "part", "online_dpo", **over)).fit()
    keys = ("step", "loss", "grad_norm", "reward", "objective/kl")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole[3:]]
    assert whole[4]["objective/kl"] != 0
