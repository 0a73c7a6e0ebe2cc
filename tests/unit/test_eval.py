"""Perplexity and bits per byte (loom.eval.perplexity, ``loom eval --source``) against a direct computation: every
document scored on its own after the prefix token, the same totals from a token file (without bits per byte), the
same results in any batch, lm-eval's rolling windows, and one-line errors."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from loom.cli.main import main as loom_main
from loom.config.errors import ConfigError
from loom.eval import load, perplexity, total
from loom.eval.perplexity import NO_BYTES
from loom.eval.scoring import Window, continuation_window, rolling_windows, score
from tests.unit.test_run_dir import tokenizer_folder, train

pytest.importorskip("tokenizers")

DOCS = ["def main():\n    return 0\n", "", "déjà vu: 3 < 4 && x != y 🙂", "the quick brown fox " * 3]


def write_jsonl(path, docs=DOCS) -> str:
    with open(path, "w") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d}) + "\n")
    return str(path)


def checkpoint(tmp_path, monkeypatch, tokenizer: str = "byte") -> str:
    train(tmp_path, monkeypatch, tmp_path / "run", tokenizer=tokenizer)
    return str(tmp_path / "run" / "checkpoints" / "step_00000002")


def direct(model, tokenizer, prefix: int, docs) -> tuple[float, int, int]:
    """(summed NLL in nats, tokens, UTF-8 bytes) of each non-empty document, one full forward each."""
    nll, tokens, nbytes = 0.0, 0, 0
    for text in docs:
        ids = tokenizer.encode(text)
        if not text or not ids:
            continue
        seq = torch.tensor([[prefix, *ids]])  # (1, n + 1)
        with torch.no_grad():
            logp = model(seq[:, :-1]).float().log_softmax(-1)  # (1, n, V)
        nll -= float(logp.gather(-1, seq[:, 1:, None]).sum())
        tokens += len(ids)
        nbytes += len(text.encode("utf-8"))
    return nll, tokens, nbytes


@pytest.mark.parametrize("tok", ["byte", "bpe"])
def test_perplexity_and_bits_per_byte_equal_a_direct_computation(tmp_path, monkeypatch, tok):
    """A run's checkpoint: EOS before each document (what it trained on), inputs as long as training.seq_len;
    bits per byte over the text's UTF-8 bytes, which a BPE tokenizer makes differ from the tokens."""
    spec = "byte" if tok == "byte" else tokenizer_folder(tmp_path / "tok")
    ckpt = checkpoint(tmp_path, monkeypatch, spec)
    em = load(ckpt, device="cpu")
    assert em.max_length == 32 and em.prefix_id == em.tokenizer.eos_id
    docs = DOCS[:3]  # each shorter than 32 tokens: one window, one forward
    (result,) = perplexity(em, write_jsonl(tmp_path / "docs.jsonl", docs))
    nll, tokens, nbytes = direct(em.model, em.tokenizer, em.prefix_id, docs)
    assert (result.documents, result.tokens, result.bytes) == (2, tokens, nbytes)
    if tok == "bpe":
        assert tokens < nbytes
    assert result.nll == pytest.approx(nll, rel=1e-6)
    assert result.token_perplexity == pytest.approx(math.exp(nll / tokens), rel=1e-6)
    assert result.bits_per_byte == pytest.approx(nll / math.log(2) / nbytes, rel=1e-6)


def test_long_documents_are_scored_in_rolling_windows_once_per_token(tmp_path, monkeypatch):
    ckpt = checkpoint(tmp_path, monkeypatch)
    em = load(ckpt, device="cpu")
    long = "for i in range(10):\n    print(i * i)\n" * 4  # 148 tokens: five windows of at most 32 inputs
    (result,) = perplexity(em, write_jsonl(tmp_path / "long.jsonl", [long]))
    windows = rolling_windows(em.tokenizer.encode(long), em.prefix_id, em.max_length)
    assert len(windows) == 5 and sum(w.n for w in windows) == result.tokens == len(long)
    assert all(len(w.ids) - 1 <= 32 for w in windows)
    # the same total from one forward per scored token over exactly that token's context
    nll = 0.0
    for w in windows:
        for k in range(w.n):
            ids = w.ids[: len(w.ids) - w.n + k + 1]
            with torch.no_grad():
                logp = em.model(torch.tensor([ids[:-1]])).float().log_softmax(-1)  # (1, S, V)
            nll -= float(logp[0, -1, ids[-1]])
    assert result.nll == pytest.approx(nll, rel=1e-5)


def test_rolling_windows_are_lm_evals():
    utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(100, 141))
    for max_length in (1, 2, 5, 16, 41, 64):
        for n in (0, 1, 5, 16, 17, 41):
            ours = [(w.ids, w.n) for w in rolling_windows(tokens[:n], 7, max_length)]
            theirs = [
                ((ctx + cont)[-(max_length + 1) :], len(cont))
                for ctx, cont in map(
                    utils.make_disjoint_window, utils.get_rolling_token_windows(tokens[:n], 7, max_length, 1)
                )
            ]
            assert ours == theirs


def test_a_window_scores_the_same_in_any_batch(tmp_path, monkeypatch):
    """Right padding after a shorter window never changes it (causal attention)."""
    em = load(checkpoint(tmp_path, monkeypatch), device="cpu")
    windows = [
        Window([em.prefix_id, *em.tokenizer.encode(t)], len(t)) for t in ("a", "hello there", "x = 1\n" * 3)
    ]
    windows.append(
        continuation_window(em.tokenizer.encode("def f("), em.tokenizer.encode("x):"), em.max_length)
    )
    one = [score(em, [w])[0] for w in windows]
    for batch in (2, 8):
        for (a, ga), (b, gb) in zip(one, score(em, windows, batch)):
            assert a == pytest.approx(b, abs=1e-5) and ga == gb


def test_a_token_file_gives_the_same_perplexity_without_bits_per_byte(tmp_path, monkeypatch, capsys):
    ckpt = checkpoint(tmp_path, monkeypatch)
    source = write_jsonl(tmp_path / "docs.jsonl")
    assert loom_main(["data", "prepare", "--source", source, "--output", str(tmp_path / "docs.bin")]) == 0
    em = load(ckpt, device="cpu")
    (text,) = perplexity(em, source)
    (tokens,) = perplexity(em, str(tmp_path / "docs.bin"))
    assert (tokens.documents, tokens.tokens, tokens.bytes) == (text.documents, text.tokens, None)
    assert tokens.nll == pytest.approx(text.nll, rel=1e-6) and tokens.bits_per_byte is None
    assert NO_BYTES in tokens.line()
    both = total([text, tokens])
    assert both.tokens == 2 * text.tokens and both.bytes is None
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert (
        loom_main(
            [
                "eval",
                ckpt,
                "--source",
                f"{source}:1,{tmp_path / 'docs.bin'}:1",
                "--device",
                "cpu",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "perplexity" in ln]
    assert len(lines) == 3 and NO_BYTES in lines[1] and lines[2].startswith("loom eval: total:")
    record = json.loads(out.read_text())
    assert [r["bits_per_byte"] is None for r in record["perplexity"]] == [False, True, True]
    assert record["perplexity"][0]["token_perplexity"] == pytest.approx(text.token_perplexity)


def test_limit_and_a_hugging_face_folder(tmp_path, monkeypatch):
    """An exported folder scores as its checkpoint (its prefix: BOS, as lm-eval's HF backend; here set to EOS to
    match the run's), and --limit takes the first documents."""
    ckpt = checkpoint(tmp_path, monkeypatch)
    assert loom_main(["convert", "--from", ckpt, "--to-hf", str(tmp_path / "hf")]) == 0
    source = write_jsonl(tmp_path / "docs.jsonl")
    hf = load(str(tmp_path / "hf"), device="cpu", max_length=32)
    assert hf.prefix_id == hf.tokenizer.bos_id
    hf.prefix_id = hf.tokenizer.eos_id
    (a,) = perplexity(hf, source, limit=2)
    (b,) = perplexity(load(ckpt, device="cpu"), write_jsonl(tmp_path / "two.jsonl", DOCS[:3]))
    assert a.documents == 2 and a.nll == pytest.approx(b.nll, rel=1e-5)


def test_user_errors_are_one_line(tmp_path, monkeypatch, capsys):
    ckpt = checkpoint(tmp_path, monkeypatch)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = [
        (["eval", "--source", "x.jsonl"], "CHECKPOINT: required"),
        (["eval", ckpt], "nothing to evaluate"),
        (
            ["eval", ckpt, "--source", "x.jsonl", "--batch-size", "0"],
            "--batch-size = '0': allowed: 1 or more",
        ),
        (["eval", ckpt, "--source", "x.jsonl", "--limit", "0.5"], "--limit = '0.5'"),
        (["eval", ckpt, "--sorce", "x.jsonl"], "--sorce: unknown option"),
        (["eval", str(tmp_path / "nowhere"), "--source", "x.jsonl"], "folder not found"),
        (["eval", ckpt, "--source", str(tmp_path / "missing.jsonl")], "no such file or folder"),
        (["eval", ckpt, "--source", "x.jsonl", "--dtype", "int8"], "dtype = 'int8': allowed"),
        # issue 49: an empty source is no perplexity (it was NaN with exit 0); a prefix id past the vocabulary
        (["eval", ckpt, "--source", str(empty)], "no document with a token to score"),
        (["eval", ckpt, "--source", str(empty), "--prefix-token-id", "100000"], "--prefix-token-id = 100000"),
        # past the model's context: refused before a RoPE table that long is built (it ran for minutes)
        (
            ["eval", ckpt, "--source", str(empty), "--max-length", "100000000"],
            "--max-length = 100000000: at most",
        ),
        # an option of the other mode does nothing: refused, naming what it needs
        (["eval", ckpt, "--source", "x.jsonl", "--num-fewshot", "3"], "--num-fewshot: applies to --tasks"),
        (["eval", ckpt, "--source", "x.jsonl", "--log-samples"], "--log-samples: applies to --tasks"),
        (["eval", ckpt, "--tasks", "t", "--text-field", "body"], "--text-field: applies to --source"),
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as exit_:
            loom_main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and expected in err and err.count("\n") == 1, (argv, err)
    with pytest.raises(ConfigError, match="allowed: 0"):
        perplexity(load(ckpt, device="cpu"), "", limit=-1)
    assert os.path.isdir(ckpt)
    # --out in a folder that does not exist yet: made (it was a traceback after the evaluation, results lost)
    out = tmp_path / "new" / "dir" / "eval.json"
    source = write_jsonl(tmp_path / "docs.jsonl")
    assert loom_main(["eval", ckpt, "--source", source, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["perplexity"][0]["documents"] == 3
