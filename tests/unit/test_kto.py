"""KTO (``training.objective kto``): the loss, KL estimate, rewards and logged statistics equal TRL's KTOTrainer's
for the same model, batch and reference log-probabilities (fp32); TRL's data formats (strings, conversational) give
the same sequences, each example with a mismatched completion of another prompt for the KL term; the embedded
default is the embedded pairs (chosen desirable, rejected not); it trains from ``loom train`` and resumes
bitwise."""

from __future__ import annotations

import contextlib
import functools
import shutil
import types
from collections import defaultdict

import pytest
import torch

from loom.checkpoint.manager import step_dir_name
from loom.config.errors import ConfigError
from loom.config.sections import DataConfig
from loom.data import prepare_data
from loom.data.chat import FLAG_START
from loom.data.dpo import FLAG_DESIRABLE
from loom.data.kto import examples, mismatched
from loom.data.loader import MicroBatch
from loom.data.sources import parse_source
from loom.data.token_file import TokenFile
from loom.data.tokenizers import ByteTokenizer
from loom.methods import check_config
from loom.methods.kto import KahnemanTversky
from loom.train.trainer import Trainer
from tests.tiny import tiny_config
from tests.unit.test_dpo import write_jsonl
from tests.unit.test_orpo import cli_run, models, pair_batch


def kto_rows(n: int = 24) -> list[dict]:
    """n examples over n / 2 prompts, one desirable and one undesirable completion each."""
    out = []
    for i in range(n // 2):
        out.append({"prompt": f"Say {i} twice.", "completion": f"{i} {i}.", "label": True})
        out.append({"prompt": f"Say {i} twice.", "completion": f"{i + 1}.", "label": False})
    return out


def test_loss_and_statistics_equal_trl(tmp_path):
    trl = pytest.importorskip("trl", minversion="1.16")
    from trl import KTOTrainer
    from trl.trainer.utils import add_fused_lm_head

    assert trl.__version__ == "1.16.0"  # the version compared; another may move KTO's math
    print("trl", trl.__version__)
    hf, model = models(tmp_path)
    ids, attention, mask, mb = pair_batch(b=4, seed=3)  # rows 0..3 completions, 4..7 the KL rows
    b, beta, weights = 4, 0.3, (1.0, 1.5)
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(2 * b, generator=g) * 3 - 60
    desirable = torch.tensor([True, False, True, False])
    mb = MicroBatch(mb.inputs, mb.labels, mb.positions, mb.document_ids, ref, desirable)
    objective = KahnemanTversky(beta, *weights)
    # the engine's part in begin (the KL pass): the module, one process, float32, no per-document positions
    objective._engine = types.SimpleNamespace(
        module=model,
        device=torch.device("cpu"),
        loss_parallel=False,
        positions=lambda mb: None,
        autocast=contextlib.nullcontext,
    )
    with torch.no_grad():
        objective.begin([mb], lambda t: t)
        loss = objective.forward(model, mb, None) / b
    stats = {k: float(v) / b for k, v in objective.step_stats().items()}

    add_fused_lm_head(hf, outputs=("log_probs", "entropy", "mean_logits"))
    hf.train()
    fake = types.SimpleNamespace(
        model=hf,
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        calculate_KL=True,
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=beta,
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
        _tp_size=1,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
    )
    fake._compute_kl_logps = functools.partial(KTOTrainer._compute_kl_logps, fake)
    inputs = {
        "input_ids": ids[:b],
        "attention_mask": attention[:b],
        "completion_mask": mask[:b],
        "KL_input_ids": ids[b:],
        "KL_attention_mask": attention[b:],
        "KL_completion_mask": mask[b:],
        "label": desirable,
        "ref_logps": ref[:b],
        "ref_KL_logps": ref[b:],
    }
    with torch.no_grad():
        trl_loss = KTOTrainer._compute_loss(fake, hf, inputs, False)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    got = fake._metrics["train"]
    assert got["kl"][0] > 0  # the estimate is not clamped away: the comparison covers it
    for name in (
        "kl",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        want = got[name][0]
        assert abs(stats[name] - want) <= 1e-5 * max(1.0, abs(want)), (name, stats[name], want)


def test_formats_labels_and_mismatched_completions(tmp_path):
    """Strings and TRL's conversational rows give the same token file; each example's label is on its first
    token; its KL sequence is its prompt with the completion of the nearest earlier example of another prompt."""
    data = kto_rows(8)
    conv = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "completion": [{"role": "assistant", "content": r["completion"]}],
            "label": r["label"],
        }
        for r in data
    ]
    files = [
        prepare_data(
            DataConfig(source=write_jsonl(tmp_path / f"{n}.jsonl", rows)),
            ByteTokenizer(),
            str(tmp_path / n),
            "kto",
        )
        for n, rows in (("s", data), ("c", conv))
    ]
    a, c = (TokenFile(f[0][0]) for f in files)
    assert torch.equal(a.tokens[:], c.tokens[:]) and torch.equal(a.mask[:], c.mask[:])
    starts = torch.nonzero(a.mask & FLAG_START).flatten()
    assert len(starts) == 16
    labels = [bool(a.mask[int(s)] & FLAG_DESIRABLE) for s in starts[::2]]
    assert labels == [r["label"] for r in data]
    assert not any(a.mask[int(s)] & FLAG_DESIRABLE for s in starts[1::2])  # KL rows carry no label
    spec = parse_source(str(tmp_path / "s.jsonl"), "text", "strict")[0]
    pairs = mismatched(list(examples(spec)))
    assert pairs[:4] == [7, 7, 1, 1]  # the nearest earlier example of another prompt, the file as a ring
    text = ByteTokenizer().decode
    end = lambda i: int(starts[i + 1]) - 1 if i + 1 < len(starts) else len(a.tokens) - 1
    kl_of_2 = text(a.tokens[int(starts[5]) : end(5)].tolist())
    assert data[2]["prompt"] in kl_of_2 and data[1]["completion"] in kl_of_2


def test_bad_rows_are_named(tmp_path):
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "a", "completion": "b", "label": "yes"}])
    with pytest.raises(ConfigError, match="'label' must be true or false"):
        prepare_data(DataConfig(source=bad), ByteTokenizer(), str(tmp_path / "c"), "kto")


def test_embedded_default_is_the_pairs_unpaired():
    """Each embedded pair gives a desirable (its chosen) and an undesirable (its rejected) example."""
    from loom.data.dpo import pairs

    spec = parse_source("", "text", "strict")[0]
    spec.paths = spec.paths[:4]  # a few files of the standard library: the derivation is what is tested
    items = list(examples(spec))
    first = next(pairs(spec))
    assert items[0].desirable and not items[1].desirable
    assert items[0].completion == first.chosen and items[1].completion == first.rejected
    assert items[0].prompt == items[1].prompt


def test_config_rules(tiny):
    with pytest.raises(ConfigError, match="kto.beta"):
        check_config(tiny(**{"kto.beta": 0.5}))  # the section of another objective
    with pytest.raises(ConfigError, match="kto.reference"):
        check_config(tiny(**{"training.objective": "kto", "kto.reference": "adapters_off"}))
    with pytest.raises(ConfigError, match="parallel.pp"):
        check_config(tiny(**{"training.objective": "kto", "parallel.pp": 2}))
    check_config(tiny(**{"training.objective": "kto", "kto.undesirable_weight": 1.3}))


def test_trains_from_the_cli(tmp_path):
    records = cli_run(tmp_path, "kto", write_jsonl(tmp_path / "k.jsonl", kto_rows()), "kl")
    assert all(r["kl"] >= 0 for r in records)


@pytest.mark.slow
def test_embedded_default_trains_from_the_cli(tmp_path):
    cli_run(tmp_path, "kto", None, "kl")


@pytest.mark.slow
def test_resume_mid_run_continues_bitwise(tmp_path):
    """4 steps saved at 2; a copy of the run resumed from step 2 writes steps 3..4 exactly as the uninterrupted
    run did (the cached reference read back from the run dir, the KL estimate recomputed)."""
    source = write_jsonl(tmp_path / "k.jsonl", kto_rows())
    run = lambda name, **extra: tiny_config(
        tmp_path / name,
        tmp_path / "cache",
        **{
            "training.objective": "kto",
            "data.source": source,
            "training.seq_len": 64,
            "training.steps": 4,
            "checkpoint.every": 2,
            "checkpoint.keep": 0,
            "run.deterministic": "true",
            **extra,
        },
    )
    whole = Trainer(run("whole")).fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "part", ignore=shutil.ignore_patterns(".lock"))
    step2 = str(tmp_path / "part" / "checkpoints" / step_dir_name(2))
    resumed = Trainer(run("part", **{"checkpoint.resume": step2, "checkpoint.overwrite": "true"})).fit()
    key = lambda recs: [(r["step"], r["loss"], r["grad_norm"], r["kl"], r["batch_hash"]) for r in recs]
    assert [r["step"] for r in resumed] == [3, 4] and key(resumed) == key(whole[2:])
