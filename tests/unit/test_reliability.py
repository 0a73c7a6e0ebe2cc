"""Nothing lost, nothing silent (issue 30), through the real command: lineage and fresh starts, a corrupt
checkpoint folder, the run-dir lock, non-finite steps (skip / stop / rollback, never a non-finite
checkpoint), preemption of one process and of 2 and 4 launched ranks, a launcher killed with SIGKILL,
unwritable run and checkpoint folders, and a disk too small for one checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from loom.checkpoint.manager import list_complete, step_dir_name
from loom.cli.main import main as loom_main
from tests.tiny import tiny_args
from tests.unit.test_checkpoint_recovery import LOOM, env, records, truncate_shard

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def opts(run_dir, cache, **extra) -> list[str]:
    return tiny_args(
        run_dir,
        cache,
        **{
            "run.seed": 3,
            "run.deterministic": "true",
            "training.steps": 6,
            "training.global_batch_size": 4,
            "checkpoint.at_end": None,
            **extra,
        },
    )


def run_main(capsys, run_dir, cache, **extra) -> tuple[int, str, str]:
    """``loom train`` in this process: (exit code, stdout, stderr)."""
    try:
        code = loom_main(["train", *opts(run_dir, cache, **extra)])
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


def steps_in(run_dir) -> list[int]:
    return [s for s, _ in list_complete(os.path.join(str(run_dir), "checkpoints"))]


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("loom:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("token_cache"))


# ---- lineage, fresh starts, corrupt folders ------------------------------------------------
@pytest.mark.slow
def test_an_old_runs_checkpoints_neither_block_nor_delete_a_new_runs(tmp_path, cache, capsys):
    """The issue's case: a 12-step run saved every step; a new 4-step run in the same dir with resume none."""
    run = tmp_path / "a"
    assert run_main(capsys, run, cache, **{"training.steps": 12, "checkpoint.every": 1})[0] == 0
    assert steps_in(run) == [10, 11, 12]
    code, _, err = run_main(
        capsys, run, cache, **{"training.steps": 4, "checkpoint.every": 2, "checkpoint.resume": "none"}
    )
    line = one_line(err)
    assert code == 2 and "already holds 3 checkpoint(s), the newest step 12" in line
    assert "--checkpoint.resume auto" in line and "--checkpoint.overwrite true" in line
    assert steps_in(run) == [10, 11, 12]

    code, out, _ = run_main(
        capsys,
        run,
        cache,
        **{
            "training.steps": 4,
            "checkpoint.every": 2,
            "checkpoint.resume": "none",
            "checkpoint.overwrite": "true",
        },
    )
    assert code == 0 and "moved 3 checkpoint(s) into" in out
    assert steps_in(run) == [2, 4]  # the new run's checkpoints are all there
    (aside,) = os.listdir(run / "checkpoints" / "superseded")
    assert sorted(os.listdir(run / "checkpoints" / "superseded" / aside)) == [
        step_dir_name(s) for s in (10, 11, 12)
    ]
    assert [r["step"] for r in records(run)] == [
        1,
        2,
        3,
        4,
    ]  # the old run's metrics are set aside, not mixed in
    assert any(n.startswith("metrics.") and n != "metrics.jsonl" for n in os.listdir(run))


def test_auto_with_every_checkpoint_corrupt_exits_2_and_keeps_them(tmp_path, cache, capsys):
    run = tmp_path / "r"
    assert run_main(capsys, run, cache, **{"checkpoint.every": 2, "checkpoint.keep": 0})[0] == 0
    for step in (2, 4, 6):
        truncate_shard(os.path.join(str(run), "checkpoints", step_dir_name(step)))
    os.remove(os.path.join(str(run), "checkpoints", step_dir_name(4), "COMPLETE.json"))
    code, _, err = run_main(capsys, run, cache, **{"training.steps": 8})
    line = one_line(err)
    assert code == 2 and "none of the 3 checkpoint(s)" in line
    for step in (2, 4, 6):
        assert step_dir_name(step) in line
    assert "no COMPLETE.json" in line
    assert sorted(os.listdir(run / "checkpoints")) == [step_dir_name(s) for s in (2, 4, 6)]


# ---- the run-dir lock ---------------------------------------------------------------------
def test_a_second_run_in_a_locked_run_dir_exits_2_naming_the_holder(tmp_path, cache, capsys):
    run = tmp_path / "locked"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from loom.runtime.run_lock import acquire; "
            "acquire(sys.argv[1]); print('held', flush=True); time.sleep(120)",
            str(run),
        ],
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        code, _, err = run_main(capsys, run, cache)
        line = one_line(err)
        assert code == 2 and f"run.dir {run} is in use by another run" in line and f"pid {holder.pid}" in line
        assert not os.path.exists(run / "metrics.jsonl")
    finally:
        holder.kill()
        holder.wait()
    # the OS released the lock with the process: a run goes ahead
    assert run_main(capsys, run, cache, **{"training.steps": 2})[0] == 0


# ---- non-finite steps ---------------------------------------------------------------------
# foreach decides on the host (a sync); loom's Triton AdamW (its reference on CPU) and PyTorch's fused AdamW skip
# on the device and the host takes back its step counts a step later (the quick loop, -m "not slow", runs foreach
# here and triton in the device-side skip test)
IMPLEMENTATIONS = ["foreach", *(pytest.param(impl, marks=pytest.mark.slow) for impl in ("triton", "fused"))]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_diverged_run_skips_then_stops_with_exit_1_and_one_line(tmp_path, cache, capsys, impl):
    run = tmp_path / "nan"
    code, out, err = run_main(
        capsys,
        run,
        cache,
        **{
            "optimizer.lr": 1e6,
            "training.steps": 40,
            "training.nonfinite_limit": 3,
            "checkpoint.every": 1,
            "optimizer.implementation": impl,
        },
    )
    line = one_line(err)
    assert code == 1 and "3 non-finite steps in a row (training.nonfinite_limit = 3)" in line
    bad = [int(m.split()[1].rstrip(":")) for m in out.splitlines() if "non-finite loss" in m]
    assert len(bad) == 3 and bad == list(range(bad[0], bad[0] + 3))
    recs = records(run)
    assert recs[-1]["step"] == bad[-1] and recs[-1]["nonfinite_steps"] == 3
    assert None in (recs[-1]["loss"], recs[-1]["grad_norm"])  # a non-finite value is null in strict JSON
    assert "non-finite 3" in out  # the console line counts them
    assert steps_in(run)[-1] < bad[0] + 3
    for step in steps_in(run):  # no checkpoint holds non-finite weights
        assert weights_finite(os.path.join(str(run), "checkpoints", step_dir_name(step)))


def weights_finite(folder: str) -> bool:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(
        sd, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return all(torch.isfinite(v).all() for k, v in sd.items() if k.startswith("model.")) and len(sd) > 0


def test_stop_mode_stops_at_the_first_non_finite_step(tmp_path, cache, capsys):
    code, out, err = run_main(
        capsys,
        tmp_path / "stop",
        cache,
        **{"optimizer.lr": 1e6, "training.steps": 40, "training.nonfinite": "stop"},
    )
    line = one_line(err)
    assert code == 1 and "(training.nonfinite = stop)" in line and "non-finite step" in line


@pytest.fixture
def poisoned_step(monkeypatch):
    """The batch of optimizer step 5 gives a NaN loss, wherever and however often it is trained on."""
    from loom.train.loop import Loop
    from loom.train.steps import LocalStep

    train_step, loss_of = Loop.train_step, LocalStep._loss
    at = {"step": 0}

    def counted(self, micro_batches):
        at["step"] = self.step + 1
        return train_step(self, micro_batches)

    def poisoned(self, mb):
        loss = loss_of(self, mb)
        return loss * float("nan") if at["step"] == 5 else loss

    monkeypatch.setattr(Loop, "train_step", counted)  # the loop every method's run drives (loom.train.loop)
    monkeypatch.setattr(LocalStep, "_loss", poisoned)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_rollback_skips_the_offending_batch_and_continues_like_skip(
    tmp_path, cache, capsys, poisoned_step, impl
):
    """Rolling back to step 4 and skipping batch 5 gives the weights a skipped update gives: steps 6-8 are equal."""
    common = {
        "training.steps": 8,
        "checkpoint.every": 2,
        "checkpoint.keep": 0,
        "optimizer.implementation": impl,
    }
    assert run_main(capsys, tmp_path / "skip", cache, **common)[0] == 0
    code, out, _ = run_main(
        capsys, tmp_path / "rollback", cache, **common, **{"training.nonfinite": "rollback"}
    )
    assert code == 0
    assert "rolled back to step 4" in out and "step 5: batch skipped" in out
    skipped, rolled = records(tmp_path / "skip"), records(tmp_path / "rollback")
    assert [r["step"] for r in rolled] == [1, 2, 3, 4, 6, 7, 8]  # each step once; 5 made no update
    assert [r["loss"] for r in rolled if r["step"] > 5] == [r["loss"] for r in skipped if r["step"] > 5]
    assert skipped[4]["step"] == 5 and skipped[4]["loss"] is None and skipped[4]["nonfinite_steps"] == 1
    with open(
        os.path.join(str(tmp_path / "rollback"), "checkpoints", step_dir_name(8), "trainer_state.json")
    ) as fh:
        assert json.load(fh)["nonfinite"]["skip_steps"] == [5]  # a resumed run skips it too


@pytest.mark.parametrize("impl", ["triton", pytest.param("fused", marks=pytest.mark.slow)])
def test_a_skip_decided_on_the_device_is_a_skip_decided_on_the_host(
    tmp_path, cache, capsys, poisoned_step, impl
):
    """Logged every 3rd step, so step 5's verdict is read a step late: the LR schedule and AdamW's step count are
    taken back as if the host had skipped the step itself (same LRs as foreach; the same steps in the saved state)."""
    common = {"training.steps": 9, "metrics.every": 3, "checkpoint.every": 0}
    code, out, _ = run_main(
        capsys, tmp_path / "host", cache, **common, **{"optimizer.implementation": "foreach"}
    )
    assert code == 0 and "step 5: non-finite loss nan" in out
    code, out, _ = run_main(
        capsys, tmp_path / "device", cache, **common, **{"optimizer.implementation": impl}
    )
    assert code == 0 and "step 5: non-finite loss nan" in out
    host, device = records(tmp_path / "host"), records(tmp_path / "device")
    assert [r["step"] for r in device] == [3, 6, 9] and device[-1]["nonfinite_steps"] == 1
    assert [r["lr"] for r in device] == [r["lr"] for r in host]
    final = os.path.join(str(tmp_path / "device"), "checkpoints", step_dir_name(9))
    from torch.distributed.checkpoint import FileSystemReader

    steps = {
        k: v
        for k, v in FileSystemReader(final).read_metadata().state_dict_metadata.items()
        if k.startswith("optimizer.state.") and k.endswith(".step")
    }
    assert steps  # AdamW's per-tensor step counts: 8 updates of 9 steps
    sd = {k: torch.zeros(()) for k in steps}
    import torch.distributed.checkpoint as dcp

    dcp.load(sd, checkpoint_id=final, no_dist=True)
    assert {float(v) for v in sd.values()} == {8.0}


def test_weights_that_are_not_finite_are_never_saved(tmp_path, cache, capsys, monkeypatch):
    from loom.train.optimizer import OptimizerParts

    step = OptimizerParts.step
    calls = []

    def breaking(self, *args, **kwargs):
        step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                next(p for g in self.param_groups for p in g["params"]).fill_(float("inf"))

    monkeypatch.setattr(OptimizerParts, "step", breaking)
    run = tmp_path / "inf"
    code, _, err = run_main(capsys, run, cache, **{"checkpoint.every": 2, "checkpoint.keep": 0})
    line = one_line(err)
    assert code == 1 and "the weights are not finite at step 4: no checkpoint written" in line
    assert steps_in(run) == [2]


# ---- preemption -----------------------------------------------------------------------------
def start(run_dir, cache, *extra: str, nproc: int = 1) -> subprocess.Popen:
    args = opts(
        run_dir,
        cache,
        **{
            "training.steps": 100000,
            "metrics.every": 1000,
            "checkpoint.every": 7,
            "training.global_batch_size": 8,
            "training.micro_batch_size": 2,
        },
    )
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    return subprocess.Popen(
        [sys.executable, "-c", LOOM, "train", *launch, *args, *extra],
        env=env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def wait_for_checkpoint(run_dir, proc, step: int = 7, timeout: float = 240) -> None:
    """Until checkpoint ``step`` exists (training is under way), bounded by the process itself and a deadline (the
    run is killed at the deadline; the test's teardown would kill it otherwise)."""
    deadline = time.monotonic() + timeout
    while not os.path.isdir(os.path.join(str(run_dir), "checkpoints", step_dir_name(step))):
        assert proc.poll() is None, proc.communicate()
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no checkpoint {step} in {timeout} s: {proc.communicate()}")
        time.sleep(0.2)


# 4 ranks: exhaustive since one CI rehearsal (4 ranks on 2 cores) saw a worker fail in a broadcast before the first
# save; not reproduced in 6 runs by hand, 3 of them side by side
@pytest.mark.parametrize(
    "nproc", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.exhaustive)]
)
def test_sigterm_is_a_clean_stop_on_every_rank(tmp_path, cache, nproc):
    """The ranks agree at the next step (not the next logged one: metrics.every 1000), save and exit 0."""
    run = tmp_path / "pre"
    proc = start(run, cache, nproc=nproc)
    wait_for_checkpoint(run, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    saved = [
        int(line.split()[3].rstrip(","))
        for line in out.splitlines()
        if line.startswith("SIGTERM: saved step")
    ]
    assert len(saved) == 1 and saved[0] >= 7 and saved[0] % 1000, out
    assert steps_in(run)[-1] == saved[0]
    if nproc > 1:
        assert f"loom: SIGTERM: the workers saved step {saved[0]} and stopped" in err


@pytest.mark.slow
def test_sigint_saves_like_sigterm_in_one_process(tmp_path, cache):
    run = tmp_path / "int"
    proc = start(run, cache)
    wait_for_checkpoint(run, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert any(line.startswith("SIGINT: saved step") for line in out.splitlines()), out


def test_a_second_ctrl_c_stops_at_once_in_one_line(capsys):
    """The first Ctrl-C asks for a save at the next step; the second raises KeyboardInterrupt at once, which
    the CLI turns into one line and exit code 130 (checkpoints are written to a temporary folder and renamed,
    so an interrupted save never touches the last complete one: test_checkpoint_recovery)."""
    from loom.cli.errors import user_errors_exit
    from loom.runtime.guard import Preemption

    stop = Preemption(60.0)
    try:
        stop._handle(signal.SIGINT, None)
        assert stop.requested and stop.reason == "SIGINT"

        @user_errors_exit
        def second():
            stop._handle(signal.SIGINT, None)

        with pytest.raises(SystemExit) as code:
            second()
    finally:
        stop.restore()
    assert code.value.code == 130
    assert capsys.readouterr().err == (
        "loom: interrupted: stopped without a new checkpoint (the last complete one stays)\n"
    )


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_workers_stop_when_the_launcher_is_killed(tmp_path, cache):
    run = tmp_path / "orphans"
    proc = start(run, cache, nproc=2)
    wait_for_checkpoint(run, proc)
    workers = children(proc.pid)
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 90  # far above the 1 s watch + one step + a save
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(w) for w in workers)
    out = proc.stdout.read()
    assert "the launcher exited: saved step" in out, out


# ---- folders and space ----------------------------------------------------------------------
@pytest.mark.parametrize("case", ["run-dir-is-a-file", "run-dir-unwritable", "checkpoint-dir-is-a-file"])
def test_unusable_run_and_checkpoint_folders_are_one_line_before_anything_is_built(
    tmp_path, cache, capsys, case
):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    run, extra = tmp_path / "run", {}
    if case == "run-dir-is-a-file":
        run, expect = a_file, f"run.dir = '{a_file}': is a file"
    elif case == "run-dir-unwritable":
        run, expect = "/proc/loom-run", "run.dir = '/proc/loom-run': not writable"
    else:
        extra, expect = {"checkpoint.dir": str(a_file)}, f"checkpoint.dir = '{a_file}': is a file"
    fresh_cache = str(tmp_path / "cache")
    code, _, err = run_main(capsys, run, fresh_cache, **extra)
    assert code == 2 and expect in one_line(err)
    assert not os.path.exists(fresh_cache)  # no data was prepared


def test_a_disk_that_cannot_hold_one_checkpoint_is_refused_at_start(tmp_path, cache, capsys, monkeypatch):
    import shutil

    import loom.train.engine as engine

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(engine.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    code, _, err = run_main(capsys, tmp_path / "full", cache)
    line = one_line(err)
    assert (
        code == 2 and "a checkpoint of this model needs about" in line and "the disk has 1,000 free" in line
    )
