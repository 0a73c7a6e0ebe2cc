"""The config reference in docs/config.md, generated from the dataclass sections (one source of truth).

    python -m loom.config.reference > docs/config.md
"""

from __future__ import annotations

import dataclasses

from loom.config.sections import SECTIONS


def _allowed(meta) -> str:
    if "choices" in meta:
        return " \\| ".join(f"`{c}`" for c in meta["choices"])
    parts = []
    if "min" in meta:
        parts.append(f"{'>' if meta.get('min_exclusive') else '>='} {meta['min']}")
    if "max" in meta:
        parts.append(f"<= {meta['max']}")
    return ", ".join(parts)


def markdown() -> str:
    lines = ["# Configuration reference", "",
             "Generated from `loom/config/sections.py` by `python -m loom.config.reference`. Precedence: "
             "defaults < TOML file (`--config`) < command line (`--section.field value` or `--section.field=value`). "
             "The resolved config is written to `<run.dir>/config.toml` and into every checkpoint.", ""]
    for section, cls in SECTIONS.items():
        lines += [f"## `[{section}]`", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"| `{section}.{f.name}` | `{default!r}` | {_allowed(f.metadata)} | "
                         f"{f.metadata.get('help', '')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
