"""User mistakes with data end in a ConfigError / UserError that names the path or field at fault."""

from __future__ import annotations

import json
import os

import pytest

from loom.config.errors import ConfigError, UserError
from loom.config.sections import DataConfig
from loom.data import build_loader, prepare_data
from loom.data.prepare import tokenize_to_file
from loom.data.sources import parse_source
from loom.data.token_file import TokenFile, TokenFileWriter, read_meta
from loom.data.tokenizers import ByteTokenizer, build_tokenizer


def write_jsonl(path, rows) -> str:
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def byte_token_file(path, docs) -> str:
    tok = ByteTokenizer()
    w = TokenFileWriter(str(path), eos_id=tok.eos_id, vocab_size=tok.vocab_size, tokenizer=tok.fingerprint())
    for d in docs:
        w.add(tok.encode(d))
    w.close()
    return str(path)


def tokenize(source: str, tmp_path, text_field="text"):
    (spec,) = parse_source(source, text_field)
    return tokenize_to_file(spec, ByteTokenizer(), str(tmp_path / "out.bin"))


def test_glob_matching_nothing(tmp_path):
    pattern = str(tmp_path / "*.txt")
    with pytest.raises(ConfigError, match="glob matches no files") as err:
        parse_source(pattern)
    assert pattern in str(err.value)


def test_missing_file(tmp_path):
    path = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="no such file") as err:
        parse_source(path)
    assert path in str(err.value)


def test_missing_file_in_a_mixture(tmp_path):
    good = byte_token_file(tmp_path / "good.bin", ["x" * 50])
    with pytest.raises(ConfigError, match="nope.bin"):
        parse_source(f"{good}:0.5,{tmp_path / 'nope.bin'}:0.5")


def test_jsonl_without_the_text_field(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "fine"}, {"body": "no text here"}])
    with pytest.raises(ConfigError) as err:
        tokenize(path, tmp_path)
    msg = str(err.value)
    assert "data.text_field" in msg and "'text'" in msg and path in msg and "line 2" in msg
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]  # no partial token file is left behind


def test_jsonl_with_a_non_text_field(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": 12}])
    with pytest.raises(ConfigError, match="holds a int") as err:
        tokenize(path, tmp_path)
    assert path in str(err.value)


def test_jsonl_with_a_broken_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        tokenize(str(path), tmp_path)


def test_parquet_and_dataset_without_the_column(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"body": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    for source in (str(tmp_path / "c.parquet"), str(tmp_path / "ds")):
        with pytest.raises(ConfigError, match="not a column") as err:
            tokenize(source, tmp_path)
        assert source in str(err.value) and "body" in str(err.value)


def test_folder_that_is_not_a_dataset(tmp_path):
    (tmp_path / "docs").mkdir()
    with pytest.raises(ConfigError, match="folder/\\*.txt"):
        parse_source(str(tmp_path / "docs"))


def test_mixture_entry_without_weight(tmp_path):
    a = byte_token_file(tmp_path / "a.bin", ["x" * 50])
    with pytest.raises(ConfigError, match="needs a weight"):
        parse_source(f"{a}:0.5,{a}")
    with pytest.raises(ConfigError, match="weights must be > 0"):
        parse_source(f"{a}:0")


def test_truncated_token_file(tmp_path):
    path = byte_token_file(tmp_path / "t.bin", ["hello world"] * 10)
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 2)
    with pytest.raises(UserError, match="truncated") as err:
        TokenFile(path)
    assert path in str(err.value)
    cfg = DataConfig(source=path)  # and on the training path
    with pytest.raises(UserError, match="truncated"):
        build_loader(
            cfg,
            ByteTokenizer(),
            prepare_data(cfg, ByteTokenizer(), str(tmp_path / "cache")),
            seq_len=8,
            seed=0,
            dp_rank=0,
            dp_size=1,
            micro_batch=1,
            accumulation=1,
        )


def test_token_file_without_its_description(tmp_path):
    path = byte_token_file(tmp_path / "t.bin", ["hello"])
    os.remove(path + ".json")
    with pytest.raises(UserError, match="description .*t.bin.json is missing"):
        read_meta(path)


def test_token_file_with_a_broken_description(tmp_path):
    path = byte_token_file(tmp_path / "t.bin", ["hello"])
    with open(path + ".json", "w") as fh:
        json.dump({"dtype": "uint16"}, fh)
    with pytest.raises(UserError, match="not a loom token file description"):
        read_meta(path)


def test_fewer_tokens_than_one_window(tmp_path):
    path = byte_token_file(tmp_path / "small.bin", ["tiny"])  # 5 tokens
    cfg = DataConfig(source=path, val_fraction=0.0)
    files = prepare_data(cfg, ByteTokenizer(), str(tmp_path / "cache"))
    with pytest.raises(UserError, match="5 tokens are fewer than one training window of 9") as err:
        build_loader(
            cfg,
            ByteTokenizer(),
            files,
            seq_len=8,
            seed=0,
            dp_rank=0,
            dp_size=1,
            micro_batch=1,
            accumulation=1,
        )
    assert path in str(err.value)


def test_token_file_from_another_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["one two three"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    path = byte_token_file(tmp_path / "t.bin", ["hello world " * 10])
    cfg = DataConfig(source=path, val_fraction=0.0)
    hf = build_tokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="written with tokenizer byte-v1") as err:
        build_loader(
            cfg,
            hf,
            prepare_data(cfg, hf, str(tmp_path / "cache")),
            seq_len=8,
            seed=0,
            dp_rank=0,
            dp_size=1,
            micro_batch=1,
            accumulation=1,
        )
    assert path in str(err.value)


def test_source_with_only_empty_documents(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": ""}, {"text": None}])
    with pytest.raises(UserError, match="no non-empty documents") as err:
        tokenize(path, tmp_path)
    assert path in str(err.value)
    assert not os.path.exists(tmp_path / "out.bin")


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer"):
        build_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizer.json"):
        build_tokenizer(str(tmp_path / "broken.json"))


def test_tokenizer_without_an_end_of_text_token(tmp_path):
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.train_from_iterator(["one two"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="no end-of-text token"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))
