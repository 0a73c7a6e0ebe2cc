"""Checkpoints under real failures, with the trainer in its own process (the tiny ``debug`` model):

* SIGKILL at points inside a save (shard writes, the marker, the rename, retention) leaves a loadable
  earlier checkpoint, and ``--checkpoint.resume auto`` continues from it bitwise like a run that was
  never interrupted;
* a corrupt newest checkpoint: ``auto`` falls back with a warning and replaces it, an explicit path
  to it is a one-line error with exit code 2;
* SIGTERM saves a checkpoint of the step it stops at and exits with code 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib

import pytest

import loom
from loom.checkpoint.manager import MARKER, STATE, CorruptCheckpoint, list_complete, step_dir_name, verify
from tests.tiny import tiny_args

STEPS, EVERY = 6, 2
REPO = os.path.dirname(os.path.dirname(os.path.abspath(loom.__file__)))
LOOM = "import sys; from loom.cli.main import entry; entry()"  # what the `loom` command runs

# Runs `loom train ARGS` like the command does, and SIGKILLs itself at POINT during the second save.
DRIVER = r"""
import os, shutil, signal, sys

import loom.checkpoint.manager as manager
from loom.cli.main import main

POINT = sys.argv[1]
armed = {"save": False, "rmtree": False}


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def wrap_save(save):
    calls = []

    def wrapped(self, *args, **kwargs):
        calls.append(1)
        armed["save"] = len(calls) == 2
        return save(self, *args, **kwargs)
    return wrapped


def wrap_fsync(fsync):
    def wrapped(fd):  # DCP syncs a shard it has just written (still open, before .metadata exists)
        if armed["save"] and POINT == "shards" and os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            die()
        return fsync(fd)
    return wrapped


def wrap_replace(replace):
    def wrapped(src, dst, *args, **kwargs):
        name, target = os.path.basename(str(src)), os.path.basename(str(dst))
        if armed["save"] and POINT == "marker" and name == manager.MARKER + ".partial":
            die()
        if armed["save"] and POINT == "rename" and name.startswith(".step_") and name.endswith(".tmp"):
            die()
        replace(src, dst, *args, **kwargs)
        if armed["save"] and POINT == "deleting" and target.endswith(".deleting"):
            die()
    return wrapped


def wrap_rmtree(rmtree):
    def wrapped(path, *args, **kwargs):
        armed["rmtree"] = armed["save"] and POINT == "rmtree" and str(path).endswith(".deleting")
        return rmtree(path, *args, **kwargs)
    return wrapped


def wrap_unlink(unlink):
    def wrapped(*args, **kwargs):  # dies after rmtree removed its first file
        unlink(*args, **kwargs)
        if armed["rmtree"]:
            die()
    return wrapped


manager.CheckpointManager.save = wrap_save(manager.CheckpointManager.save)
os.fsync = wrap_fsync(os.fsync)
os.replace = wrap_replace(os.replace)
os.unlink = wrap_unlink(os.unlink)
shutil.rmtree = wrap_rmtree(shutil.rmtree)
sys.exit(main(["train", *sys.argv[2:]]))
"""


# ---- running the trainer ------------------------------------------------------------
def env() -> dict:
    e = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    e.pop("LOOM_TEST_HANG_SECONDS", None)
    return e


def train_args(run_dir, cache, **extra) -> list[str]:
    return tiny_args(
        run_dir,
        cache,
        **{
            "run.seed": 3,
            "run.deterministic": "true",
            "training.steps": STEPS,
            "training.global_batch_size": 4,
            "checkpoint.every": EVERY,
            "checkpoint.keep": 1,
            "checkpoint.at_end": None,
            **extra,
        },
    )


def loom_train(run_dir, cache, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOOM, "train", *train_args(run_dir, cache, **extra)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def records(run_dir) -> list[dict]:
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def comparable(recs: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["batch_hash"]) for r in recs]


def ckpt_dir(run_dir) -> str:
    return os.path.join(str(run_dir), "checkpoints")


def ckpt(run_dir, step: int) -> str:
    return os.path.join(ckpt_dir(run_dir), step_dir_name(step))


def resumed_from(stdout: str) -> int:
    lines = [line for line in stdout.splitlines() if line.startswith("resumed from step ")]
    assert len(lines) == 1, stdout
    return int(lines[0].rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("token_cache"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> str:
    """An uninterrupted run that keeps every checkpoint (steps 2, 4, 6)."""
    run_dir = str(tmp_path_factory.mktemp("reference"))
    ok(loom_train(run_dir, cache, **{"checkpoint.keep": 0}))
    return run_dir


# ---- what a checkpoint holds, retention ---------------------------------------------------
def test_uninterrupted_run_keeps_all_with_keep_zero_and_saves_everything(reference):
    assert [s for s, _ in list_complete(ckpt_dir(reference))] == [2, 4, 6]
    assert sorted(os.listdir(ckpt_dir(reference))) == [step_dir_name(s) for s in (2, 4, 6)]
    assert [r["step"] for r in records(reference)] == list(range(1, STEPS + 1))
    folder = ckpt(reference, 4)
    files = verify(folder)["files"]
    assert {".metadata", STATE, "config.toml"} <= set(files)
    with open(os.path.join(folder, STATE)) as fh:
        state = json.load(fh)
    assert state["step"] == 4 and state["tokens_seen"] == 4 * 4 * 32
    assert {"loader", "scheduler", "scaler"} <= set(state) and state["scheduler"]["last_epoch"] == 4
    assert len(state["rng"]["cpu"]) > 0
    with open(os.path.join(folder, "config.toml"), "rb") as fh:
        config = tomllib.load(fh)
    assert config["checkpoint"]["every"] == EVERY and config["run"]["dir"] == reference
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    assert any(k.startswith("model.") for k in keys)
    assert any(k.startswith("optimizer.state.") and k.endswith(".exp_avg") for k in keys)


# ---- SIGKILL during a save --------------------------------------------------------------
def check_state_at_kill(run_dir, point: str) -> None:
    """The folders as the kill left them: the point was hit, the previous checkpoint is intact."""
    names = set(os.listdir(ckpt_dir(run_dir)))
    tmp = os.path.join(ckpt_dir(run_dir), "." + step_dir_name(4) + ".tmp")
    deleting = os.path.join(ckpt_dir(run_dir), "." + step_dir_name(2) + ".deleting")
    if point in ("shards", "marker", "rename"):
        assert names == {step_dir_name(2), os.path.basename(tmp)}
        verify(ckpt(run_dir, 2))
        inside = set(os.listdir(tmp))
        if point == "shards":
            assert any(n.endswith(".distcp") for n in inside) and ".metadata" not in inside
        if point == "marker":
            assert MARKER + ".partial" in inside and MARKER not in inside
        if point == "rename":
            verify(tmp)  # complete, but not renamed: not a checkpoint yet
    else:
        assert names == {step_dir_name(4), os.path.basename(deleting)}
        verify(ckpt(run_dir, 4))
        if point == "deleting":
            verify(deleting)  # renamed, nothing removed yet
        else:
            with pytest.raises(CorruptCheckpoint):
                verify(deleting)  # partly removed


@pytest.mark.parametrize(
    "point,resume_step",
    [  # the default run: one kill in a save (tests/faults/test_kills kills in retention too); the rest slow
        ("shards", 2),
        pytest.param("marker", 2, marks=pytest.mark.slow),
        pytest.param("rename", 2, marks=pytest.mark.slow),
        pytest.param("deleting", 4, marks=pytest.mark.slow),
        pytest.param("rmtree", 4, marks=pytest.mark.slow),
    ],
)
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(
    tmp_path, cache, reference, point, resume_step
):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run_dir = str(tmp_path / "run")
    killed = subprocess.run(
        [sys.executable, str(driver), point, *train_args(run_dir, cache)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [r["step"] for r in records(run_dir)] == [1, 2, 3, 4]  # killed while saving step 4
    check_state_at_kill(run_dir, point)

    out = ok(loom_train(run_dir, cache, **{"checkpoint.resume": "auto"}))
    assert resumed_from(out) == resume_step
    # the killed run's records past the resumed step are dropped: each step once, the resumed ones bitwise
    assert comparable(records(run_dir)) == comparable(records(reference))
    assert sorted(os.listdir(ckpt_dir(run_dir))) == [step_dir_name(STEPS)]  # leftovers gone, keep 1
    verify(ckpt(run_dir, STEPS))


# ---- corruption through the trainer and the CLI -----------------------------------------------
def copy_run(reference, dest) -> str:
    shutil.copytree(reference, dest)
    return str(dest)


def truncate_shard(folder: str) -> None:
    shard = os.path.join(folder, "__0_0.distcp")
    with open(shard, "r+b") as fh:
        fh.truncate(os.path.getsize(shard) // 2)


def test_auto_falls_back_past_a_corrupt_checkpoint_and_replaces_it(tmp_path, cache, reference):
    run_dir = copy_run(reference, tmp_path / "run")
    truncate_shard(ckpt(run_dir, 6))
    proc = loom_train(run_dir, cache, **{"checkpoint.resume": "auto", "checkpoint.keep": 0})
    assert resumed_from(ok(proc)) == 4
    assert "UserWarning" in proc.stderr and "falling back to step 4" in proc.stderr
    assert f"checkpoint {ckpt(run_dir, 6)}: file __0_0.distcp has " in proc.stderr
    assert comparable(records(run_dir)) == comparable(records(reference))  # steps 5, 6 written again, once
    saved_again, original = verify(ckpt(run_dir, 6))["files"], verify(ckpt(reference, 6))["files"]
    for name in ("__0_0.distcp", STATE):  # bit for bit (config.toml and .metadata name other paths)
        assert saved_again[name] == original[name]


@pytest.mark.parametrize("damage", ["truncated shard", "missing metadata"])
def test_an_explicit_corrupt_checkpoint_is_a_one_line_error(tmp_path, cache, reference, damage):
    run_dir = copy_run(reference, tmp_path / "run")
    folder = ckpt(run_dir, 4)
    if damage == "truncated shard":
        truncate_shard(folder)
        problem = "file __0_0.distcp has "
    else:
        os.remove(os.path.join(folder, ".metadata"))
        problem = "file .metadata is missing"
    proc = loom_train(str(tmp_path / "new_run"), cache, **{"checkpoint.resume": folder})
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1, proc.stderr
    assert err[0].startswith(f"loom: error: checkpoint {folder}: {problem}")


# ---- SIGTERM ---------------------------------------------------------------------------
def train_until_sigterm(run_dir, cache, log) -> tuple[int, int, str]:
    """Start a long run, SIGTERM it once it printed a step line; (first step, exit code, stdout)."""
    args = train_args(
        run_dir, cache, **{"training.steps": 500, "checkpoint.every": 0, "checkpoint.resume": "auto"}
    )
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", LOOM, "train", *args],
            env=env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step "):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=300)
    first = int(lines[-1].split()[1].split("/")[0]) if lines[-1].startswith("step ") else None
    return first, proc.returncode, "".join(lines) + rest


def stopped_at(stdout: str) -> int:
    lines = [line for line in stdout.splitlines() if line.startswith("SIGTERM: saved step ")]
    assert len(lines) == 1, stdout
    return int(lines[0].split()[3].rstrip(","))


def test_sigterm_saves_the_current_step_and_exits_cleanly(tmp_path, cache):
    run_dir = str(tmp_path / "run")
    first, code, out = train_until_sigterm(run_dir, cache, tmp_path / "err1.log")
    assert code == 0, (tmp_path / "err1.log").read_text()
    step = stopped_at(out)
    assert first == 1 and 1 <= step < 500
    assert [s for s, _ in list_complete(ckpt_dir(run_dir))] == [step]
    assert verify(ckpt(run_dir, step))["step"] == step
    assert [r["step"] for r in records(run_dir)] == list(range(1, step + 1))

    first, code, out = train_until_sigterm(run_dir, cache, tmp_path / "err2.log")
    assert code == 0, (tmp_path / "err2.log").read_text()
    assert resumed_from(out) == step and first == step + 1
    assert stopped_at(out) > step
