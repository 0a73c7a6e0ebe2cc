"""The README's test command is what CI runs, and the config reference matches the code."""

from __future__ import annotations

import os
import re

import pytest

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
    assert read("docs", "config.md").strip() == markdown().strip(), (
        "regenerate: python -m loom.config.reference > docs/config.md"
    )


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
    names = ["README.md"] + [
        os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs"))) if n.endswith(".md")
    ]
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


# ---- lists the docs and the program must agree on (one source where the help can be generated) ----


def test_readme_extras_table_lists_every_extra():
    import tomllib

    extras = tomllib.loads(read("pyproject.toml"))["project"]["optional-dependencies"]
    rows = re.findall(r"^\| `([a-z0-9]+)` \|", read("README.md"), re.M)
    assert sorted(rows) == sorted(extras), "README.md's extras table against pyproject.toml"


def test_every_objective_is_documented_and_has_its_class():
    from loom.config.methods import METHODS as OBJECTIVES
    from loom.methods import METHODS

    assert METHODS is OBJECTIVES  # one registry
    row = next(
        ln for ln in read("docs", "finetuning.md").splitlines() if ln.startswith("| `training.objective` |")
    )
    assert re.findall(r"`([a-z_]+)`", row.split("|")[2]) == list(OBJECTIVES), row
    readme = read("README.md")
    for name in list(OBJECTIVES)[1:]:
        assert f"training.objective {name}" in readme, name


def test_convert_help_and_readme_name_every_family():
    pytest.importorskip("torch")
    from loom.cli.convert import usage
    from loom.models.registry import FAMILIES, hf_architectures

    ARCHITECTURES = hf_architectures()
    help_text = " ".join(usage().split())
    assert all(arch in help_text for arch in ARCHITECTURES), help_text
    # every registered family with an architecture of its own is in the list
    assert all(s.hf.architecture in ARCHITECTURES for s in FAMILIES if getattr(s.hf, "architecture", "")), (
        FAMILIES
    )
    hf = next(p for p in read("README.md").split("\n\n") if p.startswith("**Hugging Face.**")).lower()
    spelled = {
        "llama": "llama",
        "mistral": "mistral",
        "qwen2": "qwen2",
        "qwen3": "qwen3",
        "mixtral": "mixtral",
        "deepseek_v3": "deepseek-v3",
        "deepseek_v2": "deepseek-v2",
        "qwen3_moe": "qwen3-moe",
    }
    for family in ARCHITECTURES.values():
        assert spelled.get(family, family.replace("_", "-")) in hf, family


def test_planner_doc_counts_the_search_candidates():
    """docs/planner.md's layout counts of the recipes' searches are what `loom plan --search` enumerates."""
    pytest.importorskip("torch")
    from loom.config import build_config
    from loom.plan.hardware import GPUS
    from loom.plan.planner import candidates

    doc = " ".join(read("docs", "planner.md").split())
    per_node = GPUS["H100"].gpus_per_node
    eight = len(candidates(build_config(os.path.join(ROOT, "recipes", "llama3_8b.toml")), 8, per_node))
    one = len(candidates(build_config(os.path.join(ROOT, "recipes", "llama3_1b.toml")), 1, per_node))
    assert f"({eight} layouts on 8 GPUs;" in doc and f"({one} on one)" in doc
    from loom.config import ConfigError
    from loom.plan.planner import validate

    def valid(cfg):
        try:
            validate(cfg, 8)
            return True
        except ConfigError:
            return False

    layouts = candidates(build_config(os.path.join(ROOT, "recipes", "llama3_8b.toml")), 8, per_node)
    assert f"{sum(map(valid, layouts))} of its {eight} candidates are valid" in doc
