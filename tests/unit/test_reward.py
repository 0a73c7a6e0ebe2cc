"""Reward models (``training.objective reward``, loom.methods.reward): the Bradley-Terry loss and its statistics equal
a direct computation and TRL's RewardTrainer on the same model and pairs; a reward is the score at each row's last
non-pad token; the embedded default's held-out pairs hold no docstring that training holds with the other label;
LoRA trains the head with the base frozen; `loom convert --to-hf` writes a LlamaForSequenceClassification that
transformers scores as loom does, and ``model.init_from`` of it starts from its head; a resumed run continues bitwise;
the config rules; on its embedded pairs (a function's docstring preferred to its code echoed back) held-out accuracy
rises from chance to nearly 1, and a learnable synthetic preference generalizes to held-out pairs (slow). On DPO's
embedded pairs (another function's docstring rejected) a debug model from its seed stays at chance within CPU
minutes: telling a function's own docstring from another's means matching the docstring against the code;
docs/finetuning.md (Reward model, Data) has the measurements."""

from __future__ import annotations

import json
import random
import types
from collections import defaultdict

import pytest
import torch

from loom.checkpoint.hf.head import has_score_head
from loom.checkpoint.hf.reader import load_hf_weights
from loom.cli.main import main as loom_main
from loom.config.errors import ConfigError
from loom.config.sections import Config, DataConfig
from loom.data import prepare_data
from loom.data.dpo import pair_batch
from loom.data.loader import MicroBatch
from loom.data.tokenizers import ByteTokenizer
from loom.infer.reward import attach_score_head, load_reward_model, score
from loom.methods import check_config, method
from loom.methods.reward import RewardModeling, bradley_terry
from loom.train.trainer import Trainer
from tests.tiny import tiny_config

WORDS = "the cat sat on a warm mat while two dogs ran past quickly and one bird sang".split()


def write_pairs(path, n: int = 60, seed: int = 0) -> str:
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."
    with open(path, "w") as fh:
        for _ in range(n):
            fh.write(
                json.dumps(
                    {
                        "prompt": say(rng.randint(2, 6)),
                        "chosen": say(rng.randint(2, 8)),
                        "rejected": say(rng.randint(2, 8)),
                    }
                )
                + "\n"
            )
    return str(path)


def reward_run(run_dir, cache, source, **extra):
    return tiny_config(
        run_dir,
        cache,
        **{
            "training.objective": "reward",
            "data.source": source,
            "training.seq_len": 96,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 4,
            "optimizer.lr": 3e-3,
            "metrics.progress": "false",
            "run.seed": 3,
            **extra,
        },
    )


def right_padded(b: int, s: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, MicroBatch]:
    """2B rows of random lengths, right-padded with 0 (a token id no row holds): ids, attention mask, micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2 * b, s), generator=gen)
    lengths = torch.randint(3, s + 1, (2 * b,), generator=gen)
    attention = (torch.arange(s) < lengths[:, None]).long()
    ids = ids * attention
    mb = MicroBatch(ids, torch.full_like(ids, -100), torch.arange(s).expand(2 * b, s), 1 - attention)
    return ids, attention, mb


# ---- the loss --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("center", [0.0, 0.05])
def test_loss_and_statistics_equal_a_direct_computation(center):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(2 * 7, generator=gen, dtype=torch.float64) * 2
    objective = RewardModeling(center)
    loss = objective.pair_loss(rewards)
    c, r = rewards[:7].tolist(), rewards[7:].tolist()
    import math

    direct = sum(math.log1p(math.exp(-(a - b))) + center * (a + b) ** 2 for a, b in zip(c, r))
    assert float(loss) == pytest.approx(direct, rel=1e-12)
    stats = {k: float(v) / 7 for k, v in objective.step_stats().items()}
    assert stats["rewards/accuracy"] == pytest.approx(sum(a > b for a, b in zip(c, r)) / 7)
    assert stats["rewards/margins"] == pytest.approx(sum(a - b for a, b in zip(c, r)) / 7)
    assert stats["rewards/chosen"] == pytest.approx(sum(c) / 7) and stats[
        "rewards/rejected"
    ] == pytest.approx(sum(r) / 7)
    assert objective.step_stats() == {}  # reset by the read
    # large margins stay finite (logsigmoid, not log(sigmoid))
    assert torch.isfinite(bradley_terry(torch.tensor([-200.0]), torch.tensor([200.0]))).all()


def test_loss_equals_trl_reward_trainer(tmp_path):
    """The same LlamaForSequenceClassification (random, saved, loaded into loom), the same right-padded pairs: loom's
    summed loss / pairs is TRL's mean loss (with its center_rewards_coefficient), accuracy and margin likewise."""
    pytest.importorskip("trl")
    transformers = pytest.importorskip("transformers")
    from trl import RewardTrainer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=96,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=0,
        rms_norm_eps=1e-5,
    )
    hf = transformers.LlamaForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path / "hf")
    model = load_reward_model(str(tmp_path / "hf")).model
    assert has_score_head(model)
    b, center = 5, 0.01
    ids, attention, mb = right_padded(b, 20, 96)
    objective = RewardModeling(center)
    with torch.no_grad():
        loss = objective.forward(model, mb, None) / b
    stats = {k: float(v) / b for k, v in objective.step_stats().items()}
    fake = types.SimpleNamespace(
        model=hf,
        args=types.SimpleNamespace(center_rewards_coefficient=center),
        accelerator=types.SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    with torch.no_grad():
        trl_loss = RewardTrainer.compute_loss(fake, hf, {"input_ids": ids, "attention_mask": attention})
    torch.testing.assert_close(loss, trl_loss.float(), rtol=1e-5, atol=1e-6)
    got = fake._metrics["eval"]
    assert stats["rewards/accuracy"] == pytest.approx(got["accuracy"][0])
    assert stats["rewards/margins"] == pytest.approx(got["margin"][0], rel=1e-5, abs=1e-6)


def test_the_reward_is_the_score_at_the_last_token():
    """Padding after a row (any token id) changes nothing; the score is the head's at the row's last token."""
    from loom.models.llama import FLAVORS, Llama

    torch.manual_seed(0)
    model = attach_score_head(Llama(FLAVORS["debug"].with_(vocab_size=96))).eval()
    ids, _, mb = right_padded(3, 16, 96, seed=2)
    objective = RewardModeling()
    with torch.no_grad():
        rewards = objective.rewards(model, mb, None)
        noisy = MicroBatch(
            torch.where(mb.document_ids > 0, torch.randint_like(ids, 1, 96), ids),
            mb.labels,
            mb.positions,
            mb.document_ids,
        )
        assert torch.equal(objective.rewards(model, noisy, None), rewards)
        for row in range(6):
            n = int((mb.document_ids[row] == 0).sum())
            assert float(rewards[row]) == pytest.approx(
                float(model(ids[row : row + 1, :n])[0, -1, 0]), abs=1e-6
            )
    assert score(model, [ids[0, : int((mb.document_ids[0] == 0).sum())].tolist()])[0] == pytest.approx(
        float(rewards[0]), abs=1e-6
    )


def test_pair_batches_mark_padding_as_a_second_document(tmp_path):
    from loom.data.dpo import PairFile
    from loom.data.token_file import TokenFile

    ((path, _, _),) = prepare_data(
        DataConfig(source=write_pairs(tmp_path / "p.jsonl", 6)), ByteTokenizer(), str(tmp_path / "c"), "dpo"
    )
    source = PairFile(TokenFile(path), 64, 0.0, "p")
    mb = pair_batch(source, [0, 1, 2], 0, None)
    for row in range(6):
        tokens, _ = source.sequence(2 * int(source.kept[row % 3]) + row // 3)
        assert int((mb.document_ids[row] == 0).sum()) == len(tokens)
        assert bool((mb.document_ids[row, : len(tokens)] == 0).all())


def test_embedded_pairs_keep_each_docstring_on_one_side_of_the_split():
    """Every docstring of the embedded default is chosen in one pair and rejected in the pair next to it, so the
    held-out pairs (the last ones) never hold a docstring the training pairs hold with the other label (the swap
    partner half the list away put ~40% of the held-out pairs there at seq_len 192: memorizing scored below
    chance)."""
    from loom.data.dpo import docstring_preferences
    from loom.data.sources import stdlib_files

    pairs = list(docstring_preferences(stdlib_files()[:80]))
    text = lambda messages: messages[0]["content"]
    chosen_at: dict[str, list[int]] = defaultdict(list)
    for k, pair in enumerate(pairs):
        chosen_at[text(pair.chosen)].append(k)
    assert len(pairs) > 100
    unique = [k for k, pair in enumerate(pairs) if len(chosen_at[text(pair.rejected)]) == 1]
    assert len(unique) > 0.9 * len(pairs)
    for k in unique:  # its rejected docstring is the chosen one of the neighbouring pair: the two swap
        j = chosen_at[text(pairs[k].rejected)][0]
        assert abs(j - k) == 1 and text(pairs[j].rejected) == text(pairs[k].chosen), (k, j)
        assert pairs[j].where.split(" line ")[0] != pairs[k].where.split(" line ")[0]  # another file's


def test_embedded_reward_pairs_reject_the_code_echoed_back():
    """The reward objective's embedded pairs (data.embedded_rejected auto = code): one pair per function, chosen
    its docstring, rejected the fenced code of its own prompt; DPO's (auto = docstring) keep another's docstring."""
    from loom.data.dpo import docstring_preferences
    from loom.data.sources import stdlib_files
    from loom.methods import method_of
    from loom.train.engine import embedded_rejected

    pairs = list(docstring_preferences(stdlib_files()[:40], "code"))
    assert len(pairs) > 50 and len({p.where for p in pairs}) == len(pairs)
    for pair in pairs:
        ask, answer = pair.prompt[0]["content"], pair.rejected[0]["content"]
        assert answer.startswith("```python\n") and answer.endswith("\n```") and ask.endswith(answer)
        assert pair.chosen[0]["content"] not in ask
    rejected = lambda cfg: embedded_rejected(cfg, method_of(cfg).objective(cfg))
    assert rejected(tiny_config(**{"training.objective": "reward"})) == "code"
    assert rejected(tiny_config(**{"training.objective": "dpo"})) == "docstring"
    assert (
        rejected(tiny_config(**{"training.objective": "reward", "data.embedded_rejected": "docstring"}))
        == "docstring"
    )


def test_on_the_embedded_pairs_held_out_accuracy_rises_above_chance(tmp_path):
    """`loom train --training.objective reward` on its embedded pairs (seeded): from rewards near 0 (loss log 2) to
    nearly every held-out pair ranked right within 20 steps. Held-out functions are not trained on."""
    cfg = tiny_config(
        tmp_path / "run",
        tmp_path / "cache",
        **{
            "training.objective": "reward",
            "training.steps": 20,
            "training.seq_len": 256,
            "training.global_batch_size": 16,
            "training.micro_batch_size": 8,
            "optimizer.lr": 3e-3,
            "optimizer.warmup_steps": 2,
            "metrics.progress": "false",
            "run.seed": 3,
            "data.val_fraction": 0.05,
            "training.eval_every": 20,
            "training.eval_batches": 5,
        },
    )
    records = Trainer(cfg).fit()
    assert abs(records[0]["loss"] - 0.6931) < 0.02
    (last,) = [r for r in records if r["val_loss"] is not None]
    assert last["val_rewards/accuracy"] >= 0.9 and last["val_loss"] < 0.4, last  # 146 held-out pairs


# ---- training --------------------------------------------------------------------------------------------------


def test_lora_trains_the_head_with_the_base_frozen(tmp_path):
    source = write_pairs(tmp_path / "pairs.jsonl")
    trainer = Trainer(
        reward_run(tmp_path / "run", tmp_path / "cache", source, **{"lora.rank": 4, "training.steps": 3})
    )
    part = trainer.parts[0]
    assert tuple(part.output.weight.shape) == (1, 64) and part.output.weight.requires_grad
    trainable = {n for n, p in part.named_parameters() if p.requires_grad}
    assert "output.weight" in trainable and all("lora_" in n for n in trainable - {"output.weight"})
    before = {n: p.detach().clone() for n, p in part.named_parameters()}
    records = trainer.fit()
    after = dict(part.named_parameters())
    for name, p in after.items():
        assert torch.equal(p, before[name]) != (name in trainable), name
    assert {"rewards/accuracy", "rewards/margins", "rewards/chosen", "rewards/rejected"} <= set(records[-1])
    assert records[-1]["targets"] == 8  # pairs


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A reward run (full fine-tuning) saved at its end, exported with `loom convert --to-hf`."""
    tmp = tmp_path_factory.mktemp("reward_export")
    source = write_pairs(tmp / "pairs.jsonl")
    Trainer(
        reward_run(tmp / "run", tmp / "cache", source, **{"training.steps": 2, "checkpoint.at_end": "true"})
    ).fit()
    ckpt = str(tmp / "run" / "checkpoints" / "step_00000002")
    assert loom_main(["convert", "--from", ckpt, "--to-hf", str(tmp / "hf")]) == 0
    return {"tmp": tmp, "ckpt": ckpt, "hf": str(tmp / "hf"), "source": source}


def test_export_is_a_sequence_classifier_that_transformers_scores_alike(exported):
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    with open(f"{exported['hf']}/config.json") as fh:
        config = json.load(fh)
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    with safe_open(f"{exported['hf']}/model.safetensors", framework="pt") as fh:
        names = set(fh.keys())
        assert tuple(fh.get_tensor("score.weight").shape) == (1, 64)
    assert "lm_head.weight" not in names
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(exported["hf"]).float().eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification"
    gen = torch.Generator().manual_seed(0)
    items = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 17, 40, 9)]
    ours = score(exported["ckpt"], items)
    theirs = score(exported["hf"], items)
    with torch.no_grad():
        ref = [float(hf(torch.tensor([ids])).logits[0, 0]) for ids in items]
    for a, b, c in zip(ours, theirs, ref):
        assert abs(a - c) < 1e-4 and abs(b - c) < 1e-4, (ours, theirs, ref)
    assert max(ref) - min(ref) > 1e-3  # the items get different rewards: the comparison can fail


def test_init_from_the_export_starts_from_its_head(exported, tmp_path):
    from safetensors import safe_open

    trainer = Trainer(
        reward_run(
            tmp_path / "run",
            exported["tmp"] / "cache",
            exported["source"],
            **{"model.init_from": exported["hf"], "model.flavor": "debug", "training.steps": 1},
        )
    )
    with safe_open(f"{exported['hf']}/model.safetensors", framework="pt") as fh:
        assert torch.equal(trainer.parts[0].output.weight.detach(), fh.get_tensor("score.weight"))
        assert torch.equal(
            trainer.parts[0].tok_embeddings.weight.detach(), fh.get_tensor("model.embed_tokens.weight")
        )


def test_a_base_model_folder_keeps_the_seeded_head(exported, tmp_path):
    """A causal LM folder (no score head) starts the body from it; the head keeps its seeded init."""
    from loom.checkpoint.hf.reader import llama_args_from_hf
    from loom.models.llama import Llama

    lm = tmp_path / "lm"
    lm.mkdir()
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{exported['hf']}/model.safetensors")
    head = tensors.pop("score.weight")
    save_file({**tensors, "lm_head.weight": torch.zeros(256 + 128, 64)}, str(lm / "model.safetensors"))
    with open(f"{exported['hf']}/config.json") as fh:
        config = json.load(fh)
    config.update(architectures=["LlamaForCausalLM"])
    config.pop("num_labels")
    (lm / "config.json").write_text(json.dumps(config))
    model = Llama(llama_args_from_hf(str(lm)))
    attach_score_head(model)
    seeded = torch.full_like(model.output.weight, 7.0)
    with torch.no_grad():
        model.output.weight.copy_(seeded)
    load_hf_weights(model, str(lm))
    assert torch.equal(model.output.weight.detach(), seeded) and not torch.equal(seeded, head)
    assert torch.equal(model.tok_embeddings.weight.detach(), tensors["model.embed_tokens.weight"])


# ---- config and misuse -----------------------------------------------------------------------------------------


def test_config_rules(tiny):
    with pytest.raises(ConfigError, match="reward.center_coefficient.*training.objective reward only"):
        check_config(tiny(**{"reward.center_coefficient": 0.01}))
    for key in ("parallel.pp", "parallel.cp", "parallel.tp"):
        with pytest.raises(ConfigError, match=f"{key} = 2: not supported with training.objective reward"):
            check_config(tiny(**{"training.objective": "reward", key: 2}))
    with pytest.raises(ConfigError, match="training.eval_tasks.*not with training.objective reward"):
        check_config(tiny(**{"training.objective": "reward", "training.eval_tasks": "hellaswag"}))
    for extra in ({"data.source": "pairs.jsonl"}, {"training.objective": "sft"}):
        with pytest.raises(
            ConfigError, match="data.embedded_rejected = 'code': applies to the embedded preference"
        ):
            check_config(tiny(**{"training.objective": "reward", "data.embedded_rejected": "code", **extra}))
    check_config(tiny(**{"training.objective": "dpo", "data.embedded_rejected": "code"}))
    check_config(tiny(**{"training.objective": "reward", "reward.center_coefficient": 0.01, "lora.rank": 4}))
    assert isinstance(method("reward").objective(Config()), RewardModeling)


def test_cli_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        loom_main(["train", "--training.objective", "reward", "--parallel.tp", "2", "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parallel.tp" in err[0] and "reward" in err[0], err


def test_scoring_misuse_is_one_line(exported, tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer: pass token ids") as err:
        score(load_reward_model(exported["hf"]).model, ["some text"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="allowed: a string, a list of messages or a list of token ids"):
        score(exported["ckpt"], [3.5])
    cfg = json.loads(open(f"{exported['hf']}/config.json").read())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "causal").mkdir()
    (tmp_path / "causal" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not a reward model"):
        score(str(tmp_path / "causal"), [[1, 2, 3]])


def test_a_lora_reward_run_is_not_exported_as_a_peft_adapter(tmp_path, capsys):
    source = write_pairs(tmp_path / "pairs.jsonl", 20)
    Trainer(
        reward_run(
            tmp_path / "run",
            tmp_path / "cache",
            source,
            **{"lora.rank": 4, "training.steps": 1, "checkpoint.at_end": "true"},
        )
    ).fit()
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_00000001")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        loom_main(["convert", "--from", ckpt, "--to-peft", str(tmp_path / "adapter")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "reward model" in err[0] and "--to-hf" in err[0], err
    assert loom_main(["convert", "--from", ckpt, "--to-hf", str(tmp_path / "merged")]) == 0
    assert score(str(tmp_path / "merged"), [[5, 6, 7]]) == pytest.approx(score(ckpt, [[5, 6, 7]]), abs=1e-5)


def test_scoring_strings_and_conversations_goes_through_the_run_tokenizer(exported):
    """A string is tokenized as it is; a conversation rendered as training renders a pair's sequence."""
    from loom.data.chat import ChatEncoder, load_template

    scorer = load_reward_model(exported["ckpt"])
    text = "Hello there."
    conv = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]
    tok = ByteTokenizer()
    ids = ChatEncoder(load_template("", tok), tok).encode(conv)[0]
    got = scorer([text, conv])
    assert got == pytest.approx(scorer([list(tok.encode(text)), ids]), abs=1e-6)


def test_a_resumed_run_continues_bitwise(tmp_path):
    """The head is saved and restored with the body and the optimizer: a run resumed from its step-2 checkpoint
    repeats steps 3 and 4 bitwise."""
    import shutil

    source = write_pairs(tmp_path / "pairs.jsonl", 40)
    run = reward_run(
        tmp_path / "run", tmp_path / "cache", source, **{"training.steps": 4, "checkpoint.every": 2}
    )
    whole = Trainer(run).fit()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_00000004")
    resumed = Trainer(run).fit()
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]]
    assert [r["rewards/margins"] for r in resumed] == [r["rewards/margins"] for r in whole[2:]]


@pytest.mark.slow
def test_a_learnable_preference_generalizes_to_held_out_pairs(tmp_path):
    """Synthetic pairs whose chosen completion names a cat and whose rejected one a dog, otherwise random words:
    held-out accuracy far above chance within 40 steps (seeded; 40 held-out pairs), starting from chance."""
    rng = random.Random(0)
    say = lambda animal: (
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        + f" {animal} "
        + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 4)))
    )
    rows = [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(3)),
            "chosen": say("cat"),
            "rejected": say("dog"),
        }
        for _ in range(200)
    ]
    with open(tmp_path / "pairs.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    cfg = reward_run(
        tmp_path / "run",
        tmp_path / "cache",
        str(tmp_path / "pairs.jsonl"),
        **{
            "training.steps": 40,
            "training.seq_len": 96,
            "data.val_fraction": 0.2,
            "training.eval_every": 20,
            "training.eval_batches": 5,
            "optimizer.warmup_steps": 2,
            "metrics.every": 1,
        },
    )
    records = Trainer(cfg).fit()
    vals = [r["val_rewards/accuracy"] for r in records if r["val_loss"] is not None]
    assert len(vals) == 2 and vals[-1] >= 0.9, vals
    # rewards start near 0: learned
    assert records[0]["step"] == 1 and abs(records[0]["loss"] - 0.6931) < 0.02
