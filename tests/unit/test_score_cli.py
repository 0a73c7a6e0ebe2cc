"""``loom score``: the rows of a .jsonl come back with the scores the reward model's API gives for the same items
(prompt/completion strings as a user and an assistant message, conversations, plain text), from a run's checkpoint
and from its Hugging Face export (with the run's chat template given) alike; a bad row or a missing option is one line and exit 2."""

from __future__ import annotations

import json

import pytest

from loom.cli.main import main as loom_main
from loom.data.chat import BUILTIN_TEMPLATE
from loom.infer.reward import score
from tests.unit.test_reward import exported  # noqa: F401  (the module fixture: a reward run and its HF export)

ROWS = [
    {"prompt": "The cat sat.", "completion": "On a warm mat.", "id": 1},
    {
        "prompt": [{"role": "user", "content": "Say hi."}],
        "completion": [{"role": "assistant", "content": "Hi."}],
    },
    {"messages": [{"role": "user", "content": "Two dogs?"}, {"role": "assistant", "content": "Ran past."}]},
    {"text": "One bird sang."},
]
ITEMS = [
    [{"role": "user", "content": "The cat sat."}, {"role": "assistant", "content": "On a warm mat."}],
    ROWS[1]["prompt"] + ROWS[1]["completion"],
    ROWS[2]["messages"],
    "One bird sang.",
]


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = loom_main(["score", *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_scores_equal_the_api(exported, tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    expected = score(exported["ckpt"], ITEMS)
    code, out, err = run(capsys, "--model", exported["ckpt"], "--file", str(path), "--device", "cpu")
    assert code == 0 and "4 rows, mean score" in err
    got = [json.loads(line) for line in out.splitlines()]
    assert [{k: v for k, v in g.items() if k != "score"} for g in got] == ROWS  # the other fields are kept
    assert [g["score"] for g in got] == pytest.approx(expected, abs=1e-6)
    assert len(set(expected)) == 4  # the items differ, so do their scores
    template = tmp_path / "byte.jinja"  # the export's tokenizer folder has no chat template: the run's, given
    template.write_text(BUILTIN_TEMPLATE)
    code, _, err = run(
        capsys,
        "--model",
        exported["hf"],
        "--file",
        str(path),
        "--output",
        str(tmp_path / "o.jsonl"),
        "--chat-template",
        str(template),
        "--quiet",
        "--device",
        "cpu",
    )
    assert code == 0 and not err, err
    hf = [json.loads(line)["score"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert hf == pytest.approx(expected, abs=1e-4)  # the export scores alike


def test_the_training_pairs_format_scores_both_completions(exported, tmp_path, capsys):
    """A reward model's own training rows (prompt / chosen / rejected: strings, messages, or TRL's implicit prompt)
    come back with score_chosen and score_rejected, each the API's score of the prompt with that completion; the
    summary gives the share of pairs ranked right. The export carries the run's chat template: no option needed."""
    conv = [{"role": "user", "content": "Say hi."}]
    pairs = [
        {"prompt": "The cat sat.", "chosen": "On a warm mat.", "rejected": "Ran past.", "id": 7},
        {
            "prompt": conv,
            "chosen": [{"role": "assistant", "content": "Hi."}],
            "rejected": [{"role": "assistant", "content": "No."}],
        },
        {
            "chosen": conv + [{"role": "assistant", "content": "Hi."}],
            "rejected": conv + [{"role": "assistant", "content": "No."}],
        },
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    user = {"role": "user", "content": "The cat sat."}
    items = [
        [user, {"role": "assistant", "content": "On a warm mat."}],
        [user, {"role": "assistant", "content": "Ran past."}],
        pairs[2]["chosen"],
        pairs[2]["rejected"],
    ]
    expected = score(exported["ckpt"], items)
    for model in (exported["ckpt"], exported["hf"]):
        code, out, err = run(capsys, "--model", model, "--file", str(path), "--device", "cpu")
        assert code == 0 and "3 rows, 3 pairs, chosen above rejected in" in err, err
        got = [json.loads(line) for line in out.splitlines()]
        assert [{k: v for k, v in g.items() if not k.startswith("score_")} for g in got] == pairs
        flat = [x for g in got for x in (g["score_chosen"], g["score_rejected"])]
        assert flat[:2] + flat[4:] == pytest.approx(expected, abs=1e-4)
        assert flat[2:4] == pytest.approx(flat[4:], abs=1e-6)  # implicit prompt = the explicit messages


def test_mistakes_are_one_line(exported, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"prompt": "only a prompt"}) + "\n")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "fine"}) + "\n")
    for argv, needle in (
        (["--model", exported["ckpt"], "--file", str(bad)], f"{bad}:2"),
        (["--file", str(bad)], "--model"),
        (["--model", exported["ckpt"]], "--file"),
        (["--model", exported["ckpt"], "--file", str(tmp_path / "none.jsonl")], "not readable"),
        (["--model", exported["ckpt"], "--file", str(bad), "--batch-size", "0"], "--batch-size"),
        (["--model", exported["hf"], "--file", str(good), "--chat-template", "no.jinja"], "--chat-template"),
    ):
        code, out, err = run(capsys, *argv)
        assert code == 2 and needle in err and err.count("\n") == 1 and not out, (argv, err)


def test_issue_49_refusals(exported, tmp_path, capsys):
    """A non-UTF-8 file, --output a folder (before scoring), a text past the model's length: one line each; a
    reward model given to `loom generate` or `loom eval` says to use `loom score`."""
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "caf\xe9"}\n')
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "fine"}) + "\n")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"text": "x" * 5000}) + "\n")
    number = tmp_path / "number.jsonl"
    number.write_text(json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n")
    for argv, needle in (
        (
            ["--model", exported["ckpt"], "--file", str(number)],
            "'content' must be a string or a list of text parts",
        ),
        (["--model", exported["ckpt"], "--file", str(latin)], "not UTF-8"),
        (["--model", exported["ckpt"], "--file", str(good), "--output", str(tmp_path)], "is a folder"),
        (["--model", exported["ckpt"], "--file", str(good), "--output", str(good / "x.jsonl")], "is a file"),
        (["--model", exported["ckpt"], "--file", str(long)], "longer than the model's"),
    ):
        code, out, err = run(capsys, *argv)
        assert code == 2 and needle in err and err.count("\n") == 1 and not out, (argv, err)
    for command in (
        ["generate", "--model", exported["hf"], "hi"],
        ["eval", exported["ckpt"], "--source", str(good)],
    ):
        with pytest.raises(SystemExit) as exit_:
            loom_main(command)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "this is a reward model" in err and "loom score" in err, (
            command,
            err,
        )
    from loom.config.errors import ConfigError
    from loom.config.sections import GrpoConfig
    from loom.rl.judge import Judge

    with pytest.raises(
        ConfigError, match="grpo.judge = .*this is a reward model"
    ):  # before training, not at step N
        Judge(GrpoConfig(judge=exported["hf"], judge_template="{prompt} {completion}"))
