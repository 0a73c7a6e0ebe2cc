"""Every model is built through the registry (loom.models.registry): no module outside loom/models/ constructs a
family's class, so a new family needs no edit elsewhere."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "loom"


def _constructs(path: pathlib.Path, classes: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            name = (
                node.func.id
                if isinstance(node.func, ast.Name)
                else node.func.attr
                if isinstance(node.func, ast.Attribute)
                else None
            )
            if name in classes:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {name}(")
    return found


def test_no_module_outside_models_constructs_a_family():
    pytest.importorskip("torch")
    from loom.models.registry import FAMILIES

    classes = {spec.build.__name__ for spec in FAMILIES}
    assert {"Llama", "DeepSeekV3"} <= classes
    found = [
        hit
        for path in sorted(ROOT.rglob("*.py"))
        if "models" not in path.relative_to(ROOT).parts[:1]
        for hit in _constructs(path, classes)
    ]
    assert found == [], "build through loom.models.registry.build_model: " + ", ".join(found)


def test_register_refuses_a_family_or_flavor_twice():
    pytest.importorskip("torch")
    from loom.models import registry

    llama = registry.FAMILIES[0]
    with pytest.raises(ValueError, match="registered already"):
        registry.register(llama)
