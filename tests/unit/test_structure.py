"""How the training code is joined, read from the sources with ``ast``: the engine and the loop never probe an
objective with getattr / hasattr (the Objective base class declares every hook they call); nothing outside the
engine's own module reads a private attribute of the engine (or of a trainer); and the names of
``training.objective`` are compared only in loom.methods, where the registry maps each to its method."""

from __future__ import annotations

import ast
import pathlib

import pytest

from loom.config.methods import METHODS as OBJECTIVES

ROOT = pathlib.Path(__file__).resolve().parents[2] / "loom"
SOURCES = {
    str(p.relative_to(ROOT.parent)): ast.parse(p.read_text(), str(p)) for p in sorted(ROOT.rglob("*.py"))
}

# modules that read a finished run's recorded config (or a command's own option), below or beside the registry;
# each compares one name for a reason of its own
NAME_COMPARED = {
    "loom/config/load.py": "data.document_positions defaults to true under sft, before any method is chosen",
    "loom/infer/load.py": "refuses to generate from a finished reward-model run (infer sits below loom.methods)",
    "loom/infer/reward.py": "loads only a finished reward-model run as a scorer (infer sits below loom.methods)",
    "loom/cli/convert.py": "exports a finished reward-model run with its score head",
    "loom/cli/data.py": "`loom data prepare --objective lm|sft`: the command's own option, naming a token file's kind",
}


def _mentions(node: ast.AST, word: str) -> bool:
    """Whether ``node`` is a name or attribute chain whose last part contains ``word``."""
    if isinstance(node, ast.Name):
        return word in node.id
    if isinstance(node, ast.Attribute):
        return word in node.attr
    return False


def _is_engine(node: ast.AST) -> bool:
    """``engine``, ``trainer`` or ``<anything>.engine``: the engine (or the loop over it) seen from outside."""
    return (isinstance(node, ast.Name) and node.id in ("engine", "trainer")) or (
        isinstance(node, ast.Attribute) and node.attr == "engine"
    )


def _names(node: ast.AST) -> set[str]:
    """The string constants of ``node`` (a constant, or a tuple / list / set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names(e) for e in node.elts)) if node.elts else set()
    return set()


@pytest.mark.parametrize(
    "path", ["loom/train/engine.py", "loom/train/loop.py", "loom/train/trainer.py", "loom/train/steps.py"]
)
def test_no_getattr_probes_of_objectives(path):
    probes = [
        f"{path}:{n.lineno}"
        for n in ast.walk(SOURCES[path])
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("getattr", "hasattr")
        and n.args
        and _mentions(n.args[0], "objective")
    ]
    assert not probes, f"getattr / hasattr on an objective (declare the hook in Objective instead): {probes}"


def test_nothing_reads_a_private_attribute_of_the_engine():
    found = [
        f"{path}:{n.lineno} {ast.unparse(n)}"
        for path, tree in SOURCES.items()
        if not path.startswith("loom/train/engine")
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
        and _is_engine(n.value)
    ]
    assert not found, f"private attributes of the engine read from outside it: {found}"


def test_objective_names_are_compared_only_in_the_methods():
    found = []
    for path, tree in SOURCES.items():
        if path.startswith("loom/methods/") or path in NAME_COMPARED:
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Compare):
                sides = [n.left, *n.comparators]
                if any(_names(s) & set(OBJECTIVES) for s in sides) and any(
                    _mentions(s, "objective") for s in sides
                ):
                    found.append(f"{path}:{n.lineno} {ast.unparse(n)}")
    assert not found, (
        f"training.objective compared outside loom.methods (add the method's hook instead): {found}"
    )


def test_the_checks_see_what_they_look_for():
    """Each check finds its pattern in a snippet that has it (so an empty result above means something)."""
    probe = ast.parse("getattr(self.objective, 'prepare', None)").body[0].value
    assert probe.func.id == "getattr" and _mentions(probe.args[0], "objective")
    private = ast.parse("trainer._autocast()").body[0].value.func
    assert private.attr.startswith("_") and _is_engine(private.value)
    compare = ast.parse("cfg.training.objective in ('grpo', 'ppo')").body[0].value
    assert _names(compare.comparators[0]) & set(OBJECTIVES) and _mentions(compare.left, "objective")


@pytest.mark.parametrize("path", ["loom/train/engine.py", "loom/train/loop.py"])
def test_optional_features_join_through_the_hook_list(path):
    """DiLoCo, torchft, the noise-scale probe, MoE statistics, stragglers and preemption are step hooks
    (loom.train.hooks): the engine and the loop hold no attribute of their own for any of them."""
    features = {"diloco", "ft", "moe", "noise", "stragglers", "preemption", "stop_vote"}
    found = [
        f"{path}:{n.lineno} {ast.unparse(n)}"
        for n in ast.walk(SOURCES[path])
        if isinstance(n, ast.Attribute)
        and n.attr in features
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
    ]
    assert not found, found


def test_the_loop_names_no_runtime_feature_that_is_a_hook():
    """Stragglers and preemption join the loop only through the hook list: loop.py imports neither feature."""
    tree = SOURCES["loom/train/loop.py"]
    imported = {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module in ("loom.runtime.stragglers", "loom.runtime.guard")
        for a in n.names
    }
    assert not imported & {"Stragglers", "Preemption", "StopVote", "PREEMPTED"}, imported


def test_rl_rollouts_are_driven_not_loaders():
    """GRPO's and PPO's drivers (loom.methods.grpo / ppo ``drive``) call the rollouts' pieces and the engine: no
    module of loom.rl hands batches out as a loader (``next_step``) or sets the LR (``scale_lr``)."""
    found = [
        f"{path}:{n.lineno} {n.name if isinstance(n, ast.FunctionDef) else ast.unparse(n)}"
        for path, tree in SOURCES.items()
        if path.startswith("loom/rl/")
        for n in ast.walk(tree)
        if (isinstance(n, ast.FunctionDef) and n.name == "next_step")
        or (isinstance(n, ast.Attribute) and n.attr == "scale_lr")
    ]
    assert not found, found
    drivers = [
        n.name
        for path in ("loom/methods/grpo.py", "loom/methods/ppo.py")
        for n in SOURCES[path].body
        if isinstance(n, ast.FunctionDef) and n.name == "drive"
    ]
    assert drivers == ["drive", "drive"]
