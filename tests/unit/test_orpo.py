"""ORPO (``training.objective orpo``): the loss, rewards and logged statistics equal TRL's ORPOTrainer's for the
same model and batch (fp32), the NLL's token mean is over the global batch whatever the accumulation, the
embedded default trains from ``loom train``, and a run resumed mid-way continues bitwise."""

from __future__ import annotations

import functools
import json
import shutil
import types

import pytest
import torch

from loom.checkpoint.manager import step_dir_name
from loom.cli.main import main as loom_main
from loom.data.loader import MicroBatch
from loom.methods import check_config
from loom.methods.orpo import OddsRatioPreference
from loom.numerics import IGNORE
from tests.tiny import tiny_args, tiny_config


def pair_batch(b: int = 3, s: int = 24, seed: int = 0):
    """A right-padded pair batch as TRL's collators build it (input ids, attention, completion mask; rows chosen
    then rejected) and loom's micro-batch of it (padding marked as document 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (2 * b, s), generator=g)
    mask = torch.zeros(2 * b, s, dtype=torch.long)
    attention = torch.zeros(2 * b, s, dtype=torch.long)
    for i in range(b):
        prompt = int(torch.randint(3, 8, (1,), generator=g))
        for row in (i, b + i):
            n = int(torch.randint(prompt + 2, s + 1, (1,), generator=g))
            mask[row, prompt:n], attention[row, :n] = 1, 1
            ids[row, n:] = 0
    labels = torch.where(mask[:, 1:] > 0, ids[:, 1:], IGNORE)
    labels = torch.cat([labels, torch.full((2 * b, 1), IGNORE)], dim=1)
    mb = MicroBatch(ids, labels, torch.arange(s).expand(2 * b, s), (attention == 0).long())
    return ids, attention, mask, mb


def models(tmp_path):
    """A random tiny HF Llama (modest weights: mean log-probabilities of a few units) and loom's copy of it."""
    from tests.unit.test_hf import loom_from_hf, random_hf_llama, save_hf

    hf = random_hf_llama(tied=False).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(0.3) if p.ndim > 1 else p.fill_(1.0)
    return hf, loom_from_hf(save_hf(hf, tmp_path / "hf"))


def trl_pair_inputs(ids, attention, mask) -> dict:
    """TRL's tokenized pair batch (chosen_* / rejected_*: input ids, attention mask, labels -100 off completions)."""
    b = ids.shape[0] // 2
    labels = torch.where(mask > 0, ids, -100)
    out = {}
    for name, rows in (("chosen", slice(0, b)), ("rejected", slice(b, 2 * b))):
        out[f"{name}_input_ids"] = ids[rows]
        out[f"{name}_attention_mask"] = attention[rows]
        out[f"{name}_labels"] = labels[rows]
    return out


def fake_trainer(cls, **attrs):
    """The attributes a TRL pair trainer's loss methods read, its methods bound to them (no model is wrapped)."""
    fake = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        is_encoder_decoder=False,
        padding_value=0,
        pad_token_id=0,
        label_pad_token_id=-100,
        aux_loss_enabled=False,
        **attrs,
    )
    for name in ("concatenated_inputs", "get_batch_logps"):
        setattr(fake, name, getattr(cls, name))
    for name in ("concatenated_forward", "odds_ratio_loss", "cpo_loss"):
        if hasattr(cls, name):
            setattr(fake, name, functools.partial(getattr(cls, name), fake))
    return fake


def compare(objective, cls, tmp_path, names: dict, **attrs):
    """loom's loss and statistics (one micro-batch = the global batch) against TRL's get_batch_loss_metrics."""
    import trl

    print("trl", trl.__version__)
    hf, model = models(tmp_path)
    ids, attention, mask, mb = pair_batch()
    b = ids.shape[0] // 2
    with torch.no_grad():
        objective.begin([mb], lambda t: t)
        loss = objective.forward(model, mb, None) / b
    stats = {k: float(v) / b for k, v in objective.step_stats().items()}
    fake = fake_trainer(cls, **attrs)
    with torch.no_grad():
        trl_loss, metrics = cls.get_batch_loss_metrics(fake, hf, trl_pair_inputs(ids, attention, mask))
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    for ours, theirs in names.items():
        want = float(metrics[theirs])
        assert abs(stats[ours] - want) <= 1e-5 * max(1.0, abs(want)), (ours, stats[ours], want)


ORPO_STATS = {
    "rewards/chosen": "rewards/chosen",
    "rewards/rejected": "rewards/rejected",
    "rewards/margins": "rewards/margins",
    "rewards/accuracy": "rewards/accuracies",
    "logps/chosen": "logps/chosen",
    "logps/rejected": "logps/rejected",
    "nll_loss": "nll_loss",
    "log_odds_ratio": "log_odds_ratio",
    "log_odds_chosen": "log_odds_chosen",
}


def test_loss_and_statistics_equal_trl(tmp_path):
    trl = pytest.importorskip("trl", minversion="1.16")
    from trl.experimental.orpo import ORPOTrainer

    assert trl.__version__ == "1.16.0"  # the version compared; another may move ORPO's math
    compare(OddsRatioPreference(0.25, 1.0), ORPOTrainer, tmp_path, ORPO_STATS, beta=0.25)


def test_nll_is_the_token_mean_over_the_global_batch():
    """Two micro-batches of unequal token counts: the summed losses over the global count equal one micro-batch
    holding both (the NLL's token mean is the global batch's, not each micro-batch's)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(256, 256)
    model = lambda inputs, positions: emb(inputs)  # any logits: the objective's reduction is what is tested
    _, _, _, one = pair_batch(b=2, seed=1)
    _, _, _, two = pair_batch(b=2, seed=2)
    both = MicroBatch(
        *(
            torch.cat([x[:2], y[:2], x[2:], y[2:]])
            for x, y in zip(
                (one.inputs, one.labels, one.positions, one.document_ids),
                (two.inputs, two.labels, two.positions, two.document_ids),
            )
        )
    )
    objective = OddsRatioPreference(0.1, 1.0)
    with torch.no_grad():
        objective.begin([one, two], lambda t: t)
        split = (objective.forward(model, one, None) + objective.forward(model, two, None)) / 4
        objective.begin([both], lambda t: t)
        whole = objective.forward(model, both, None) / 4
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)


def test_config_rules(tiny):
    from loom.config.errors import ConfigError

    with pytest.raises(ConfigError, match="orpo.beta"):
        check_config(tiny(**{"orpo.beta": 0.5}))  # the section of another objective
    with pytest.raises(ConfigError, match="parallel.pp"):
        check_config(tiny(**{"training.objective": "orpo", "parallel.pp": 2}))
    check_config(tiny(**{"training.objective": "orpo", "orpo.beta": 0.5}))


def cli_run(tmp_path, objective: str, source: str | None, stat: str, steps: int = 2) -> list[dict]:
    """`loom train --training.objective <objective>` (on ``source``, or the embedded default when None): the step
    records, each with ``stat``, every loss finite."""
    extra = {"training.steps": steps, "training.seq_len": 128}
    if source:
        extra["data.source"] = source
    assert loom_main(
        [
            "train",
            "--training.objective",
            objective,
            *tiny_args(tmp_path / "run", tmp_path / "cache", **extra),
        ]
    ) in (0, None)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps_ = [r for r in records if stat in r]
    assert len(steps_) == steps and all(torch.isfinite(torch.tensor(r["loss"])) for r in steps_)
    return steps_


def test_trains_from_the_cli(tmp_path):
    """`loom train --training.objective orpo` on a small jsonl of pairs: finite losses, ORPO's statistics logged."""
    from tests.unit.test_dpo import rows, write_jsonl

    cli_run(tmp_path, "orpo", write_jsonl(tmp_path / "p.jsonl", rows(40)), "log_odds_ratio")


@pytest.mark.slow
def test_embedded_default_trains_from_the_cli(tmp_path):
    """`loom train --training.objective orpo` out of the box on the embedded pairs (preparing them takes a minute)."""
    cli_run(tmp_path, "orpo", None, "log_odds_ratio")


def resume_check(tmp_path, objective: str, stat: str, **extra) -> None:
    """4 steps of ``objective`` on a small jsonl of pairs saved at 2; a copy of the run resumed from step 2 writes
    steps 3..4 exactly as the uninterrupted run did (loss, gradient norm, ``stat``, the batches)."""
    from loom.train.trainer import Trainer
    from tests.unit.test_dpo import rows, write_jsonl

    source = write_jsonl(tmp_path / "p.jsonl", rows(40))
    run = lambda name, **more: tiny_config(
        tmp_path / name,
        tmp_path / "cache",
        **{
            "training.objective": objective,
            "data.source": source,
            "training.seq_len": 64,
            "training.steps": 4,
            "checkpoint.every": 2,
            "checkpoint.keep": 0,
            "run.deterministic": "true",
            **extra,
            **more,
        },
    )
    whole = Trainer(run("whole")).fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "part", ignore=shutil.ignore_patterns(".lock"))
    step2 = str(tmp_path / "part" / "checkpoints" / step_dir_name(2))
    resumed = Trainer(run("part", **{"checkpoint.resume": step2, "checkpoint.overwrite": "true"})).fit()
    key = lambda recs: [(r["step"], r["loss"], r["grad_norm"], r[stat], r["batch_hash"]) for r in recs]
    assert [r["step"] for r in resumed] == [3, 4] and key(resumed) == key(whole[2:])


@pytest.mark.slow
def test_resume_mid_run_continues_bitwise(tmp_path):
    resume_check(tmp_path, "orpo", "log_odds_ratio")
