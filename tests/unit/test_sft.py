"""SFT (``training.objective sft``): every data format gives the same tokens and loss mask, packed conversations never
attend to each other, the step's loss is the assistant tokens' summed loss over their global count (checked by hand
and against the trainer's step with accumulation), the embedded default (standard-library docstrings) trains with a
falling validation loss, and a resumed run continues bitwise. Config rules and the cache keys keep language modeling
and SFT data apart."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from loom.checkpoint.manager import step_dir_name
from loom.cli.data import parse_args
from loom.cli.main import main as loom_main
from loom.config.errors import ConfigError, UserError
from loom.config.methods import METHODS as OBJECTIVES
from loom.config.sections import Config, DataConfig
from loom.data import chat_encoder, prepare_data
from loom.data.chat import FLAG_LOSS, FLAG_START
from loom.data.loader import make_micro_batch
from loom.data.prepare import cache_path, tokenize_to_file
from loom.data.sft import docstring_pairs
from loom.data.sources import parse_source, stdlib_files
from loom.data.token_file import TokenFile, mask_path
from loom.data.tokenizers import ByteTokenizer
from loom.methods import check_config, method
from loom.models.common.init import materialize
from loom.models.llama import FLAVORS, Llama
from loom.numerics import IGNORE, cross_entropy_sum
from loom.train.trainer import Trainer
from tests.tiny import tiny_config

WORDS = "the cat sat on a warm mat while two dogs ran past quickly and one bird sang".split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def conversations(n: int, seed: int = 0, turns: int = 2) -> list[list[dict]]:
    """``n`` conversations: a system message, then ``turns`` user / assistant exchanges of random lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conv = [{"role": "system", "content": sentence(rng, 3)}]
        for _ in range(turns):
            conv += [
                {"role": "user", "content": sentence(rng, rng.randint(2, 8))},
                {"role": "assistant", "content": sentence(rng, rng.randint(2, 10))},
            ]
        out.append(conv)
    return out


def write_jsonl(path, rows) -> str:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return str(path)


def prepared(source: str, cache, **data) -> TokenFile:
    cfg = DataConfig(source=source, val_fraction=0.0, **data)
    ((path, _, _),) = prepare_data(cfg, ByteTokenizer(), str(cache), "sft")
    return TokenFile(path)


def same_file(a: TokenFile, b: TokenFile) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask)


# ---- data formats ---------------------------------------------------------------------------------------------


def test_every_format_gives_the_same_tokens_and_mask(tmp_path):
    convs = conversations(20, turns=2)
    messages = prepared(write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in convs]), tmp_path / "c")
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.Table.from_pylist([{"messages": c} for c in convs]), str(tmp_path / "m.parquet"))
    assert same_file(prepared(str(tmp_path / "m.parquet"), tmp_path / "c"), messages)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"messages": c} for c in convs]).save_to_disk(str(tmp_path / "ds"))
    assert same_file(prepared(str(tmp_path / "ds"), tmp_path / "c"), messages)

    # one exchange: messages = a conversational prompt-completion pair = plain prompt / completion strings
    single = [c[:3] for c in convs]  # system, user, assistant
    as_messages = prepared(
        write_jsonl(tmp_path / "s.jsonl", [{"messages": c} for c in single]), tmp_path / "c"
    )
    pairs = [{"prompt": c[:2], "completion": c[2:]} for c in single]
    assert same_file(prepared(write_jsonl(tmp_path / "p.jsonl", pairs), tmp_path / "c"), as_messages)
    no_system = [c[1:3] for c in convs]
    strings = [{"prompt": c[0]["content"], "completion": c[1]["content"]} for c in no_system]
    assert same_file(
        prepared(write_jsonl(tmp_path / "ps.jsonl", strings), tmp_path / "c"),
        prepared(write_jsonl(tmp_path / "ms.jsonl", [{"messages": c} for c in no_system]), tmp_path / "c"),
    )


def test_a_prompt_completion_pair_trains_its_completion_only(tmp_path):
    convs = conversations(4, turns=2)
    full = prepared(write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in convs]), tmp_path / "c")
    pairs = [{"prompt": c[:4], "completion": c[4:]} for c in convs]  # the first exchange is prompt
    pc = prepared(write_jsonl(tmp_path / "p.jsonl", pairs), tmp_path / "c")
    assert torch.equal(pc.tokens, full.tokens)
    trained = lambda tf: bytes(
        t for t, f in zip(tf.slice(0, len(tf)).tolist(), tf.mask.tolist()) if f & FLAG_LOSS and t < 256
    ).decode()
    assert trained(full) == "".join(c[2]["content"] + c[4]["content"] for c in convs)
    assert trained(pc) == "".join(c[4]["content"] for c in convs)


def test_token_file_layout_and_flags(tmp_path):
    convs = conversations(3)
    tf = prepared(write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in convs]), tmp_path / "c")
    tok = ByteTokenizer()
    assert os.path.getsize(mask_path(tf.path)) == len(tf) and tf.meta.mask == "assistant"
    assert tf.meta.documents == 3 and tf.meta.trained_tokens == int((tf.mask & FLAG_LOSS).sum())
    starts = (tf.mask & FLAG_START).nonzero().flatten().tolist()
    assert len(starts) == 3 and starts[0] == 0
    ends = [s - 1 for s in starts[1:]] + [len(tf) - 1]
    for s, e in zip(starts, ends):
        assert int(tf.tokens[s]) == tok.bos_id and int(tf.tokens[e]) == tok.eos_id  # BOS ... EOS separator
        assert int(tf.mask[e]) == 0  # the separator takes no loss
        # EOS closes each assistant turn inside the conversation too, and is trained there
        inner = [i for i in range(s, e) if int(tf.tokens[i]) == tok.eos_id]
        assert len(inner) == 2 and all(int(tf.mask[i]) & FLAG_LOSS for i in inner)


def test_bad_rows_name_the_line(tmp_path):
    bad = write_jsonl(tmp_path / "b.jsonl", [{"messages": conversations(1)[0]}, {"text": "x"}])
    with pytest.raises(ConfigError, match=r"b.jsonl line 2.*'messages', or 'prompt' and 'completion'"):
        prepared(bad, tmp_path / "c")
    sharegpt = write_jsonl(tmp_path / "g.jsonl", [{"messages": [{"from": "human", "value": "hi"}]}])
    with pytest.raises(ConfigError, match="needs 'role' and 'content'"):
        prepared(sharegpt, tmp_path / "c")
    text = tmp_path / "t.txt"
    text.write_text("plain text")
    with pytest.raises(ConfigError, match="sft reads conversations"):
        prepared(str(text), tmp_path / "c")


def test_lm_and_sft_never_share_a_cache_or_a_token_file(tmp_path):
    source = write_jsonl(tmp_path / "m.jsonl", [{"messages": c, "text": "plain"} for c in conversations(5)])
    spec = parse_source(source)[0]
    tok = ByteTokenizer()
    sft = chat_encoder(DataConfig(), tok, "sft")
    other = chat_encoder(DataConfig(loss_tokens="all"), tok, "sft")
    paths = {cache_path(spec, tok, "c"), cache_path(spec, tok, "c", sft), cache_path(spec, tok, "c", other)}
    assert len(paths) == 3
    lm_bin, sft_bin = str(tmp_path / "lm.bin"), str(tmp_path / "sft.bin")
    tokenize_to_file(spec, tok, lm_bin)
    tokenize_to_file(spec, tok, sft_bin, sft=sft)
    with pytest.raises(ConfigError, match="holds no loss mask"):
        prepare_data(DataConfig(source=lm_bin), tok, str(tmp_path / "c"), "sft")
    with pytest.raises(ConfigError, match="holds SFT conversations"):
        prepare_data(DataConfig(source=sft_bin), tok, str(tmp_path / "c"), "lm")
    ((path, _, _),) = prepare_data(DataConfig(source=sft_bin), tok, str(tmp_path / "c"), "sft")
    assert path == sft_bin


def test_config_rules(tiny, tmp_path):
    with pytest.raises(ConfigError, match="data.chat_template.*training.objective sft, dpo and reward only"):
        check_config(tiny(**{"data.chat_template": "x.jinja"}))
    with pytest.raises(ConfigError, match="data.loss_tokens.*training.objective sft only"):
        check_config(tiny(**{"data.loss_tokens": "all"}))
    with pytest.raises(ConfigError, match="data.chat_template.*no such file"):
        check_config(
            tiny(**{"training.objective": "sft", "data.chat_template": str(tmp_path / "none.jinja")})
        )
    cfg = tiny(**{"training.objective": "sft"})
    check_config(cfg)
    assert cfg.data.document_positions  # conversations packed in a window never see each other
    with pytest.raises(ConfigError, match="data.document_positions = False: training.objective sft"):
        check_config(tiny(**{"training.objective": "sft", "data.document_positions": "false"}))
    for name in OBJECTIVES:  # every choice of training.objective builds
        assert method(name).objective(Config()).count is not None


def test_embedded_default_pairs_are_real_and_deterministic():
    files = stdlib_files()[:40]
    first, again = list(docstring_pairs(files)), list(docstring_pairs(files))
    assert first and [c.messages for c in first] == [c.messages for c in again]
    for conv in first:
        user, answer = conv.messages
        assert user["role"] == "user" and answer["role"] == "assistant"
        code = user["content"].split("```python\n", 1)[1]
        assert code.startswith(("def ", "async def ")) and answer["content"] not in code


# ---- packing and the loss -------------------------------------------------------------------------------------


def test_packed_conversations_never_attend_to_each_other(tmp_path):
    """A window packing several conversations gives every conversation's logits as if it were alone."""
    tf = prepared(
        write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in conversations(6, turns=1)]),
        tmp_path / "c",
    )
    window = len(tf) - 1
    mb = make_micro_batch([tf.slice(0, window + 1)], ByteTokenizer().eos_id, [tf.flags(0, window + 1)])
    starts = (tf.mask[:window] & FLAG_START).nonzero().flatten().tolist()
    assert len(starts) == 6 and mb.document_ids[0].unique().numel() == 6
    # EOS ends each assistant turn inside a conversation: documents follow the flags, not EOS
    assert [int(mb.positions[0, s]) for s in starts] == [0] * 6
    args = FLAVORS["debug"].with_(vocab_size=384, max_seq_len=window)
    with torch.device("meta"):
        model = Llama(args)
    materialize(model, torch.device("cpu"), 0, model.param_std, model.init_buffers)
    with torch.no_grad():
        packed = model(mb.inputs, mb.positions)  # (1, S, V)
        for s, e in zip(starts, starts[1:] + [window]):
            alone = model(mb.inputs[:, s:e], torch.arange(e - s)[None])
            torch.testing.assert_close(packed[:, s:e], alone, rtol=1e-5, atol=1e-5)


def test_labels_are_ignored_outside_assistant_tokens_and_the_loss_by_hand():
    """Tokens 0..9 with hand-set flags: the labels, and the loss summed over the two trained targets."""
    tokens = torch.arange(10)
    flags = torch.tensor(
        [FLAG_START, 0, 0, FLAG_LOSS, FLAG_LOSS, 0, FLAG_START, 0, FLAG_LOSS, 0], dtype=torch.uint8
    )
    mb = make_micro_batch([tokens[:9]], eos_id=99, flags=[flags[:9]])
    assert mb.labels.tolist() == [[IGNORE, IGNORE, 3, 4, IGNORE, IGNORE, IGNORE, 8]]
    assert mb.positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]] and mb.document_ids.tolist() == [
        [0] * 6 + [1] * 2
    ]
    logits = torch.randn(1, 8, 12)
    objective = method("sft").objective(Config())
    by_hand = -(
        torch.log_softmax(logits[0, 2], -1)[3]
        + torch.log_softmax(logits[0, 3], -1)[4]
        + torch.log_softmax(logits[0, 7], -1)[8]
    )
    torch.testing.assert_close(objective.loss(logits, mb.labels), by_hand)
    assert int(objective.count(mb)) == 3


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory) -> str:
    """The embedded SFT default tokenized once for the module (parsing the standard library takes seconds)."""
    cache = tmp_path_factory.mktemp("sft_cache")
    prepare_data(DataConfig(), ByteTokenizer(), str(cache), "sft")
    return str(cache)


def test_the_step_loss_is_the_assistant_loss_over_their_global_count(tmp_path, stdlib_cache):
    """The trainer's step (4 micro-batches accumulated) equals the summed loss of the assistant targets of the whole
    batch divided by their count, computed from the model before the step."""
    cfg = tiny_config(
        tmp_path / "run",
        stdlib_cache,
        **{"training.objective": "sft", "training.steps": 1, "training.seq_len": 64},
    )
    trainer = Trainer(cfg)
    data = trainer.loader.next_step()
    assert len(data.micro_batches) == 4
    with torch.no_grad():
        model = trainer.parts[0]
        total = sum(cross_entropy_sum(model(mb.inputs, mb.positions), mb.labels) for mb in data.micro_batches)
    count = sum(int((mb.labels != IGNORE).sum()) for mb in data.micro_batches)
    assert 0 < count < sum(mb.labels.numel() for mb in data.micro_batches)
    out = trainer.train_step(data.micro_batches)
    torch.testing.assert_close(out["loss"], total / count, rtol=1e-6, atol=0)


# ---- runs -----------------------------------------------------------------------------------------------------


def sft_run(run_dir, cache, **extra):
    # 16 windows of 64 bytes: a step without any assistant target (60% of such windows hold none) is unlikely
    return tiny_config(
        run_dir,
        cache,
        **{
            "training.objective": "sft",
            "training.seq_len": 64,
            "training.global_batch_size": 16,
            "training.micro_batch_size": 4,
            "optimizer.lr": 3e-3,
            "optimizer.warmup_steps": 2,
            "run.seed": 1,
            **extra,
        },
    )


def test_embedded_default_trains_and_validation_loss_falls(tmp_path, stdlib_cache, capsys):
    """``loom train --training.objective sft`` with nothing else: the debug model on the standard library's
    docstrings (byte tokenizer, built-in template); the held-out loss falls over 40 steps."""
    run_dir = tmp_path / "run"
    args = [
        f"--{k}={v}"
        for k, v in {
            "training.objective": "sft",
            "run.dir": run_dir,
            "data.cache_dir": stdlib_cache,
            "training.steps": 40,
            "training.seq_len": 64,
            "training.global_batch_size": 16,
            "training.micro_batch_size": 8,
            "training.eval_every": 10,
            "training.eval_batches": 1,
            "optimizer.lr": 3e-3,
            "metrics.every": 10,
            "metrics.tensorboard": "false",
            "checkpoint.at_end": "false",
        }.items()
    ]
    assert loom_main(["train", *args]) == 0
    assert "conversations" in capsys.readouterr().out  # the banner's data line
    with open(run_dir / "metrics.jsonl") as fh:
        vals = [json.loads(line)["val_loss"] for line in fh]
    assert len(vals) == 4 and vals[-1] < vals[0] - 0.5, vals
    with open(run_dir / "data_sources.json") as fh:
        (record,) = json.load(fh)
    assert (
        record["kind"] == "stdlib" and record["loss_tokens"] == "assistant" and record["conversations"] > 1000
    )


@pytest.mark.slow
def test_resume_mid_run_continues_bitwise(tmp_path, stdlib_cache):
    """8 steps saved at 4 and 8; a copy of the run resumed from step 4 writes steps 5..8 exactly as the
    uninterrupted run did."""
    extra = {"training.steps": 8, "checkpoint.every": 4, "checkpoint.keep": 0, "run.deterministic": "true"}
    whole = Trainer(sft_run(tmp_path / "whole", stdlib_cache, **extra)).fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "part", ignore=shutil.ignore_patterns(".lock"))
    step4 = str(tmp_path / "part" / "checkpoints" / step_dir_name(4))
    resumed = Trainer(
        sft_run(
            tmp_path / "part",
            stdlib_cache,
            **extra,
            **{"checkpoint.resume": step4, "checkpoint.overwrite": "true"},
        )
    ).fit()
    key = lambda recs: [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["batch_hash"]) for r in recs]
    assert [r["step"] for r in resumed] == [5, 6, 7, 8] and key(resumed) == key(whole[4:])


def test_prepared_sft_file_trains(tmp_path, capsys):
    source = write_jsonl(tmp_path / "m.jsonl", [{"messages": c} for c in conversations(60, turns=3)])
    out = str(tmp_path / "sft.bin")
    assert loom_main(["data", "prepare", "--source", source, "--output", out, "--objective", "sft"]) == 0
    assert "60 conversations" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="needs --objective sft"):
        parse_args(["--source", source, "--output", out, "--loss-tokens", "all"])
    records = Trainer(
        sft_run(
            tmp_path / "run",
            tmp_path / "cache",
            **{"data.source": out, "training.steps": 2, "data.val_fraction": 0.0},
        )
    ).fit()
    assert len(records) == 2 and all(r["loss"] > 0 for r in records)
    with pytest.raises(UserError):
        Trainer(tiny_config(tmp_path / "lm", tmp_path / "cache", **{"data.source": out, "training.steps": 1}))
