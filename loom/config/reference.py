"""The config reference, generated from the dataclass sections (one source of truth): docs/config.md and
``loom train --help [SECTION]`` both read the rows built here.

    python -m loom.config.reference > docs/config.md
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap

from loom.config.errors import ConfigError
from loom.config.load import toml_value
from loom.config.methods import METHODS
from loom.config.sections import all_sections, section_names

# one line per section, for the overview in `loom train --help` and the headings of docs/config.md
SECTION_HELP = {
    "run": "the run directory (resolved config, metrics, checkpoints), seed, determinism, device",
    "model": "model shape (flavor, layers, vocabulary, mixture of experts), initial weights, kernels",
    "data": "training text or token files, tokenizer, validation split, tokenization cache",
    "training": "steps, sequence length, batch sizes, precision, compile, activation checkpointing, validation",
    "optimizer": "AdamW, learning rate and its schedule, weight decay",
    "parallel": "parallel degrees (data, FSDP, tensor, pipeline, context, expert) and their options",
    "checkpoint": "periodic saves, resume, retention, preemption",
    "metrics": "logging interval, TensorBoard, W&B, MLflow, progress bar, profiling",
    "dpo": "direct preference optimization (training.objective dpo): beta, loss, where the reference comes from",
    "grpo": "GRPO (training.objective grpo): groups, sampling, clipping, KL, loss normalization, rewards, warm-up",
    "ppo": "PPO (training.objective ppo): KL penalty, GAE, clipped policy and value losses, whitening, epochs, "
    "mini-batches, a reward model (rollouts from [grpo])",
    "lora": "LoRA / QLoRA fine-tuning: adapter rank and scaling, targets, NF4 base, a PEFT adapter to start from",
    "reward": "reward model (training.objective reward): the Bradley-Terry loss's centring term",
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One field as the reference shows it: dotted key, default as written in TOML, allowed values, meaning."""

    key: str
    default: str
    allowed: str
    meaning: str


def section_help(section: str) -> str:
    """The section's one-line description: SECTION_HELP's, else (a method's own section) whose settings it holds
    and where they are declared (read from the registry: listing the sections imports no method)."""
    if section in SECTION_HELP:
        return SECTION_HELP[section]
    owners = [name for name, (_, sections) in METHODS.items() if section in sections]
    if not owners:
        return ""
    return f"the settings of training.objective {' / '.join(owners)} (declared in {METHODS[owners[0]][0]})"


def allowed(meta, sep: str = " | ", quote: str = "") -> str:
    """What a field accepts, from its ``choices`` / ``min`` / ``max`` metadata ('' where anything of its type)."""
    if "choices" in meta:
        return sep.join(f"{quote}{c}{quote}" for c in meta["choices"])
    parts = []
    if "min" in meta:
        parts.append(f"{'>' if meta.get('min_exclusive') else '>='} {meta['min']}")
    if "max" in meta:
        parts.append(f"<= {meta['max']}")
    return ", ".join(parts)


def rows(section: str, sep: str = " | ", quote: str = "") -> list[Row]:
    """The section's fields in declaration order; ``sep`` / ``quote`` format the allowed choices."""
    out = []
    for f in dataclasses.fields(all_sections()[section]):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(
            Row(
                f"{section}.{f.name}",
                toml_value(default),
                allowed(f.metadata, sep, quote),
                f.metadata.get("help", ""),
            )
        )
    return out


def markdown() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `loom/config/sections.py` by `python -m loom.config.reference`. Precedence: "
        "defaults < TOML file (`--config`) < command line (`--section.field value` or `--section.field=value`). "
        "The resolved config is written to `<run.dir>/config.toml` and into every checkpoint. Defaults are "
        "written as in a TOML file. On the command line: `loom train --help` lists the sections, "
        "`loom train --help SECTION` prints one, `loom train ... --print-config` prints the resolved config.",
        "",
    ]
    for section in all_sections():
        lines += [f"## `[{section}]`", ""]
        about = section_help(section)
        if about:
            lines += [about[0].upper() + about[1:] + ".", ""]
        lines += ["| key | default | allowed | meaning |", "|---|---|---|---|"]
        for r in rows(section, sep=" \\| ", quote="`"):
            lines.append(f"| `{r.key}` | `{r.default}` | {r.allowed} | {r.meaning} |")
        lines.append("")
    return "\n".join(lines)


def sections_text() -> str:
    """`loom train --help`'s list of sections: name and description, one line each."""
    sections = section_names()
    width = max(map(len, sections))
    lines = ["config sections (`loom train --help SECTION` lists one's fields; all of them: docs/config.md):"]
    lines += [f"  {name:<{width}}  {section_help(name)}" for name in sections]
    return "\n".join(lines)


def section_text(section: str, width: int = 100) -> str:
    """`loom train --help SECTION`: every field with its default, allowed values and meaning."""
    if section not in all_sections():
        raise unknown_section(section)
    lines = [
        f"[{section}]  {section_help(section)}".rstrip(),
        f"key = default (allowed values); set one with --{section}.FIELD VALUE or in a TOML file's [{section}] "
        "table (docs/config.md)",
    ]
    for r in rows(section):
        lines += ["", f"  {r.key} = {r.default}" + (f"  ({r.allowed})" if r.allowed else "")]
        lines += textwrap.wrap(r.meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def unknown_section(section: str) -> ConfigError:
    """One line: the nearest section name (difflib), or the list of them."""
    sections = list(all_sections())
    near = difflib.get_close_matches(section.lower(), sections, n=1, cutoff=0.5)
    hint = f"did you mean '{near[0]}'?" if near else f"sections are {', '.join(sections)}"
    return ConfigError("--help", section, f"unknown config section; {hint} (`loom train --help` lists them)")


if __name__ == "__main__":
    print(markdown())
