"""The ``loom`` command: ``train``, ``plan``, ``convert``, ``eval``, ``report``, ``data prepare``."""

from __future__ import annotations

import difflib
import sys

from loom.cli.errors import user_errors_exit
from loom.config.errors import UserError

USAGE = """usage: loom <command> [options]
       loom --version

commands:
  train          train a model (see `loom train --help`)
  launch         start one job on many machines: hostfile (ssh), SLURM, Kubernetes, Ray (`loom launch --help`)
  plan           memory and speed of a config on N GPUs, best layouts (`loom plan --help`; no GPU needed)
  convert        import a Hugging Face folder (Llama, Mistral, Qwen, Mixtral) / export a loom checkpoint
  generate       completions of prompts from a checkpoint or Hugging Face folder (`loom generate --help`)
  score          rewards of prompt/completion pairs from a reward model (`loom score --help`)
  eval           perplexity / bits per byte on a data source, lm-evaluation-harness tasks (`loom eval --help`)
  report         plots + HTML page of runs' metrics.jsonl (`loom report --help`)
  data prepare   tokenize a source into a memory-mapped token file (`loom data prepare --help`)
  doctor         check and explain the environment a job would run in (`loom doctor --help`)
"""


@user_errors_exit
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(version_line())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "train":
        from loom.cli.train import main as train_main

        return train_main(rest)
    if cmd == "launch":
        from loom.cli.launch import main as launch_main

        return launch_main(rest)
    if cmd == "plan":
        from loom.cli.plan import main as plan_main

        return plan_main(rest)
    if cmd == "convert":
        from loom.cli.convert import main as convert_main

        return convert_main(rest)
    if cmd == "eval":
        from loom.cli.eval import main as eval_main

        return eval_main(rest)
    if cmd == "generate":
        from loom.cli.generate import main as generate_main

        return generate_main(rest)
    if cmd == "score":
        from loom.cli.score import main as score_main

        return score_main(rest)
    if cmd == "report":
        from loom.cli.report import main as report_main

        return report_main(rest)
    if cmd == "doctor":
        from loom.cli.doctor import main as doctor_main

        return doctor_main(rest)
    if cmd == "data" and rest[:1] == ["prepare"]:
        from loom.cli.data import main as data_main

        return data_main(rest[1:])
    raise unknown_command(argv)


def version_line() -> str:
    """``loom <version> (torch <version>, Python <version>)``: what a bug report needs first."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from loom import version as loom_version

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"loom {loom_version()} (torch {torch}, Python {platform.python_version()})"


COMMANDS = (
    "train",
    "launch",
    "plan",
    "convert",
    "generate",
    "score",
    "eval",
    "report",
    "data prepare",
    "doctor",
)


def unknown_command(argv: list[str]) -> UserError:
    """One line: what was typed, the nearest command (difflib) or the list of them."""
    typed = argv[0]
    if typed == "data" and argv[1:2] and not argv[1].startswith("-"):
        typed = f"data {argv[1]}"
    near = difflib.get_close_matches(typed, COMMANDS, n=1, cutoff=0.5)
    if not near and argv[0] == "data":
        near = ["data prepare"]
    hint = f"did you mean 'loom {near[0]}'?" if near else f"commands are {', '.join(COMMANDS)}"
    return UserError(f"unknown command {typed!r}; {hint} (see `loom --help`)")


def entry() -> None:
    sys.exit(main())
