"""Resolution runs once per process: ``loom train`` resolves in the launching process and hands the result to its
workers (loom.resolve.handing / handed), whose engine resolves nothing again; an elastic start resolves each node
count's world once, and a worker that an elastic agent re-forms on another node count reads that world's entry."""

from __future__ import annotations

import sys

import pytest

import loom.resolve
from loom.cli.main import main as loom_main
from loom.cli.preflight import check_layout, elastic_note, preflight
from loom.config.errors import SharedError
from loom.resolve import handed, handing
from tests.tiny import tiny_args, tiny_config


@pytest.fixture
def resolves():
    """Calls of loom.resolve.resolve, wherever a module holds it (loom.methods, the engine, ...): a list of the
    world sizes each call resolved for. Modules imported meanwhile bind the counter: all are given back the
    resolver after the test."""
    calls, original = [], loom.resolve.resolve

    def counted(cfg, world_size, *args, **kwargs):
        calls.append(world_size)
        return original(cfg, world_size, *args, **kwargs)

    def swap(old, new):
        for module in list(sys.modules.values()):
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is old:
                    setattr(module, name, new)

    swap(original, counted)
    yield calls
    swap(counted, original)


def test_loom_train_resolves_once_and_the_engine_reads_the_handed_run(tmp_path, resolves, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", loom.resolve.RESOLVED_ENV):
        monkeypatch.delenv(var, raising=False)
    args = tiny_args(tmp_path / "run", tmp_path / "cache", **{"training.steps": 2, "run.device": "cpu"})
    assert loom_main(["train", *args]) == 0
    assert resolves == [1]  # the preflight's; the worker's engine (in this process) was handed it
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    assert loom.resolve.RESOLVED_ENV not in __import__("os").environ  # the hand-off is gone with the job


def test_a_handed_run_is_read_for_its_config_and_world_only(tmp_path, resolves, monkeypatch):
    cfg = tiny_config(tmp_path / "run", **{"run.device": "cpu"})
    _, _, world, run, resolved = preflight(tiny_args(tmp_path / "run", **{"run.device": "cpu"}))
    assert resolves == [1] and world == 1 and run.model_args is not None
    with handing(resolved):
        got = handed(cfg, 1)
        assert got == run and got is not run  # a fresh copy: the engine builds its mesh into the degrees
        assert handed(cfg, 2) is None  # a world the launcher did not resolve: the caller resolves
        other = tiny_config(tmp_path / "run", **{"run.device": "cpu", "training.steps": 3})
        assert handed(other, 1) is None  # the config changed between restarts: resolved again
    assert handed(cfg, 1) is None  # nothing handed outside
    monkeypatch.setattr(loom.resolve, "RESOLVED_MAX_BYTES", 100)
    with handing(resolved):  # too large for the environment: nothing is handed, each worker resolves
        assert handed(cfg, 1) is None
    assert resolves == [1]


def test_launched_workers_find_the_handed_run_for_their_arguments(tmp_path, resolves):
    """The workers' arguments (the launcher's options stripped) give the config the launcher resolved."""
    from loom.cli.preflight import load_config
    from loom.cli.train import worker_args

    argv = ["--max-restarts", "1", *tiny_args(tmp_path / "run", **{"run.device": "cpu"})]
    _, launch, world, run, resolved = preflight(argv)
    assert launch.agent and world == 1
    with handing(resolved):
        assert handed(load_config(worker_args(argv, launch))[0], 1) == run
    assert resolves == [1]


ELASTIC = {
    "TORCHELASTIC_RUN_ID": "job",
    "TORCHELASTIC_MAX_RESTARTS": "1",
    "GROUP_WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
}


def test_an_elastic_start_resolves_each_world_once_and_its_workers_none(tmp_path, resolves):
    """--nnodes 1:4 with parallel.tp 2: the worlds of 1 to 4 nodes resolved once each; 4 nodes is the plan; a
    worker re-formed on 2 nodes reads that world's run, on 3 nodes that world's refusal."""
    argv = ["--nnodes", "1:4", "--rdzv-endpoint", "localhost:29400"]
    argv += tiny_args(tmp_path / "run", **{"run.device": "cpu", "parallel.tp": 2})
    cfg, launch, world, _, resolved = preflight(argv)
    assert sorted(resolves) == [1, 2, 3, 4] and world == 4
    note = elastic_note(launch, resolved)
    assert "1 (parallel.tp = 2" in note and "; 3 (" in note and "2 (" not in note
    with handing(resolved):
        assert check_layout(cfg, 4, ELASTIC) is None  # the engine reads the handed run
        assert check_layout(cfg, 2, ELASTIC) is None
        assert handed(cfg, 2).model_args is None  # not the plan: the engine adds the model's shape
        with pytest.raises(SharedError, match=r"the job formed with 1 node\(s\) x 1 = 3 ranks"):
            check_layout(cfg, 3, ELASTIC)
    assert sorted(resolves) == [1, 2, 3, 4]


def test_an_elastic_worker_without_a_launcher_resolves_once_and_hands_it_on(tmp_path, resolves):
    """``torchrun`` started the job (nothing handed): the worker resolves its world once, for its engine."""
    cfg = tiny_config(tmp_path / "run", **{"run.device": "cpu"})
    resolved = check_layout(cfg, 1, ELASTIC)
    assert resolves == [1]
    with handing(resolved):
        assert handed(cfg, 1) == resolved.runs[1]
    assert check_layout(cfg, 1, {}) is None and resolves == [1]  # a plain job: the engine resolves
