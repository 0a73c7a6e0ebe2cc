"""parallel.fault_tolerance (torchft): two replica groups of one rank each (two ``loom train`` processes) and a local
lighthouse. One group is killed mid-run; the other keeps committing steps alone; the killed one restarts, recovers
the live group's state (torchft's live recovery, no checkpoint) and both finish with equal weights.

The test paces the group that runs alone (SIGSTOP, with short SIGCONT windows so its heartbeats reach the
lighthouse) while the other group's process starts, so the run cannot end before the restarted group has joined."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from importlib.util import find_spec

import pytest

from tests.tiny import tiny_overrides

needs_torchft = pytest.mark.skipif(
    find_spec("torchft") is None, reason="needs torchft (pip install 'loom-train[ft]')"
)

BIN = os.path.dirname(sys.executable)
STEPS = 150
WAIT_S = 240  # no phase of a healthy run comes near this: a hang fails the test instead of blocking it


def group_args(run_dir, cache, replica: int, lighthouse: str, device: str = "cpu") -> list[str]:
    cfg = tiny_overrides(
        run_dir,
        cache,
        **{
            "run.device": device,
            "training.steps": STEPS,
            "checkpoint.at_end": "true",
            "run.seed": 3,
            "parallel.fault_tolerance": "true",
            "parallel.ft_replica_id": replica,
            "parallel.ft_replica_groups": 2,
            "parallel.ft_lighthouse": lighthouse,
            "parallel.ft_timeout_s": 30,
        },
    )
    return [f"--{k}={v}" for k, v in cfg.items()]


class Group:
    """One replica group's ``loom train`` process; its console output goes to ``<run_dir>.log``."""

    def __init__(self, run_dir, args: list[str], **env_vars):
        self.run_dir, self.args, self.proc, self.starts = run_dir, args, None, 0
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
        }
        self.env = {**env, "MASTER_ADDR": "127.0.0.1", "RUST_LOG": "warn", "OMP_NUM_THREADS": "1", **env_vars}

    def start(self, *launcher: str) -> None:
        self.starts += 1
        log = open(f"{self.run_dir}.{self.starts}.log", "w")
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "loom"), "train", *launcher, *self.args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def records(self) -> list[dict]:
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as fh:
            return [json.loads(line) for line in fh.read().splitlines() if line.endswith("}")]

    def output(self) -> str:
        return "".join(open(f"{self.run_dir}.{i}.log").read() for i in range(1, self.starts + 1))

    def signal(self, sig) -> None:
        """``sig`` to the launcher and every process under it (the elastic agent's workers have sessions of their
        own): the children first, so that none sees its parent gone before it is stopped or killed itself."""
        if self.proc.poll() is None:
            for pid in reversed(process_tree(self.proc.pid)):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants, parents before children (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, i = [root], 0
    while i < len(tree):
        tree += [pid for pid, parent in parents.items() if parent == tree[i]]
        i += 1
    return tree


def wait_for(condition, what: str, groups: list[Group], paced=lambda: None) -> None:
    """Until ``condition()``; the group ``paced()`` names runs 20 ms in every 520 (its heartbeats still reach the
    lighthouse well within its timeout)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        for g in groups:
            if g.proc.poll() not in (None, 0, -signal.SIGKILL):
                raise AssertionError(
                    f"{g.run_dir} exited {g.proc.returncode} while waiting for {what}:\n{g.output()[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what}:\n" + "\n".join(g.output()[-2000:] for g in groups)
            )
        held = paced()
        if held is not None:
            held.signal(signal.SIGCONT)
            time.sleep(0.02)
            held.signal(signal.SIGSTOP)
            time.sleep(0.3)
        time.sleep(0.2)
    for g in groups:
        g.signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The tiny run's token files, written once before any group starts (two runs tokenizing into one cache at
    once is not what these tests are about)."""
    from loom.data import build_tokenizer, prepare_data
    from tests.tiny import tiny_config

    tmp = tmp_path_factory.mktemp("tokens")
    cache = tmp / "cache"
    cfg = tiny_config(tmp / "prepare", cache)
    prepare_data(cfg.data, build_tokenizer(cfg.data.tokenizer), str(cache), "lm")
    return cache


def final_weights(run_dir) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = max(p for p in os.listdir(os.path.join(run_dir, "checkpoints")) if p.startswith("step"))
    out = os.path.join(run_dir, "final.pt")
    dcp_to_torch_save(os.path.join(run_dir, "checkpoints", folder), out)
    return torch.load(out, weights_only=False)["model"]


def two_gpus() -> bool:
    import torch

    return torch.cuda.device_count() >= 2


@needs_torchft
@pytest.mark.parametrize(
    "device,ranks",
    [
        pytest.param("cpu", 1, marks=pytest.mark.slow),
        pytest.param("cpu", 2, marks=pytest.mark.exhaustive),
        pytest.param(
            "cuda",
            1,
            marks=[
                pytest.mark.gpu,
                pytest.mark.multi_gpu,
                pytest.mark.skipif(not two_gpus(), reason="needs 2 GPUs"),
            ],
        ),
    ],
)
def test_survivor_continues_and_the_restarted_group_recovers(tmp_path, cache, monkeypatch, device, ranks):
    """On CPU (gloo between the groups; groups of 2 ranks shard with FSDP2 and recover each rank's shards), or on
    2 GPUs, one per group (NCCL between them)."""
    launcher = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    monkeypatch.setenv("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at info
    import torch
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=50, heartbeat_timeout_ms=3000
    )
    survivor, victim = (
        Group(
            tmp_path / f"g{i}",
            group_args(tmp_path / f"g{i}", cache, i, lighthouse.address(), device),
            **({"CUDA_VISIBLE_DEVICES": str(i)} if device == "cuda" else {}),
        )
        for i in range(2)
    )
    groups = [survivor, victim]
    try:
        survivor.start(*launcher)
        victim.start(*launcher)
        # both groups step (whichever starts first steps alone, held back, until the other recovers from it)
        wait_for(
            lambda: survivor.records() and victim.records(),
            "both groups' first steps",
            groups,
            paced=lambda: next((g for g in groups if g.records()), None),
        )
        wait_for(lambda: survivor.records()[-1]["replica_groups"] == 2, "a quorum of both groups", groups)
        victim.signal(signal.SIGKILL)
        victim.proc.wait()
        killed_at = survivor.records()[-1]["step"]
        # the survivor goes on alone: its step count advances while the other group is down
        wait_for(
            lambda: sum(r["step"] > killed_at and r["replica_groups"] == 1 for r in survivor.records()) >= 3,
            "the survivor's steps alone",
            groups,
        )
        survivor.signal(signal.SIGSTOP)
        alone = [r["step"] for r in survivor.records() if r["step"] > killed_at and r["replica_groups"] == 1]
        os.replace(victim.run_dir / "metrics.jsonl", victim.run_dir / "metrics.before_kill.jsonl")
        victim.start(*launcher)
        wait_for(
            lambda: bool(victim.records()), "the restarted group's first step", groups, paced=lambda: survivor
        )
        wait_for(lambda: all(g.proc.poll() is not None for g in groups), "both groups to finish", groups)
        for g in groups:
            assert g.proc.returncode == 0, g.output()[-3000:]
    finally:
        for g in groups:
            if g.proc is not None and g.proc.poll() is None:
                g.signal(signal.SIGCONT)
                g.signal(signal.SIGKILL)
        lighthouse.shutdown()

    steps = [r["step"] for r in survivor.records()]
    # each committed once (a step cut short by the kill ran again); the group that started later began where it
    # recovered the other's state
    assert steps == list(range(steps[0], STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in survivor.records())
    assert len(alone) >= 3
    rejoined = victim.records()
    assert "recovered step" in victim.output()
    # the restarted group started from the survivor's step (live recovery), not from step 1, and finished with it
    assert rejoined[0]["step"] > max(alone) and rejoined[-1]["step"] == STEPS
    assert rejoined[0]["replica_groups"] == 2
    a, b = final_weights(survivor.run_dir), final_weights(victim.run_dir)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@needs_torchft
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.exhaustive)])  # 1: in the default run
def test_two_groups_train_as_one_process(tmp_path, cache, monkeypatch, ranks):
    """Without failures, two replica groups log the losses of one process that takes the whole global batch: the
    groups split it as data-parallel ranks would, and their gradients are summed exactly. Groups of 2 ranks shard the
    model with FSDP2 (HSDP across the groups)."""
    monkeypatch.setenv("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    from tests.distributed.harness import run_one

    steps = 4
    ref = run_one(tiny_overrides(tmp_path / "single", cache, **{"run.seed": 3}))
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)  # the first step waits for both groups
    groups = [
        Group(
            tmp_path / f"g{i}",
            group_args(tmp_path / f"g{i}", cache, i, lighthouse.address())
            + [f"--training.steps={steps}", "--checkpoint.at_end=false"],
        )
        for i in range(2)
    ]
    try:
        for g in groups:
            g.start(*(["--nproc-per-node", str(ranks)] if ranks > 1 else []))
        wait_for(lambda: all(g.proc.poll() is not None for g in groups), "both groups to finish", groups)
    finally:
        for g in groups:
            if g.proc.poll() is None:
                g.signal(signal.SIGKILL)
        lighthouse.shutdown()
    for i, g in enumerate(groups):
        assert g.proc.returncode == 0, g.output()[-3000:]
        assert f"fault tolerance: replica group {i} of 2 (torchft" in g.output()
        got = g.records()
        assert [r["step"] for r in got] == list(range(1, steps + 1))
        assert all(r["replica_groups"] == 2 for r in got)
        assert max(abs(r["loss"] - e["loss"]) / e["loss"] for r, e in zip(got, ref)) < 1e-5


def test_fault_tolerance_rules(monkeypatch):
    """The ft_* fields only with parallel.fault_tolerance; the groups take the replicate axis; what is not supported
    with it yet is refused by name; the global batch is split over the groups' data-parallel ranks."""
    from loom.config.errors import ConfigError
    from loom.methods import resolve
    from tests.tiny import tiny_config

    ft = {
        "parallel.fault_tolerance": "true",
        "parallel.ft_replica_groups": 2,
        "parallel.ft_lighthouse": "http://h:1",
    }
    refused = [
        ({"parallel.ft_replica_groups": 2}, "parallel.ft_replica_groups"),
        ({**ft, "parallel.ft_replica_id": 2}, "parallel.ft_replica_id"),
        ({**ft, "parallel.ft_min_replicas": 3}, "parallel.ft_min_replicas"),
        ({**ft, "parallel.dp_replicate": 2}, "parallel.dp_replicate"),
        ({**ft, "parallel.tp": 2}, "parallel.tp"),
        ({**ft, "training.nonfinite": "rollback"}, "training.nonfinite"),
    ]
    for overrides, field in refused:
        with pytest.raises(ConfigError) as err:
            resolve(tiny_config(**overrides), 2, device="cpu")
        assert err.value.field == field, overrides
    # 8 sequences, micro-batches of 2: one rank of each of 2 groups runs 2 micro-batches a step
    assert resolve(tiny_config(**ft), 1, device="cpu").accum == 2
    assert resolve(tiny_config(), 1, device="cpu").accum == 4
    if find_spec("torchft") is not None:  # on this machine: the lighthouse's address is needed
        monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
        with pytest.raises(ConfigError, match="parallel.ft_lighthouse"):
            resolve(tiny_config(**{**ft, "parallel.ft_lighthouse": ""}), 1)
