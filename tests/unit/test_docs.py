"""The README's test command is what CI runs, and the config reference matches the code."""

from __future__ import annotations

import os
import re

from loom.config.reference import markdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(*parts):
    with open(os.path.join(ROOT, *parts)) as fh:
        return fh.read()


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)```", read("README.md"), re.S)
    test_cmd = next(b.strip() for b in blocks if "pytest" in b)
    assert test_cmd in read(".ci", "run")


def test_config_reference_is_current():
    assert read("docs", "config.md").strip() == markdown().strip(), \
        "regenerate: python -m loom.config.reference > docs/config.md"


def _strip_comments(text, name):
    """The text with every HTML comment removed; fails on an unopened `-->` or an unclosed `<!--`."""
    out, pos = [], 0
    while True:
        op, cl = text.find("<!--", pos), text.find("-->", pos)
        if op < 0:
            assert cl < 0, f"{name}: '-->' at offset {cl} closes no comment"
            out.append(text[pos:])
            return "".join(out)
        assert cl < 0 or cl > op, f"{name}: '-->' at offset {cl} closes no comment"
        assert cl > op, f"{name}: '<!--' at offset {op} is never closed"
        out.append(text[pos:op])
        pos = cl + 3


def test_markdown_html_comments_are_balanced():
    names = ["README.md"] + [os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                             if n.endswith(".md")]
    for name in names:
        _strip_comments(read(name), name)


def test_readme_first_screen_is_title_intro_then_two_commands():
    """Rendered, the README opens with its title, one intro paragraph and then the "Two commands" section."""
    text = _strip_comments(read("README.md"), "README.md")
    head = text.split("\n## ", 1)[0]
    lines = [ln for ln in head.splitlines() if ln.strip()]
    assert lines[0] == "# loom"
    assert not any(ln.lstrip().startswith(("#", "<", "-->")) for ln in lines[1:]), head
    assert text.split("\n## ", 2)[1].startswith("Two commands\n")
