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
