"""``loom generate``: prompts from arguments, a text file, a JSON-lines file (plain and chat) and stdin give the
completions the Python API gives; --output writes one JSON line per prompt; streaming prints the same text;
speculation prints its acceptance; mistakes exit 2 with one line."""

from __future__ import annotations

import io
import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from loom.cli.main import main as loom_main
from loom.infer import Generator


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.unit.test_chat import build_folder
    from tests.unit.test_generate import EOS, random_hf_llama

    path = tmp_path_factory.mktemp("cli") / "hf"
    build_folder(path, "llama3")
    model = random_hf_llama()
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(path)
    return str(path)


def _run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = loom_main(["generate", *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


MESSAGES = [{"role": "user", "content": "Tell me a joke about cats."}]


def test_arguments_file_and_stdin_give_the_api_completions(folder, tmp_path, capsys, monkeypatch):
    expected = [
        c.text
        for c in Generator(folder, compile=False).generate(
            ["Paris is", "def add(", MESSAGES], max_new_tokens=10
        )
    ]
    out = tmp_path / "out.jsonl"
    code, _, err = _run(
        capsys, "--model", folder, "Paris is", "def add(", "--max-new-tokens", "10", "--output", str(out)
    )
    assert code == 0 and "2 prompts" in err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["completion"] for r in records] == expected[:2]
    assert records[0]["prompt"] == "Paris is" and records[0]["finish_reason"] in ("eos", "length")

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Paris is"}) + "\n\n" + json.dumps({"messages": MESSAGES}) + "\n")
    code, _, _ = _run(
        capsys, "-m", folder, "--file", str(jsonl), "--max-new-tokens", "10", "--output", str(out)
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0 and [r["completion"] for r in records] == [expected[0], expected[2]]
    assert records[1]["messages"] == MESSAGES

    text = tmp_path / "prompts.txt"
    text.write_text("Paris is\ndef add(\n")
    code, stdout, _ = _run(capsys, "-m", folder, "--file", str(text), "--max-new-tokens", "10", "--quiet")
    assert code == 0 and stdout == "\n\n".join(expected[:2]) + "\n"

    monkeypatch.setattr("sys.stdin", io.StringIO("Tell me a joke about cats.\n"))
    code, _, _ = _run(capsys, "-m", folder, "--chat", "--max-new-tokens", "10", "--output", str(out))
    assert code == 0 and json.loads(out.read_text())["completion"] == expected[2]


def test_streaming_prints_the_same_text(folder, capsys):
    _, plain, _ = _run(
        capsys, "-m", folder, "Paris is", "def add(", "--max-new-tokens", "12", "--no-stream", "--quiet"
    )
    _, streamed, _ = _run(
        capsys, "-m", folder, "Paris is", "def add(", "--max-new-tokens", "12", "--stream", "--quiet"
    )
    assert streamed == plain and plain.strip()


def test_prompt_lookup_keeps_the_greedy_text_and_reports_acceptance(folder, capsys):
    prompt = "the cat sat on the mat; the cat sat on the"
    _, plain, _ = _run(capsys, "-m", folder, prompt, "--max-new-tokens", "16", "--no-stream", "--quiet")
    code, spec, err = _run(
        capsys,
        "-m",
        folder,
        prompt,
        "--max-new-tokens",
        "16",
        "--no-stream",
        "--prompt-lookup",
        "--speculate-k",
        "3",
    )
    assert code == 0 and spec == plain
    assert "speculative k 3" in err and "of guesses kept" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/no/such/folder", "hi"], "model = '/no/such/folder': folder not found"),
        (["hi"], "--model: missing"),
        (["--temperature", "-1", "hi"], "--temperature = -1.0: a finite number >= 0"),
        (["--temperature", "inf", "hi"], "--temperature = inf: a finite number >= 0"),
        (["--top-p", "2", "hi"], "--top-p = 2.0"),
        (["--system", "be nice", "hi"], "--system = 'be nice': needs --chat"),
        (["--bogus", "hi"], "unrecognized arguments: --bogus"),
        (["--max-new-tokens", "many", "hi"], "invalid int value"),
        (["--prompt-lookup", "--draft", "x", "hi"], "choose --prompt-lookup or --draft"),
    ],
)
def test_mistakes_exit_2_with_one_line(folder, capsys, argv, message):
    if "--model" not in argv and argv != ["hi"]:
        argv = ["--model", folder, *argv]
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_file_mistakes_exit_2_naming_the_line(folder, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + "{not json\n")
    code, _, err = _run(capsys, "-m", folder, "--file", str(bad))
    assert code == 2 and f"{bad}:2" in err and len(err.strip().splitlines()) == 1
    bad.write_text(json.dumps({"text": "no prompt"}) + "\n")
    code, _, err = _run(capsys, "-m", folder, "--file", str(bad))
    assert code == 2 and '"prompt"' in err
    code, _, err = _run(capsys, "-m", folder, "--file", str(tmp_path / "missing.txt"))
    assert code == 2 and "file not found" in err


def test_issue_49_checks_come_before_generating(folder, tmp_path, capsys):
    """--max-new-tokens past the context, --stop-token-id past the vocabulary, --output a folder, a non-UTF-8
    --file, an empty conversation: one line each, before any token is generated; greedy with --top-p says it is
    ignored."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"messages": []}) + "\n")
    number = tmp_path / "number.jsonl"
    number.write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    for argv, needle in (
        (["--file", str(number)], "message 0: 'content' must be a string or a list of text parts; got a int"),
        (["hi", "--max-new-tokens", "1000000000"], "--max-new-tokens = 1000000000: at most"),
        (["hi", "--stop-token-id", "99999999"], "--stop-token-id = 99999999"),
        # torch takes -1 as 2**64 - 1: no "random seed", and no silent other seed
        (["hi", "--seed", "-1"], "--seed = -1: allowed: 0 .. 4294967295"),
        (["hi", "--output", str(tmp_path)], "is a folder"),
        (["--file", str(latin)], "not UTF-8"),
        (["--chat", "--chat-template", str(latin), "hi"], f"--chat-template = '{latin}': not UTF-8 text"),
        (["--file", str(empty)], "is empty"),
        (["--file", str(tmp_path)], "is a folder: give a file of prompts"),
        (["--file", os.devnull], "holds no prompts"),  # a pipe or device is read, not "file not found"
    ):
        code, out, err = _run(capsys, "--model", folder, *argv)
        assert code == 2 and needle in err and err.count("\n") == 1, (argv, err)
    code, _, err = _run(capsys, "--model", folder, "hi", "--max-new-tokens", "2", "--top-p", "0.5")
    assert code == 0 and "--top-p 0.5 is ignored" in err
    # --output in a folder not yet made: made (it was checked as creatable, then the write failed after generating)
    code, _, _ = _run(
        capsys, "-m", folder, "hi", "--max-new-tokens", "2", "--output", str(tmp_path / "new" / "o.jsonl")
    )
    assert code == 0 and (tmp_path / "new" / "o.jsonl").is_file()
    # OpenAI content parts are the text they hold (the template printed the list's Python repr)
    parts, plain = tmp_path / "parts.jsonl", tmp_path / "plain.jsonl"
    text = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a joke."}]
    parts.write_text(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    plain.write_text(json.dumps({"messages": [{"role": "user", "content": "Tell me a joke."}]}) + "\n")
    outs = [
        _run(capsys, "-m", folder, "--file", str(f), "--max-new-tokens", "4", "--quiet")
        for f in (parts, plain)
    ]
    assert outs[0][0] == 0 and outs[0][1] == outs[1][1], outs
