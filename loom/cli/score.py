"""``loom score``: the reward of prompt/completion pairs under a reward model (a ``training.objective reward`` run's
checkpoint or run dir, or its Hugging Face ``*ForSequenceClassification`` export), read from JSON lines and
written back with a ``score`` field. Scored as training scores a pair (loom.infer.reward.score): a prompt and a
completion that are strings are a user and an assistant message through the model's chat template."""

from __future__ import annotations

import argparse
import json
import os
import sys

from loom.config.errors import ConfigError

USAGE = """usage: loom score --model PATH --file FILE.jsonl [options]

PATH: a reward model: a `training.objective reward` run's checkpoint (step_N) or run dir (its newest complete
checkpoint), or its `loom convert --to-hf` export (a *ForSequenceClassification folder).

FILE (or - for standard input): JSON lines, each one of
  {"prompt": "...", "completion": "..."}        a user message and the assistant's answer (the chat template)
  {"prompt": [messages], "completion": [messages]}   conversations: the prompt's messages, then the completion's
  {"messages": [messages]}                      a whole conversation
  {"text": "..."}                               text as it is (no template)
  {"prompt": ..., "chosen": ..., "rejected": ...}   a preference pair, as `training.objective reward` and dpo read
                                                it (strings, messages, or TRL's implicit prompt: no "prompt"):
                                                both scored, as "score_chosen" and "score_rejected"
other fields are kept.

options:
  --output FILE.jsonl      each row with its "score" (default: standard output)
  --batch-size N           sequences scored together (8)
  --device D               auto | cpu | cuda | cuda:N
  --chat-template FILE     a .jinja chat template for conversations instead of the model's own (a Hugging Face
                           export whose tokenizer folder has none)
  --quiet                  no summary line on stderr
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as every loom command
        raise ConfigError("loom score", None, f"{message} (see `loom score --help`)", show_value=False)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="loom score", add_help=False, allow_abbrev=False)
    p.add_argument("--model", "-m")
    p.add_argument("--file", "-f")
    p.add_argument("--output", "-o")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--chat-template")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("-h", "--help", action="store_true")
    return p


def items_of(row, where: str) -> tuple:
    """What the reward model scores for one row: (a conversation or a string,), or for a preference pair (the
    training pairs' format, loom.data.dpo) (prompt + chosen, prompt + rejected)."""
    if isinstance(row, dict) and "chosen" in row and "rejected" in row:
        from loom.data.dpo import from_row

        try:
            pair = from_row(row, where)
        except ConfigError as err:  # the option's name, not the training field's
            raise ConfigError("--file", where, err.allowed) from None
        return pair.prompt + pair.chosen, pair.prompt + pair.rejected
    return (item_of(row, where),)


def item_of(row, where: str):
    """What the reward model scores for one row: a conversation (a list of messages, checked as training checks
    them) or a string."""
    from loom.cli.generate import checked_conversation

    if not isinstance(row, dict):
        raise ConfigError("--file", where, "not a JSON object")
    if "prompt" in row or "completion" in row:
        p, c = row.get("prompt"), row.get("completion")
        if isinstance(p, str) and isinstance(c, str):
            return [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        if isinstance(p, list) and isinstance(c, list) and all(isinstance(m, dict) for m in p + c):
            return checked_conversation(p + c, where)
        raise ConfigError("--file", where, "'prompt' and 'completion' both strings or both lists of messages")
    if isinstance(row.get("messages"), list):
        return checked_conversation(row["messages"], where)
    if isinstance(row.get("text"), str):
        return row["text"]
    raise ConfigError("--file", where, 'a row needs "prompt" and "completion", "messages" or "text"')


def read_rows(path: str) -> list[tuple[dict, tuple]]:
    """(row, items: ``items_of``) of every non-empty line of ``path`` ('-': stdin)."""
    try:
        if path == "-":
            lines, name = sys.stdin.read().splitlines(), "stdin"
        else:
            with open(path, encoding="utf-8") as fh:
                lines, name = fh.read().splitlines(), path
    except OSError as err:
        raise ConfigError("--file", path, f"not readable ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            "--file", path, f"not UTF-8 text (byte {err.start}): JSON lines are UTF-8"
        ) from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError("--file", f"{name}:{i}", f"not a JSON object ({err.msg})") from None
        except RecursionError:
            raise ConfigError("--file", f"{name}:{i}", "nests JSON too deeply to read") from None
        out.append((row, items_of(row, f"{name}:{i}")))
    if not out:
        raise ConfigError("--file", name, "holds no rows")
    return out


def main(argv: list[str]) -> int:
    opts = parser().parse_args(argv)
    if opts.help:
        print(USAGE)
        return 0
    if not opts.model:
        raise ConfigError(
            "--model",
            None,
            "missing: a reward model's checkpoint, run dir or Hugging Face folder",
            show_value=False,
        )
    if not opts.file:
        raise ConfigError(
            "--file", None, "missing: a .jsonl of rows to score (- for standard input)", show_value=False
        )
    if opts.batch_size < 1:
        raise ConfigError("--batch-size", opts.batch_size, "an integer >= 1")
    if opts.output and os.path.isdir(opts.output):  # before scoring: the scores would be lost at the end
        raise ConfigError("--output", opts.output, "is a folder: give a file path (FILE.jsonl)")
    if opts.output:  # its folder writable or creatable (made at the end), also before scoring
        from loom.config.paths import check_folder_writable

        check_folder_writable("--output", os.path.dirname(os.path.abspath(opts.output)))
    from loom.infer.load import pick_device
    from loom.infer.reward import load_reward_model

    rows = read_rows(opts.file)
    scorer = load_reward_model(opts.model, str(pick_device(opts.device)))
    if opts.chat_template:
        from loom.data.chat import load_template

        if scorer.tokenizer is None:
            raise ConfigError(
                "--chat-template", opts.chat_template, f"{opts.model} has no tokenizer to render with"
            )
        try:
            scorer.template = load_template(opts.chat_template, scorer.tokenizer)
        except ConfigError as err:  # the option's name, not the training field's
            raise ConfigError("--chat-template", opts.chat_template, err.allowed) from None
    flat = scorer([item for _, items in rows for item in items], opts.batch_size)
    scored, pairs, k = [], [], 0
    for row, items in rows:
        if len(items) == 2:  # a preference pair
            c, r = flat[k], flat[k + 1]
            scored.append({**row, "score_chosen": c, "score_rejected": r})
            pairs.append(c > r)
        else:
            scored.append({**row, "score": flat[k]})
        k += len(items)
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in scored)
    scores = [row["score"] for row in scored if "score" in row]
    if opts.output:
        from loom.cli.generate import write_whole

        write_whole("--output", opts.output, lines)
    else:
        sys.stdout.write(lines)
    if not opts.quiet:
        parts = [f"{len(scored)} row{'s' if len(scored) != 1 else ''}"]
        if scores:
            parts.append(f"mean score {sum(scores) / len(scores):.4f}")
        if pairs:
            parts.append(
                f"{len(pairs)} pair{'s' if len(pairs) != 1 else ''}, chosen above rejected in "
                f"{sum(pairs) / len(pairs):.1%}"
            )
        print(
            f"loom score: {', '.join(parts)}" + (f" -> {opts.output}" if opts.output else ""), file=sys.stderr
        )
    return 0
