"""``metrics.nvtx``: a training run pushes its NVTX ranges (step, data wait, micro-batch, forward, backward,
each block's forward and backward, optimizer, grad norm, the loss all-reduce, validation, checkpoint save) and
pops every one, nested as the step is; off, it pushes none; a PyTorch that cannot emit NVTX (a CPU-only build)
is accepted and says in the banner that it has no effect."""

from __future__ import annotations

from collections import Counter

import torch

from loom.methods import resolve
from loom.metrics import nvtx
from loom.train.trainer import Trainer
from tests.tiny import tiny_config


def record(monkeypatch) -> tuple[list[tuple[str, tuple[str, ...]]], list[str]]:
    """Patch torch.cuda.nvtx's push and pop: -> (the pushes as (name, the names open around it), the ranges
    open now); a pop with nothing open fails the test at once."""
    pushed: list[tuple[str, tuple[str, ...]]] = []
    stack: list[str] = []

    def push(name):
        pushed.append((name, tuple(stack)))
        stack.append(name)
        return len(stack) - 1

    def pop():
        assert stack, "range_pop with no range open"
        stack.pop()
        return len(stack)

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", pop)
    return pushed, stack


def test_a_training_run_pushes_and_pops_its_ranges_in_balance(tmp_path, monkeypatch):
    pushed, open_now = record(monkeypatch)
    cfg = tiny_config(
        tmp_path / "run",
        tmp_path / "cache",
        **{
            "training.steps": 3,
            "metrics.nvtx": "true",
            "training.eval_every": 2,
            "training.eval_batches": 1,
            "training.eval_at_end": "false",  # validation at step 2 only
            "checkpoint.every": 2,
            "metrics.profile_steps": "3:3",
        },
    )  # the profiled step: both kinds of range
    Trainer(cfg).fit()
    assert not open_now, f"ranges left open: {open_now}"
    counts = Counter(name for name, _ in pushed)
    accum = 4  # global batch 8 / micro-batch 2 on one rank
    want = {
        "step 1": 1,
        "step 2": 1,
        "step 3": 1,
        "data_wait": 3,
        "optimizer": 3,
        "grad_norm": 3,
        "forward": 3 * accum,
        "backward": 3 * accum,
        "validation": 1,
        "checkpoint_save": 1,
        **{f"microbatch {i}": 3 for i in range(accum)},
    }
    assert {k: counts[k] for k in want} == want
    assert counts["allreduce.data_sum"] >= 3
    within = {name: around for name, around in pushed}  # the last push of each name
    # the blocks' ranges: forward in training and validation, backward inside each backward phase
    assert counts["block.0.backward"] == counts["block.1.backward"] == 3 * accum
    assert counts["block.0"] == counts["block.1"] > 3 * accum
    assert within["block.0.backward"][-1] == "backward" and within["block.1"][-1] == "forward"
    assert within["forward"][-1] == "microbatch 3" and within["microbatch 3"][-1] == "step 3"
    assert within["grad_norm"][-2:] == ("step 3", "optimizer")
    assert within["data_wait"] == within["step 1"] == ()  # the data wait comes before its step


def test_no_ranges_when_off(tmp_path, monkeypatch):
    pushed, _ = record(monkeypatch)
    nvtx.enable(True)  # the run turns them off again (one run may follow another in a process)
    pushed.clear()  # enable's probe of the NVTX library
    Trainer(tiny_config(tmp_path / "run", tmp_path / "cache", **{"training.steps": 1})).fit()
    assert pushed == [] and not nvtx.enabled()


def test_a_pytorch_without_nvtx_accepts_the_setting_and_says_it_has_no_effect(tmp_path, monkeypatch, capsys):
    """A CPU-only build has no NVTX library: metrics.nvtx is accepted, nothing is pushed, the banner says why."""
    calls = []

    def missing(name):
        calls.append(name)
        raise RuntimeError("NVTX functions not installed. Are you sure you have a CUDA build?")

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", missing)
    resolve(tiny_config(**{"metrics.nvtx": "true"}), 1)  # no ConfigError
    Trainer(
        tiny_config(tmp_path / "run", tmp_path / "cache", **{"training.steps": 2, "metrics.nvtx": "true"})
    ).fit()
    assert calls == ["loom.nvtx.check"] and not nvtx.enabled()  # one probe, then no range
    banner = [line for line in capsys.readouterr().out.splitlines() if "metrics.nvtx" in line]
    assert len(banner) == 1 and "no effect" in banner[0] and "NVTX functions not installed" in banner[0]


def test_expert_parallel_exchanges_are_ranges(tmp_path, monkeypatch):
    """Expert parallelism's token all-to-alls: ``ep.counts``, ``ep.dispatch`` and ``ep.combine`` forward, the
    two exchanges' ``.backward`` in the backward (one gloo rank: the exchange is a copy)."""
    import torch.distributed as dist

    from loom.parallel.expert_parallel import ExpertParallel

    pushed, open_now = record(monkeypatch)
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        nvtx.enable(True)
        pushed.clear()  # enable's probe of the NVTX library
        x = torch.randn(5, 3, requires_grad=True)
        out = ExpertParallel(dist.group.WORLD, 1).run(
            lambda rows, counts, local: rows * 2, x, torch.tensor([2, 3])
        )
        out.sum().backward()
    finally:
        nvtx.enable(False)
        if own:
            dist.destroy_process_group()
    assert torch.equal(out, x * 2) and torch.equal(x.grad, torch.full_like(x, 2.0))
    names = [name for name, _ in pushed]
    assert names[:3] == ["ep.counts", "ep.dispatch", "ep.combine"] and not open_now
    assert sorted(names[3:]) == ["ep.combine.backward", "ep.dispatch.backward"]
