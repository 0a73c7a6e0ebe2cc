"""``loom data prepare``: tokenize one source into a memory-mapped token file, ahead of training."""

from __future__ import annotations

import os
import sys
import time

from loom.config.errors import ConfigError
from loom.config.paths import check_file_writable
from loom.data.chat import ChatEncoder, load_template
from loom.data.prepare import tokenize_to_file
from loom.data.sources import SourceSpec, parse_source
from loom.data.tokenizers import build_tokenizer

USAGE = """usage: loom data prepare --source SPEC --output PATH.bin [--tokenizer byte|PATH] [--text-field NAME]
                         [--encoding-errors strict|replace] [--objective lm|sft] [--chat-template PATH]
                         [--loss-tokens assistant|all]

Tokenizes one source into PATH.bin (token ids, EOS after every document) and PATH.bin.json (its
description). Train on it with --data.source PATH.bin and the same --data.tokenizer.

options:
  --source SPEC       one entry of the data.source grammar (no mixture, no weight): a text file or a
                      glob of them (one document per file), a .jsonl / .jsonl.gz, a .parquet, a folder
                      written by datasets' save_to_disk, or a token file; '' = the embedded default
                      (this Python's standard-library sources)
  --output PATH.bin   where to write the token file (required)
  --tokenizer SPEC    'byte' (built in, the default) or a path to a Hugging Face tokenizer.json
  --text-field NAME   field holding the text in jsonl / parquet / datasets (default: text)
  --encoding-errors   text that is not valid UTF-8: 'strict' (the default) stops naming the file and
                      byte offset, 'replace' decodes it with U+FFFD replacement characters
  --objective         'lm' (the default): documents of text; 'sft': conversations ('messages', or
                      'prompt' and 'completion'; '' = the standard library's docstrings) rendered with
                      the chat template, with a loss mask (PATH.bin.mask); train with --training.objective sft
  --chat-template     sft: a Jinja chat template file; default: the tokenizer folder's (built in for byte)
  --loss-tokens       sft: 'assistant' (the default) = the assistant's turns take loss, 'all' = every token
  -h, --help          show this message"""

OPTIONS = {
    "--source": "source",
    "--output": "output",
    "-o": "output",
    "--tokenizer": "tokenizer",
    "--text-field": "text_field",
    "--encoding-errors": "encoding_errors",
    "--objective": "objective",
    "--chat-template": "chat_template",
    "--loss-tokens": "loss_tokens",
}
ENCODING_ERRORS = ("strict", "replace")
PREPARED_OBJECTIVES = ("lm", "sft")  # the objectives whose data a token file can hold

# The library names config fields; on this command line the same things are options.
CLI_NAMES = {
    "data.source": "--source",
    "data.text_field": "--text-field",
    "data.tokenizer": "--tokenizer",
    "data.encoding_errors": "--encoding-errors",
    "data.chat_template": "--chat-template",
    "data.loss_tokens": "--loss-tokens",
}


def parse_args(argv: list[str]) -> dict[str, str]:
    """``--name value`` / ``--name=value`` pairs; anything else is a user error."""
    args = {"tokenizer": "byte", "text_field": "text", "encoding_errors": "strict"}
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name not in OPTIONS:
            raise ConfigError(
                argv[i],
                None,
                f"unknown option; allowed: {', '.join(sorted(set(OPTIONS)))} "
                "(see `loom data prepare --help`)",
                show_value=False,
            )
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(name, None, "missing value after the option", show_value=False)
            value, i = argv[i + 1], i + 1
        args[OPTIONS[name]] = value
        i += 1
    for required in ("source", "output"):
        if required not in args:
            raise ConfigError(
                f"--{required}", None, "required (see `loom data prepare --help`)", show_value=False
            )
    if not args["output"].endswith(".bin"):
        raise ConfigError("--output", args["output"], "a token file path must end in .bin")
    if args["encoding_errors"] not in ENCODING_ERRORS:
        raise ConfigError(
            "--encoding-errors", args["encoding_errors"], "allowed: " + " | ".join(ENCODING_ERRORS)
        )
    if args.get("objective", "lm") not in PREPARED_OBJECTIVES:
        raise ConfigError("--objective", args["objective"], "allowed: " + " | ".join(PREPARED_OBJECTIVES))
    for sft_only in ("chat_template", "loss_tokens"):
        if sft_only in args and args.get("objective") != "sft":
            raise ConfigError(f"--{sft_only.replace('_', '-')}", args[sft_only], "needs --objective sft")
    return args


def single_source(source: str, text_field: str, encoding_errors: str = "strict") -> SourceSpec:
    """The one source to tokenize: the data.source grammar without mixtures or weights."""
    specs = parse_source(source, text_field, encoding_errors)
    if len(specs) != 1 or specs[0].weight != 1.0:
        raise ConfigError(
            "--source",
            source,
            "one source without a weight; mix prepared token files "
            "in training with --data.source 'a.bin:0.7,b.bin:0.3'",
        )
    return specs[0]


class ProgressLine:
    """One self-rewriting stderr line (documents, tokens, tokens/s); redrawn at most every ``every`` s."""

    def __init__(self, stream=None, every: float = 0.2):
        self.stream = stream or sys.stderr
        self.every, self.t0, self.last, self.width = every, time.monotonic(), float("-inf"), 0

    def __call__(self, docs: int, tokens: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._draw(docs, tokens, now)

    def _draw(self, docs: int, tokens: int, now: float) -> None:
        rate = tokens / max(now - self.t0, 1e-6)
        line = f"tokenizing: {docs:,} documents | {tokens:,} tokens | {rate:,.0f} tokens/s"
        self.stream.write("\r" + line.ljust(self.width))  # pad: a shorter line must cover the last one
        self.stream.flush()
        self.width = len(line)

    def finish(self, docs: int, tokens: int) -> float:
        """Draw the final counts, end the line; returns the seconds spent."""
        now = time.monotonic()
        self._draw(docs, tokens, now)
        self.end_line()
        return now - self.t0

    def end_line(self) -> None:
        """Leave the line, so that what is printed next (a summary, an error) starts on its own."""
        if self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0


def _cli_error(err: ConfigError) -> ConfigError:
    """The same error, naming the option the user typed instead of the config field."""
    if err.field not in CLI_NAMES:
        return err
    allowed = err.allowed.replace(f"--{err.field} ", f"{CLI_NAMES[err.field]} ")  # a hint naming the option
    return ConfigError(CLI_NAMES[err.field], err.value, allowed)


def prepare(args: dict[str, str]) -> int:
    check_file_writable("--output", args["output"], "data.bin")  # before any tokenizing
    progress = ProgressLine()
    try:
        tokenizer = build_tokenizer(args["tokenizer"])
        spec = single_source(args["source"], args["text_field"], args["encoding_errors"])
        sft = None
        if args.get("objective") == "sft":
            sft = ChatEncoder(
                load_template(args.get("chat_template", ""), tokenizer),
                tokenizer,
                args.get("loss_tokens", "assistant"),
            )
        meta = tokenize_to_file(spec, tokenizer, args["output"], progress=progress, sft=sft)
    except ConfigError as err:
        progress.end_line()
        raise _cli_error(err) from None
    except BaseException:  # UserError, Ctrl-C: the message must not land on the progress line
        progress.end_line()
        raise
    seconds = progress.finish(meta.documents, meta.tokens)
    size = os.path.getsize(args["output"])
    what = f"{meta.documents:,} conversations" if meta.mask else f"{meta.documents:,} documents"
    trained = f", {meta.trained_tokens:,} take loss" if meta.mask else ""
    print(
        f"wrote {args['output']}: {what}, {meta.tokens:,} tokens{trained} ({meta.dtype}, "
        f"{size / 2**20:.1f} MiB, tokenizer {meta.tokenizer}) in {seconds:.1f}s"
    )
    return 0


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    return prepare(parse_args(argv))
