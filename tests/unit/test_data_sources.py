"""Source strings, the embedded default (this Python's stdlib) and what a run records about its data."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig

import pytest

from loom.config.errors import ConfigError
from loom.config.sections import DataConfig
from loom.data import describe_sources, prepare_data
from loom.data.prepare import cache_path
from loom.data.sources import EMBEDDED, content_hash, parse_source, stdlib_files
from loom.data.token_file import read_meta
from loom.data.tokenizers import ByteTokenizer


def test_stdlib_files_are_the_standard_library_sources():
    files = stdlib_files()
    root = sysconfig.get_paths()["stdlib"]
    assert files == sorted(files) and len(files) > 100
    assert os.path.join(root, "os.py") in files and os.path.join(root, "json", "__init__.py") in files
    for f in files:
        rel = os.path.relpath(f, root).split(os.sep)
        assert f.endswith(".py") and rel[0] != ".."
        assert "site-packages" not in rel and "__pycache__" not in rel
        assert not any(part.startswith(("test", "idle_test")) for part in rel[:-1]), f


def test_unset_source_is_the_embedded_default():
    (spec,) = parse_source("")
    assert (spec.kind, spec.label, spec.weight) == ("stdlib", EMBEDDED, 1.0)
    assert spec.paths == stdlib_files()


def test_embedded_default_is_recorded_with_its_content_hash(tmp_path):
    cfg = DataConfig()
    tok = ByteTokenizer()
    files = prepare_data(cfg, tok, str(tmp_path / "cache"))
    describe_sources(cfg, files, str(tmp_path / "data_sources.json"))
    with open(tmp_path / "data_sources.json") as fh:
        (rec,) = json.load(fh)
    paths = stdlib_files()
    assert rec["kind"] == "stdlib" and rec["label"] == EMBEDDED and rec["files"] == len(paths)
    assert rec["file_list"] == paths
    h = hashlib.blake2b(digest_size=16)  # the documented recipe, computed independently
    for p in paths:
        with open(p, "rb") as fh:
            data = fh.read()
        h.update(len(data).to_bytes(8, "little") + data)
    assert rec["content_hash"] == h.hexdigest()
    meta = read_meta(rec["token_file"])
    assert meta.documents == sum(1 for p in paths if os.path.getsize(p) > 0)  # empty files are skipped
    assert meta.tokens == sum(os.path.getsize(p) for p in paths) + meta.documents  # bytes + one EOS each


def test_content_hash_sees_contents_and_boundaries(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("ab")
    b.write_text("c")
    first = content_hash([str(a), str(b)])
    a.write_text("a")
    b.write_text("bc")  # same bytes in total, moved across the file boundary
    assert content_hash([str(a), str(b)]) != first
    a.write_text("ab")
    b.write_text("c")
    assert content_hash([str(a), str(b)]) == first


def test_other_sources_are_recorded_without_a_file_list(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    cfg = DataConfig(source=str(tmp_path / "d.jsonl"))
    files = prepare_data(cfg, ByteTokenizer(), str(tmp_path / "cache"))
    describe_sources(cfg, files, str(tmp_path / "sources.json"))
    with open(tmp_path / "sources.json") as fh:
        (rec,) = json.load(fh)
    assert rec["kind"] == "jsonl" and rec["files"] == 1 and "file_list" not in rec
    assert rec["token_file"] == files[0][0]


def test_mixture_weights_and_labels(tmp_path):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text(json.dumps({"text": name}) + "\n")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    specs = parse_source(f" {a}:0.7 , {b}:0.3 ")
    assert [(s.kind, s.weight, s.label) for s in specs] == [("jsonl", 0.7, str(a)), ("jsonl", 0.3, str(b))]


def test_a_colon_in_an_existing_path_is_not_a_weight(tmp_path):
    path = tmp_path / "notes:1.txt"
    path.write_text("x")
    (spec,) = parse_source(str(path))
    assert spec.paths == [str(path)] and spec.weight == 1.0


def test_a_glob_of_mixed_kinds_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="mixes kinds"):
        parse_source(str(tmp_path / "*"))


def test_the_cache_follows_the_source(tmp_path):
    """A changed source file gets a new cached tokenization instead of silently reusing the old one."""
    doc = tmp_path / "d.txt"
    doc.write_text("first version")
    cfg = DataConfig(source=str(doc))
    ((first, _, _),) = prepare_data(cfg, ByteTokenizer(), str(tmp_path / "cache"))
    assert prepare_data(cfg, ByteTokenizer(), str(tmp_path / "cache"))[0][0] == first  # reused
    doc.write_text("the second, longer version")
    ((second, _, _),) = prepare_data(cfg, ByteTokenizer(), str(tmp_path / "cache"))
    assert second != first
    assert read_meta(second).tokens == len("the second, longer version") + 1
    (spec,) = parse_source(str(doc))
    assert cache_path(spec, ByteTokenizer(), str(tmp_path / "cache")) == second
