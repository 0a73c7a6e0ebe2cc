"""loom's packages form layers that import only downwards (docs/extending.md): every import of every module,
at module level or inside a function, is checked, and so is the absence of import cycles between modules."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "loom"

# lowest first; a module may import from its own layer and the layers below it
LAYERS = [
    # what everything reads: config sections and errors, metric logging, dtypes by name
    {"config", "metrics", "numerics"},
    # sources, tokenizers and the loader: plain Python and tensors, no model
    {"data"},
    # kernels and their references: below the models that call them
    {"kernels"},
    # plain single-device models: no mesh, no process group
    {"models"},
    # transforms applied to a built model with a mesh (dims, tp, cp, ep, pp, data parallel, compile, init of shards)
    {"parallel"},
    # DCP and Hugging Face checkpoints of (possibly sharded) models
    {"checkpoint"},
    # the running job (process env and rendezvous, hangs, fault tolerance, restarts, stragglers, preemption, the
    # run dir's lock, the elastic launch): it reads only the config, so the resolver (fault tolerance's replica
    # groups) and the trainer build on it; the layout checks a launch needs are the CLI's preflight (loom.cli)
    {"runtime"},
    # the trainer runs evaluations (loom.eval.hook); eval reads run checkpoints (loom.train.run_dir) and generates
    # through loom.infer, which reads run checkpoints the same way; the resolver runs the rule sets of features whose
    # home is loom.train (loom.train.diloco_rules, zero_rules)
    {"resolve", "train", "eval", "infer"},
    # reinforcement learning: an objective (loom.train) whose rollouts come from the engine (loom.infer)
    {"rl"},
    # training methods, one module each (lm, sft, dpo, reward, grpo, ppo): objective, data, heads, rules, run
    {"methods"},
    # the planner and the cluster tooling around a job (doctor, multi-host launchers, NCCL variables, comm bench):
    # tools beside training that read layouts, the resolver (with a method's rules) and the runtime's environment
    {"plan", "cluster"},
    # the commands: each parses argv and calls the layers below
    {"cli", "__main__"},
]
# (importing module, imported module): the only imports allowed upwards, each with its reason
ALLOWED_UP = {
    # ``torchrun -m loom.train`` is the documented worker entry point; it runs the CLI's worker body, which runs
    # the method the config names (loom.methods)
    ("loom.train.__main__", "loom.cli.errors"),
    ("loom.train.__main__", "loom.cli.train"),
    # ``Trainer(cfg)`` (tests, examples, bench) keeps meaning "the job the config names": it asks the registry
    # which method's objective and rules that is
    ("loom.train.trainer", "loom.methods"),
}


def _layer_of(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else module
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: its package {top!r} has no layer in LAYERS (add it where it belongs)")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The loom modules ``name`` imports anywhere in its body (``from x import y`` counts x.y when it is a module)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("loom"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("loom"):
                continue
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found.update(subs or [base])
    return {m for m in found if m != name}


MODULES = _modules()
GRAPH = {name: _imports(name, path, set(MODULES)) for name, path in MODULES.items()}


def test_every_package_has_a_layer():
    for name in MODULES:
        if name != "loom":
            _layer_of(name)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n != "loom"))
def test_imports_go_only_downwards(name):
    upward = sorted(
        m
        for m in GRAPH[name]
        if m != "loom" and _layer_of(m) > _layer_of(name) and (name, m) not in ALLOWED_UP
    )
    assert not upward, f"{name} imports from a higher layer: {upward}"


def test_no_import_cycles():
    """Between modules (a package's __init__ re-exporting its own modules is not a cycle)."""

    def edges(name):
        return {
            m
            for m in GRAPH[name]
            if m in GRAPH and not (name.startswith(m + ".") and MODULES[m].name == "__init__.py")
        }

    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges(node)):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
