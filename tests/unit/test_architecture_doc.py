"""docs/architecture.md's file map is every module of loom with the first sentence of its docstring: a module added,
moved or re-described without the map following fails here. Regenerate the map with
``python -m tests.unit.test_architecture_doc``."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- file map: begin (python -m tests.unit.test_architecture_doc) -->", "<!-- file map: end -->"


def first_sentence(path: pathlib.Path) -> str:
    """The docstring's first sentence on one line (to the first '. ' after 20 characters; at most 150 characters)."""
    doc = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split())
    cut = re.search(r"(?<=.{20})\. ", doc)
    text = doc[: cut.start() + 1] if cut else doc
    return text if len(text) <= 150 else text[:147].rsplit(" ", 1)[0] + " ..."


def file_map() -> str:
    lines = []
    for path in sorted((ROOT / "loom").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = first_sentence(path)
        if text or path.name != "__init__.py":  # a package marker with nothing to say is left out
            lines.append(f"- `{rel}`: {text or '(no docstring)'}")
    return "\n".join(lines)


def test_every_module_is_in_the_map():
    doc = DOC.read_text()
    mapped = doc[doc.index(BEGIN) + len(BEGIN) : doc.index(END)].strip()
    assert mapped == file_map(), (
        "docs/architecture.md's file map is stale: python -m tests.unit.test_architecture_doc"
    )
    assert "(no docstring)" not in mapped, "a module without a docstring: say what it holds and why"


if __name__ == "__main__":
    text = DOC.read_text()
    text = text[: text.index(BEGIN) + len(BEGIN)] + "\n" + file_map() + "\n" + text[text.index(END) :]
    DOC.write_text(text)
