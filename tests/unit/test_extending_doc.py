"""docs/extending.md's worked examples stay true: each code block marked ``<!-- example: NAME -->`` runs as written
(in this process) and does what the doc says: the method trains, the model family builds and runs a forward, the
step hook is called, the kernel matches its reference, the parallel model matches the plain one."""

from __future__ import annotations

import math
import pathlib
import re
import sys
import types

import pytest
import torch

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "extending.md"
MARKED = re.compile(r"<!-- example: (\w+) -->\n```python\n(.*?)\n```", re.S)


def examples() -> dict[str, str]:
    return dict(MARKED.findall(DOC.read_text()))


def load(name: str, monkeypatch, module: str | None = None) -> types.ModuleType:
    """The block ``name`` run as a module (``module``: its importable name, else a private one)."""
    mod = types.ModuleType(module or f"extending_doc_{name}")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    exec(compile(examples()[name], f"{DOC}:{name}", "exec"), mod.__dict__)
    return mod


def test_the_doc_marks_its_five_examples():
    assert sorted(examples()) == ["family", "hook", "kernel", "method", "parallelism"]


def test_the_method_registers_and_trains_two_steps(tiny, monkeypatch):
    from loom.config import ConfigError, build_config
    from loom.methods.registry import METHODS, method_of, rules_of

    mod = load("method", monkeypatch, "extending_doc_smooth")
    monkeypatch.setitem(METHODS, "smooth", (mod.__name__, ("smooth",)))  # its line in METHODS
    cfg = tiny(**{"training.steps": 2, "run.device": "cpu"})
    options = build_config(overrides={"training.objective": "smooth", "smooth.smoothing": "0.2"})
    cfg.training.objective, cfg.smooth = (
        options.training.objective,
        options.smooth,
    )  # its section, from its module
    with pytest.raises(ConfigError, match="smooth.smoothing"):
        build_config(overrides={"training.objective": "smooth", "smooth.smoothing": "2"})  # its opt()'s max
    chosen = method_of(cfg)
    assert chosen is mod.METHOD
    objective = chosen.objective(cfg)
    assert objective.smoothing == 0.2
    records = chosen.run(cfg, objective, rules=rules_of(cfg))
    assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["loss"]) for r in records)
    assert isinstance(objective, mod.LabelSmoothing) and not objective.loss_in_forward  # its loss() ran
    logits, labels = torch.randn(1, 3, 5), torch.tensor([[1, 2, -100]])
    smoothed = objective.loss(logits, labels)
    plain = torch.nn.functional.cross_entropy(logits[0, :2], labels[0, :2], reduction="sum")
    assert not torch.isclose(smoothed, plain)


def test_the_family_builds_and_runs_a_forward(monkeypatch):
    from loom.models import registry

    mod = load("family", monkeypatch)
    registry.register(mod.SPEC)
    try:
        args = registry.all_flavors()["sandwich_debug"].with_(vocab_size=256, max_seq_len=16)
        torch.manual_seed(0)
        model = registry.build_model(args)
        assert isinstance(model, mod.Sandwich) and isinstance(model.layers["1"], mod.SandwichBlock)
        assert registry.hf_adapter(args).architecture == "SandwichForCausalLM"
        logits = model(torch.randint(0, 256, (2, 16)))
        assert logits.shape == (2, 16, 256) and torch.isfinite(logits).all()
    finally:
        registry.unregister(mod.SPEC.name)


def test_the_hook_is_called_every_step(tiny, monkeypatch):
    import loom.train.engine as engine
    from loom.methods.base import run_loop
    from loom.methods.lm import objective

    mod = load("hook", monkeypatch)
    built = []

    def with_the_hook(cfg, eng, owner):  # its line in step_hooks
        built.append(mod.GradNormMax())
        return [*plain(cfg, eng, owner), built[-1]]

    plain = engine.step_hooks
    monkeypatch.setattr(engine, "step_hooks", with_the_hook)
    cfg = tiny(**{"training.steps": 2, "run.device": "cpu"})
    records = run_loop(cfg, objective(cfg))
    assert len(built) == 1 and [r["step"] for r in records] == [1, 2]
    norms = [r["grad_norm"] for r in records]
    assert [r["grad_norm_max"] for r in records] == pytest.approx([norms[0], max(norms)])


def test_the_kernel_matches_its_reference(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's CPU interpreter: set before the kernel is defined
    mod = load("kernel", monkeypatch)
    x = torch.randn(3, 1000)
    torch.testing.assert_close(mod.relu2(x), mod.relu2_reference(x))
    torch.testing.assert_close(mod.relu2_forward(x), mod.relu2_reference(x))  # the Triton kernel itself
    torch.library.opcheck(mod.relu2, (x,), test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="x: dtype torch.int64 not supported"):
        mod.relu2_forward(torch.ones(4, dtype=torch.int64))


def test_the_parallelism_shards_and_keeps_the_output(tmp_path, monkeypatch):
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from loom.models.registry import all_flavors, build_model

    mod = load("parallelism", monkeypatch)
    torch.manual_seed(0)
    plain = build_model(all_flavors()["debug"].with_(vocab_size=256, max_seq_len=16))
    own = not dist.is_initialized()  # a one-process group left by an earlier in-process test serves as well
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        parallel = copy.deepcopy(plain)
        mod.apply_ffn_tp(parallel, mesh)
        w1 = parallel.layers["0"].feed_forward.w1.weight
        assert isinstance(w1, DTensor) and w1.placements == (Shard(0),)
        tokens = torch.randint(0, 256, (2, 16))
        torch.testing.assert_close(parallel(tokens), plain(tokens))
    finally:
        if own:
            dist.destroy_process_group()
