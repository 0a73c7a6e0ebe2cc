"""DPO (``training.objective dpo``): the loss and rewards equal TRL's DPOTrainer's for the same model, batch and
reference log-probabilities (sigmoid and IPO, fp32), only completion tokens count, every data format gives the same
sequences, the embedded default learns to prefer a function's own docstring on held-out pairs, a resumed run
continues bitwise, and the config rules."""

from __future__ import annotations

import json
import shutil
import types
from collections import defaultdict

import pytest
import torch

from loom.checkpoint.manager import step_dir_name
from loom.cli.main import main as loom_main
from loom.config.errors import ConfigError
from loom.config.sections import Config, DataConfig
from loom.data import build_loader, prepare_data
from loom.data.dpo import pair_batch
from loom.data.loader import MicroBatch
from loom.data.token_file import TokenFile
from loom.data.tokenizers import ByteTokenizer
from loom.methods import check_config, method
from loom.methods.dpo import DirectPreference
from loom.numerics import IGNORE
from loom.train.trainer import Trainer
from tests.tiny import tiny_config

WORDS = "the cat sat on a warm mat while two dogs ran past quickly and one bird sang".split()


def rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."
    return [
        {
            "prompt": say(rng.randint(2, 8)),
            "chosen": say(rng.randint(2, 10)),
            "rejected": say(rng.randint(2, 10)),
        }
        for _ in range(n)
    ]


def write_jsonl(path, data) -> str:
    with open(path, "w") as fh:
        for row in data:
            fh.write(json.dumps(row) + "\n")
    return str(path)


def prepared(source: str, cache) -> TokenFile:
    ((path, _, _),) = prepare_data(DataConfig(source=source), ByteTokenizer(), str(cache), "dpo")
    return TokenFile(path)


# ---- data ----------------------------------------------------------------------------------------------------


def test_every_format_gives_the_same_sequences(tmp_path):
    data = rows(12)
    strings = prepared(write_jsonl(tmp_path / "s.jsonl", data), tmp_path / "c")
    conversational = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in data
    ]
    conv = prepared(write_jsonl(tmp_path / "c.jsonl", conversational), tmp_path / "c")
    same = lambda a, b: torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask)
    assert same(strings, conv) and strings.meta.documents == 24 and strings.meta.mask == "dpo"
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.Table.from_pylist(conversational), str(tmp_path / "c.parquet"))
    assert same(prepared(str(tmp_path / "c.parquet"), tmp_path / "c"), conv)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(data).save_to_disk(str(tmp_path / "ds"))
    assert same(prepared(str(tmp_path / "ds"), tmp_path / "c"), strings)
    # the rendered text: the built-in template, the completion (and its EOS) flagged
    loader = build_loader(
        DataConfig(val_fraction=0.0),
        ByteTokenizer(),
        [(strings.path, 1.0, "s")],
        seq_len=128,
        seed=0,
        dp_rank=0,
        dp_size=1,
        micro_batch=1,
        accumulation=1,
        kind="dpo",
    )
    mb = pair_batch(loader.source, [0], 0, None)
    text = bytes(t for t in mb.inputs[0].tolist() if t < 256).decode()
    assert text.startswith(f"<|user|>\n{data[0]['prompt']}\n<|assistant|>\n{data[0]['chosen']}")
    trained = [t for t in mb.labels[0].tolist() if t != IGNORE]
    assert bytes(trained[:-1]).decode() == data[0]["chosen"] and trained[-1] == ByteTokenizer().eos_id


def test_implicit_prompt_pairs_are_the_explicit_ones(tmp_path):
    """TRL's implicit-prompt format (no 'prompt'; chosen and rejected whole conversations sharing their beginning)
    gives the same sequences as the explicit format, the prompt being the common prefix (TRL's extract_prompt)."""
    from loom.data.dpo import implicit_prompt

    data = rows(12)
    explicit = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"] + "!"}],
        }
        for r in data
    ]
    implicit = [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in explicit
    ]
    a = prepared(write_jsonl(tmp_path / "e.jsonl", explicit), tmp_path / "c")
    b = prepared(write_jsonl(tmp_path / "i.jsonl", implicit), tmp_path / "c")
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask) and a.meta.documents == 24
    trl_utils = pytest.importorskip("trl.data_utils")
    for row in (
        implicit[0],
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"},
    ):
        assert implicit_prompt(row, "x") == trl_utils.extract_prompt(row)
    with pytest.raises(
        ConfigError, match=r"i2.jsonl line 1': no 'prompt': chosen and rejected must then share"
    ):
        prepared(write_jsonl(tmp_path / "i2.jsonl", [{"chosen": "abc", "rejected": "xyz"}]), tmp_path / "c")


def test_bad_rows_and_sources_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"b.jsonl line 1.*'prompt', 'chosen' and 'rejected'"):
        prepared(write_jsonl(tmp_path / "b.jsonl", [{"prompt": "x", "chosen": "y"}]), tmp_path / "c")
    with pytest.raises(ConfigError, match="all be strings or all lists"):
        prepared(
            write_jsonl(tmp_path / "m.jsonl", [{"prompt": "x", "chosen": "y", "rejected": []}]),
            tmp_path / "c",
        )
    text = tmp_path / "t.txt"
    text.write_text("plain")
    with pytest.raises(ConfigError, match="dpo reads preference pairs"):
        prepared(str(text), tmp_path / "c")


def test_truncation_keeps_the_start_and_drops_pairs_without_a_completion(tmp_path):
    data = [
        {"prompt": "p" * 30, "chosen": "c" * 60, "rejected": "r" * 5},
        {"prompt": "q" * 200, "chosen": "x", "rejected": "y"},
    ]
    tf = prepared(write_jsonl(tmp_path / "t.jsonl", data), tmp_path / "c")
    loader = build_loader(
        DataConfig(val_fraction=0.0),
        ByteTokenizer(),
        [(tf.path, 1.0, "t")],
        seq_len=80,
        seed=0,
        dp_rank=0,
        dp_size=1,
        micro_batch=1,
        accumulation=1,
        kind="dpo",
    )
    assert loader.source.kept.tolist() == [0]  # the second prompt fills the window
    mb = pair_batch(loader.source, [0], 258, None)
    assert mb.inputs.shape == (2, 80) and int(mb.inputs[1, -1]) == 258  # the short rejected is padded
    chosen = [t for t in mb.labels[0].tolist() if t != IGNORE]
    assert chosen and set(chosen) == {ord("c")} and mb.labels[0, -1] == IGNORE  # cut at seq_len, as TRL


# ---- the loss ------------------------------------------------------------------------------------------------


def batch(b: int = 3, s: int = 24, vocab: int = 384, seed: int = 0):
    """A padded pair batch: (input_ids, completion_mask) as TRL's collator builds them, and loom's micro-batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2 * b, s), generator=g)
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
    mb = MicroBatch(ids, labels, torch.arange(s).expand(2 * b, s), torch.zeros_like(ids))
    return ids, attention, mask, mb


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_loss_and_rewards_equal_trl(tmp_path, kind):
    pytest.importorskip("trl")
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from tests.unit.test_hf import loom_from_hf, random_hf_llama, save_hf

    hf = random_hf_llama(tied=False).float()
    with torch.no_grad():
        for p in hf.parameters():  # back to a modest scale: log-ratios of a few units
            p.mul_(0.3) if p.ndim > 1 else p.fill_(1.0)
    model = loom_from_hf(save_hf(hf, tmp_path / "hf"))
    ids, attention, mask, mb = batch()
    b, beta = ids.shape[0] // 2, 0.3
    ref = torch.randn(2 * b, generator=torch.Generator().manual_seed(1)) * 3 - 60
    objective = DirectPreference(beta, kind)
    with torch.no_grad():
        policy, counts = objective.logps(model, mb, None)
        loss = objective.pair_loss(policy, ref, counts) / b
    stats = {k: float(v) / b for k, v in objective.step_stats().items()}

    add_fused_lm_head(hf, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    hf.train()
    fake = types.SimpleNamespace(
        model=hf,
        accelerator=types.SimpleNamespace(
            device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x
        ),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[kind],
        loss_weights=[1.0],
        beta=beta,
        use_weighting=False,
        label_smoothing=0.0,
        _tp_size=1,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": mask,
        "ref_chosen_logps": ref[:b],
        "ref_rejected_logps": ref[b:],
    }
    with torch.no_grad():
        trl_loss = DPOTrainer._compute_loss(fake, hf, inputs, False)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
    got = fake._metrics["train"]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(stats[name] - got[name][0]) < 1e-5 * max(1.0, abs(got[name][0])), name
    assert stats["rewards/accuracy"] == pytest.approx(got["rewards/accuracies"][0])
    assert got["logps/chosen"][0] == pytest.approx(float(policy[:b].mean()), rel=1e-5)


def test_only_completion_tokens_count():
    """Log-probabilities are sums over completion targets alone: the prompt's tokens (inputs) change them only
    through the context, and a label at a prompt position is never read."""
    torch.manual_seed(0)
    logits = torch.randn(6, 24, 384)
    _, _, mask, mb = batch()
    objective = DirectPreference(0.1)
    got, counts = objective.logps(lambda inputs, positions: logits, mb, None)
    by_hand = torch.log_softmax(logits, -1)
    for row in range(6):
        targets = [(t, int(mb.inputs[row, t + 1])) for t in range(23) if mask[row, t + 1]]
        assert int(counts[row]) == len(targets)
        torch.testing.assert_close(got[row], sum(by_hand[row, t, v] for t, v in targets))
    prompt_labels = mb.labels.clone()
    prompt_labels[:, 0] = IGNORE  # position 0's target is always a prompt token
    assert torch.equal(mb.labels, prompt_labels)


def test_config_rules(tiny):
    with pytest.raises(ConfigError, match="dpo.beta.*training.objective dpo only"):
        check_config(tiny(**{"dpo.beta": 0.5}))
    with pytest.raises(ConfigError, match="dpo.reference = 'copy': not with LoRA"):
        check_config(tiny(**{"training.objective": "dpo", "dpo.reference": "copy", "lora.rank": 4}))
    check_config(tiny(**{"training.objective": "dpo", "dpo.reference": "copy"}))
    with pytest.raises(ConfigError, match="dpo.reference = 'adapters_off': needs LoRA"):
        check_config(tiny(**{"training.objective": "dpo", "dpo.reference": "adapters_off"}))
    with pytest.raises(ConfigError, match="parallel.pp = 2: not supported with training.objective dpo"):
        check_config(tiny(**{"training.objective": "dpo", "parallel.pp": 2}))
    with pytest.raises(ConfigError, match="data.loss_tokens.*sft only"):
        check_config(tiny(**{"training.objective": "dpo", "data.loss_tokens": "all"}))
    check_config(tiny(**{"training.objective": "dpo", "dpo.loss": "ipo", "dpo.beta": 0.5}))
    assert isinstance(method("dpo").objective(Config()), DirectPreference)


def test_cli_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        loom_main(
            [
                "train",
                "--training.objective",
                "dpo",
                "--dpo.reference",
                "copy",
                "--lora.rank",
                "4",
                "--dry-run",
            ]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dpo.reference" in err[0] and "copy" in err[0]


def test_pipeline_parallelism_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        loom_main(["train", "--training.objective", "dpo", "--parallel.pp", "2", "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.pp" in err[0] and "dpo" in err[0], err


# ---- runs ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory) -> str:
    """The embedded DPO default prepared once for the module."""
    cache = tmp_path_factory.mktemp("dpo_cache")
    prepare_data(DataConfig(), ByteTokenizer(), str(cache), "dpo")
    return str(cache)


def dpo_run(run_dir, cache, **extra):
    # 128 bytes per sequence keeps the reference pass short: ~170 pairs fit, a fifth held out
    return tiny_config(
        run_dir,
        cache,
        **{
            "training.objective": "dpo",
            "training.seq_len": 128,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 4,
            "data.val_fraction": 0.2,
            "optimizer.lr": 3e-3,
            "optimizer.warmup_steps": 2,
            "run.seed": 1,
            **extra,
        },
    )


@pytest.mark.slow
def test_embedded_default_learns_the_preference(tmp_path, stdlib_cache):
    """The debug model on the standard library's docstring preferences: held-out accuracy (chosen reward above
    rejected) above chance after 30 steps; the step records carry the rewards."""
    cfg = dpo_run(
        tmp_path / "run",
        stdlib_cache,
        **{"training.steps": 30, "training.eval_every": 15, "training.eval_batches": 2, "metrics.every": 5},
    )
    records = Trainer(cfg).fit()
    vals = [r["val_rewards/accuracy"] for r in records if r["val_loss"] is not None]
    assert len(vals) == 2 and vals[-1] > 0.5, vals
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy"} <= set(records[-1])
    assert records[-1]["val_loss"] < 0.693  # below the loss of a policy equal to its reference, log 2


@pytest.mark.slow
def test_the_step_loss_is_the_mean_over_pairs(tmp_path, stdlib_cache):
    """The trainer's step (2 micro-batches accumulated) equals the mean of the pairs' losses, computed by hand from
    the model before the step and the cached reference (the initial model: zero margins, loss log 2)."""
    trainer = Trainer(
        dpo_run(tmp_path / "run", stdlib_cache, **{"training.steps": 1, "optimizer.warmup_steps": 0})
    )
    data = trainer.loader.next_step()
    assert len(data.micro_batches) == 2
    objective = DirectPreference(0.1)
    with torch.no_grad():
        per = [
            objective.pair_loss(
                objective.logps(trainer.parts[0], mb, None)[0], mb.ref_logps, (mb.labels != IGNORE).sum(1)
            )
            for mb in data.micro_batches
        ]
    out = trainer.train_step(data.micro_batches)
    torch.testing.assert_close(out["loss"], sum(per) / 8, rtol=1e-6, atol=0)
    torch.testing.assert_close(out["loss"], torch.log(torch.tensor(2.0)), rtol=1e-5, atol=0)


def params_of(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_reference_copy_equals_the_cached_reference_and_stays_frozen(tmp_path):
    """dpo.reference copy (a frozen copy of the initial policy, run every step) gives the cached reference's losses
    and rewards at every step (the same log-probabilities, batched differently); the copy starts bitwise equal to
    the initial policy, takes no gradient and no optimizer state, and is bitwise unchanged after training while the
    policy moves."""
    source = write_jsonl(tmp_path / "p.jsonl", rows(80))
    run = lambda name, reference: Trainer(
        dpo_run(
            tmp_path / name,
            tmp_path / "cache",
            **{
                "data.source": source,
                "dpo.reference": reference,
                "training.steps": 5,
                "data.val_fraction": 0.0,
                "dpo.beta": 0.5,
            },
        )
    )
    cached = run("cached", "cached").fit()
    trainer = run("copy", "copy")
    reference = trainer.objective.reference_model
    assert reference is not None and reference is not trainer.parts[0]
    initial = params_of(trainer.parts[0])
    frozen = params_of(reference)
    assert frozen.keys() == initial.keys() and all(torch.equal(frozen[k], initial[k]) for k in frozen)
    assert not any(p.requires_grad for p in reference.parameters())
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert held and not held & {id(p) for p in reference.parameters()}
    copied = trainer.fit()
    for got, ref in zip(copied, cached, strict=True):
        for key in ("loss", "rewards/margins", "rewards/chosen"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (got["step"], key)
    assert all(p.grad is None for p in reference.parameters())
    assert all(torch.equal(p, frozen[name]) for name, p in reference.named_parameters())
    assert not all(torch.equal(p, initial[name]) for name, p in trainer.parts[0].named_parameters())
    assert len(copied) == 5 and abs(copied[-1]["loss"] - copied[0]["loss"]) > 1e-3
    assert not (
        tmp_path / "copy" / "dpo_reference"
    ).exists()  # nothing cached: the copy computes it every step


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["cached", "copy"])
def test_resume_mid_run_continues_bitwise(tmp_path, stdlib_cache, reference):
    """6 steps saved at 3; a copy of the run resumed from step 3 writes steps 4..6 exactly as the uninterrupted run
    did (the cached reference is read back from the run dir; the reference copy is rebuilt from the initial
    policy before the checkpoint is loaded)."""
    extra = {
        "training.steps": 6,
        "checkpoint.every": 3,
        "checkpoint.keep": 0,
        "run.deterministic": "true",
        "dpo.reference": reference,
    }
    whole = Trainer(dpo_run(tmp_path / "whole", stdlib_cache, **extra)).fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "part", ignore=shutil.ignore_patterns(".lock"))
    step3 = str(tmp_path / "part" / "checkpoints" / step_dir_name(3))
    resumed = Trainer(
        dpo_run(
            tmp_path / "part",
            stdlib_cache,
            **extra,
            **{"checkpoint.resume": step3, "checkpoint.overwrite": "true"},
        )
    ).fit()
    key = lambda recs: [
        (r["step"], r["loss"], r["grad_norm"], r["rewards/margins"], r["batch_hash"]) for r in recs
    ]
    assert [r["step"] for r in resumed] == [4, 5, 6] and key(resumed) == key(whole[3:])
