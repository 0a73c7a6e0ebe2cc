"""One corpus in every source format must become the same token file, for both kinds of tokenizer."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loom.cli.data import main as prepare_main
from loom.config.errors import ConfigError
from loom.config.sections import DataConfig
from loom.data import build_loader, prepare_data
from loom.data.prepare import tokenize_to_file
from loom.data.sources import documents, parse_source
from loom.data.token_file import TokenFile, read_meta
from loom.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer

# Edge cases on purpose: an empty document (skipped everywhere), whitespace only, CRLF and a bare CR,
# non-ASCII, a line separator (U+2028) that must not split a jsonl line, the EOS token's own text, and a
# document longer than one window.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "",
    "def f(x):\r\n    return x * 2\r\n",
    "héllo wörld — ünïcode ✓ 日本語",
    " ",
    "line one\u2028line two\rthree",
    "a literal <|endoftext|> inside a document",
    "pack my box with five dozen liquor jugs " * 12,
    "",
    "last one, no newline",
]

FORMATS = ["text", "jsonl", "parquet", "hf_dataset"]


def write_text_files(folder, docs) -> str:
    os.makedirs(folder)
    for i, doc in enumerate(docs):
        with open(os.path.join(folder, f"doc_{i:03d}.txt"), "w", encoding="utf-8", newline="") as fh:
            fh.write(doc)
    return os.path.join(folder, "*.txt")


def write_jsonl(path, docs) -> str:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        for i, doc in enumerate(docs):
            fh.write(json.dumps({"id": i, "text": doc}, ensure_ascii=False) + "\n")
    return str(path)


def write_parquet(path, docs) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=3)
    return str(path)


def write_hf_dataset(path, docs) -> str:
    import datasets

    datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs}).save_to_disk(str(path))
    return str(path)


def write_corpus(root, fmt: str, docs=CORPUS) -> str:
    """``docs`` in format ``fmt`` under ``root``; returns the data.source string for it."""
    writers = {
        "text": lambda: write_text_files(os.path.join(root, "text"), docs),
        "jsonl": lambda: write_jsonl(os.path.join(root, "corpus.jsonl"), docs),
        "parquet": lambda: write_parquet(os.path.join(root, "corpus.parquet"), docs),
        "hf_dataset": lambda: write_hf_dataset(os.path.join(root, "hf_ds"), docs),
    }
    return writers[fmt]()


def train_hf_tokenizer(path) -> str:
    """A tiny byte-level BPE trained on the corpus, with <|endoftext|> as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([d for d in CORPUS if d], trainer)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return {fmt: write_corpus(str(root), fmt) for fmt in FORMATS}


@pytest.fixture(scope="module", params=["byte", "hf"])
def tokenizer(request, tmp_path_factory):
    if request.param == "byte":
        return ByteTokenizer()
    return HFTokenizer(train_hf_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def expected_stream(tokenizer) -> list[int]:
    """What every format must produce: each non-empty document's ids, then EOS, in corpus order."""
    out = []
    for doc in CORPUS:
        ids = list(tokenizer.encode(doc))
        if ids:
            out += ids + [tokenizer.eos_id]
    return out


def read_bytes(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def test_documents_come_back_in_order_in_every_format(corpora):
    for fmt, source in corpora.items():
        (spec,) = parse_source(source)
        assert spec.kind == fmt
        assert list(documents(spec)) == CORPUS, fmt


def test_every_format_gives_the_same_token_file(corpora, tokenizer, tmp_path):
    files = {}
    for fmt, source in corpora.items():
        (spec,) = parse_source(source)
        out = tmp_path / f"{fmt}.bin"
        meta = tokenize_to_file(spec, tokenizer, str(out), batch=3)  # small batches: several flushes
        assert meta.documents == sum(1 for d in CORPUS if tokenizer.encode(d)), fmt
        files[fmt] = read_bytes(out)
    assert len(set(files.values())) == 1, "formats disagree"
    tokens = TokenFile(str(tmp_path / "text.bin")).slice(0, 10**6).tolist()
    assert tokens == expected_stream(tokenizer)


def test_prepare_cli_writes_the_same_token_file(corpora, tokenizer, tmp_path, capsys):
    tok_arg = "byte" if isinstance(tokenizer, ByteTokenizer) else tokenizer.path
    (spec,) = parse_source(corpora["text"])
    tokenize_to_file(spec, tokenizer, str(tmp_path / "reference.bin"))
    reference = read_bytes(tmp_path / "reference.bin")
    for fmt, source in corpora.items():
        out = str(tmp_path / f"cli_{fmt}.bin")
        assert prepare_main(["--source", source, "--tokenizer", tok_arg, f"--output={out}"]) == 0
        assert read_bytes(out) == reference, fmt
    # a prepared token file as the source: copied as is, and again identical
    again = str(tmp_path / "again.bin")
    assert (
        prepare_main(["--source", str(tmp_path / "cli_jsonl.bin"), "--tokenizer", tok_arg, "--output", again])
        == 0
    )
    assert read_bytes(again) == reference
    assert read_meta(again) == read_meta(str(tmp_path / "reference.bin"))


def test_every_format_trains_on_the_same_batches(corpora, tokenizer, tmp_path):
    """Through the trainer's own path (prepare_data + build_loader) every format yields the same steps."""
    prepared = str(tmp_path / "prepared.bin")
    (spec,) = parse_source(corpora["jsonl"])
    tokenize_to_file(spec, tokenizer, prepared)
    hashes = set()
    for source in [*corpora.values(), prepared]:
        cfg = DataConfig(source=source, val_fraction=0.0)
        files = prepare_data(cfg, tokenizer, str(tmp_path / "cache"))
        loader = build_loader(
            cfg, tokenizer, files, seq_len=8, seed=3, dp_rank=0, dp_size=1, micro_batch=2, accumulation=2
        )
        hashes.add(tuple(loader.next_step(with_hash=True).global_hash for _ in range(5)))
    assert len(hashes) == 1


def test_eos_ends_every_document_and_only_there(corpora, tokenizer, tmp_path):
    (spec,) = parse_source(corpora["jsonl"])
    tokenize_to_file(spec, tokenizer, str(tmp_path / "t.bin"))
    tokens = TokenFile(str(tmp_path / "t.bin")).slice(0, 10**6)
    eos_at = (tokens == tokenizer.eos_id).nonzero().flatten().tolist()
    lengths = [len(tokenizer.encode(d)) for d in CORPUS if tokenizer.encode(d)]
    ends = torch.tensor(lengths).add(1).cumsum(0).sub(1).tolist()
    assert eos_at == ends  # the "<|endoftext|>" text inside a document is not an EOS
    assert tokens[-1].item() == tokenizer.eos_id


def test_null_text_counts_as_an_empty_document(tmp_path):
    docs = ["first", None, "second"]
    with open(tmp_path / "n.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    write_parquet(str(tmp_path / "n.parquet"), docs)
    tok = ByteTokenizer()
    for name in ("n.jsonl", "n.parquet"):
        (spec,) = parse_source(str(tmp_path / name))
        meta = tokenize_to_file(spec, tok, str(tmp_path / f"{name}.bin"))
        assert meta.documents == 2
    assert read_bytes(tmp_path / "n.jsonl.bin") == read_bytes(tmp_path / "n.parquet.bin")


def test_gzipped_jsonl_and_dataset_dict_read_like_the_plain_ones(tmp_path):
    import gzip

    import datasets

    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"body": d}) + "\n" for d in CORPUS)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": CORPUS})}).save_to_disk(
        str(tmp_path / "dd")
    )
    with gzip.open(tmp_path / "c.ndjson.gz", "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"body": d}) + "\n" for d in CORPUS)
    for source in (str(tmp_path / "c.jsonl.gz"), str(tmp_path / "c.ndjson.gz"), str(tmp_path / "dd")):
        (spec,) = parse_source(source, text_field="body")
        assert list(documents(spec)) == CORPUS


def test_gzipped_text_is_decompressed_and_a_cut_one_is_one_line(tmp_path):
    import gzip

    for i, doc in enumerate(CORPUS):
        with gzip.open(tmp_path / f"d{i}.txt.gz", "wt", encoding="utf-8") as fh:
            fh.write(doc)
    (spec,) = parse_source(str(tmp_path / "d*.txt.gz"))
    assert list(documents(spec)) == CORPUS
    whole = (tmp_path / "d0.txt.gz").read_bytes()
    (tmp_path / "cut.txt.gz").write_bytes(whole[: len(whole) // 2])
    (spec,) = parse_source(str(tmp_path / "cut.txt.gz"))
    with pytest.raises(ConfigError, match="is not a complete gzip file"):
        list(documents(spec))


def test_hf_tokenizer_round_trips_and_finds_eos(tmp_path):
    tok = build_tokenizer(train_hf_tokenizer(tmp_path / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
    assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)
    for doc in CORPUS:
        assert tok.decode(tok.encode(doc)) == doc
    assert tok.encode_batch(CORPUS[:3]) == [tok.encode(d) for d in CORPUS[:3]]
    assert build_tokenizer(str(tmp_path)).fingerprint() == tok.fingerprint()  # a folder finds tokenizer.json


def test_byte_tokenizer_fast_path_matches_encode():
    tok = ByteTokenizer()
    for doc in CORPUS:
        assert tok.encode_bytes(doc.encode("utf-8")).tolist() == tok.encode(doc)
        assert tok.decode(tok.encode(doc)) == doc
