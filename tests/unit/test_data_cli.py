"""``loom data prepare``: arguments, errors as one line with exit code 2, progress and summary."""

from __future__ import annotations

import io
import json

import pytest

from loom.cli.data import ProgressLine, parse_args
from loom.cli.main import main as loom_main
from loom.config.errors import ConfigError
from loom.data.token_file import TokenFile, read_meta


def prepare(*args: str) -> int:
    return loom_main(["data", "prepare", *args])


def user_error(capsys, *args: str) -> str:
    """Run ``loom data prepare args`` expecting a user error; returns its one stderr line."""
    with pytest.raises(SystemExit) as exc:
        prepare(*args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loom: error: ")
    return err[0]


@pytest.fixture
def jsonl(tmp_path) -> str:
    path = tmp_path / "c.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"document number {i}\n" * (1 + i % 3)}) + "\n" for i in range(600))
    )
    return str(path)


def test_help_prints_usage(capsys):
    assert prepare("--help") == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: loom data prepare") and "--text-field" in out


def test_writes_token_file_with_progress_and_summary(jsonl, tmp_path, capsys):
    out = str(tmp_path / "sub" / "c.bin")
    assert prepare("--source", jsonl, "--output", out) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1
    assert captured.out.startswith(f"wrote {out}: 600 documents, ")
    meta = read_meta(out)
    assert f"{meta.tokens:,} tokens" in captured.out
    assert captured.err.startswith("\rtokenizing: ") and captured.err.endswith("\n")
    assert "600 documents" in captured.err and "tokens/s" in captured.err
    assert (meta.documents, meta.eos_id, meta.tokenizer) == (600, 257, "byte-v1")
    assert len(TokenFile(out)) == meta.tokens


def test_progress_line_redraws_in_place():
    stream = io.StringIO()
    line = ProgressLine(stream, every=0.0)
    line(256, 1_000_000)
    line(512, 9)  # shorter text: padded so that nothing of the longer one stays on screen
    line.finish(600, 12)
    draws = stream.getvalue().split("\r")[1:]
    assert len(draws) == 3 and draws[-1].endswith("\n")
    assert "256 documents | 1,000,000 tokens" in draws[0]
    assert len(draws[1]) >= len(draws[0].rstrip())
    assert "600 documents | 12 tokens" in draws[2]


def test_progress_line_is_throttled():
    stream = io.StringIO()
    line = ProgressLine(stream, every=3600.0)
    for i in range(100):
        line(i, i)
    assert stream.getvalue().count("\r") == 1  # the first call draws, the rest come too soon


def test_parse_args_defaults_and_equals_form():
    assert parse_args(["--source", "a.jsonl", "--output=o.bin"]) == {
        "source": "a.jsonl",
        "output": "o.bin",
        "tokenizer": "byte",
        "text_field": "text",
        "encoding_errors": "strict",
    }
    assert parse_args(
        [
            "--source=",
            "-o",
            "x.bin",
            "--text-field",
            "body",
            "--tokenizer",
            "t.json",
            "--encoding-errors",
            "replace",
        ]
    ) == {
        "source": "",
        "output": "x.bin",
        "tokenizer": "t.json",
        "text_field": "body",
        "encoding_errors": "replace",
    }


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--source", "a.jsonl"], "--output: required"),
        (["--output", "a.bin"], "--source: required"),
        (["--source", "a.jsonl", "--output", "a.bin", "--bogus", "1"], "--bogus: unknown option"),
        (["stray", "--output", "a.bin"], "stray: unknown option"),
        (["--source", "a.jsonl", "--output"], "--output: missing value"),
        (["--source", "--output", "a.bin"], "--source: missing value"),
        (["--source", "a.jsonl", "--output", "a.txt"], "must end in .bin"),
    ],
)
def test_argument_errors(args, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_args(args)


def test_argument_error_exits_with_one_line(capsys):
    assert "--bogus: unknown option" in user_error(capsys, "--source", "x", "--output", "o.bin", "--bogus")


def test_error_part_way_starts_on_its_own_line(tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": "x"}) + "\n" for _ in range(300)) + '{"body": "y"}\n')
    with pytest.raises(SystemExit):
        prepare("--source", str(path), "--output", str(tmp_path / "o.bin"))
    err = capsys.readouterr().err
    assert err.startswith("\rtokenizing: 256 documents")  # drawn after the first batch of 256
    assert "\nloom: error: --text-field = 'text': not a field of" in err
    assert not (tmp_path / "o.bin").exists()


def test_source_errors_name_the_option(jsonl, tmp_path, capsys):
    out = str(tmp_path / "o.bin")
    line = user_error(capsys, "--source", str(tmp_path / "*.txt"), "--output", out)
    assert line.startswith("loom: error: --source = ") and "glob matches no files" in line
    line = user_error(capsys, "--source", f"{jsonl}:0.5", "--output", out)
    assert "--source" in line and "without a weight" in line
    line = user_error(capsys, "--source", jsonl, "--text-field", "body", "--output", out)
    assert "--text-field = 'body'" in line and jsonl in line
    line = user_error(capsys, "--source", jsonl, "--tokenizer", str(tmp_path / "none.json"), "--output", out)
    assert "--tokenizer" in line


def test_token_file_source(jsonl, tmp_path, capsys):
    first = str(tmp_path / "first.bin")
    assert prepare("--source", jsonl, "--output", first) == 0
    capsys.readouterr()
    line = user_error(capsys, "--source", first, "--output", first)
    assert "both the source and the output" in line

    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.train_from_iterator(["document number"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    line = user_error(
        capsys,
        "--source",
        first,
        "--tokenizer",
        str(tmp_path / "tokenizer.json"),
        "--output",
        str(tmp_path / "second.bin"),
    )
    assert line.startswith("loom: error: --tokenizer") and "written with tokenizer byte-v1" in line
