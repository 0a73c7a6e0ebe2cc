"""Shared test setup: the tiny run builder (``tests/tiny.py``, importable from worker processes too), the
``slow`` and ``exhaustive`` markers, per-test cleanup of processes, and the gloo rank pools' shutdown.

Markers (pyproject.toml lists them):

- ``slow``: broad matrices and the slowest tests; deselected by default (``python -m pytest -q``, what CI runs).
  ``python -m pytest -q --slow`` adds them; ``-m slow`` runs only them. Run them by hand before an issue closes.
- ``exhaustive``: the widest matrices (the fault-injection matrix, 4-rank layout matrices), run by hand before an
  issue is closed; deselected unless ``--exhaustive`` is given or ``-m`` names them.
- ``gpu`` / ``multi_gpu``: need one CUDA device / several (skipped without them); ``-m "gpu and multi_gpu"``
  runs the multi-GPU group on its machine.

Every test has a time limit (pytest-timeout; pyproject.toml's ``timeout``, larger ones named with
``@pytest.mark.timeout(s)``), and a process a test leaves running is killed when the test ends (and reported).
"""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from tests.tiny import TINY, tiny_args, tiny_config, tiny_overrides

__all__ = [
    "TINY",
    "tiny_args",
    "tiny_config",
    "tiny_overrides",
]  # re-exported; tests import them from tests.tiny


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _untracked() -> set[str] | None:
    """The repository's untracked, not ignored paths (None outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "--untracked-files=normal"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode:
        return None
    return {line[3:] for line in out.stdout.splitlines() if line.startswith("?? ")}


def pytest_configure(config):
    """Under pytest-xdist (the README's ``-n 2``) each worker computes on one thread: two workers on two cores with
    torch's default of one thread per core would oversubscribe them (OpenMP threads spin while they wait). The
    session (not its workers) notes the repository's untracked files, to name any a test leaves there."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        config._loom_untracked = _untracked()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        # no Inductor compile-worker pool in each rank: on 2 cores it only adds processes
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        import torch

        torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        default=False,
        help="also run the tests marked exhaustive (deselected by default)",
    )
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (deselected by default)",
    )


LAUNCHES = re.compile(
    r"--nproc-per-node|torchrun|subprocess|Popen"
)  # a file that launches jobs of several ranks


def xdist_group(item) -> str:
    """Under ``-n 2 --dist loadgroup``: a file's tests run on one worker (its module fixtures once), and the files
    that launch multi-rank jobs as processes (with timeouts, heartbeats, kills: tests/faults, and tests/distributed
    or unit files that start ``loom train --nproc-per-node``) share one group, so two of them never share the 2
    cores; the in-process rank pools (``run_jobs``) and single-process files run beside them."""
    path = item.nodeid.split("::")[0]
    source = item.path.read_text()
    if path.startswith("tests/faults/"):
        return "launches"
    if path.startswith("tests/distributed/") and LAUNCHES.search(source):
        return "launches"
    if re.search(r"--nproc-per-node|torchrun", source):
        return "launches"
    return path


def pytest_collection_modifyitems(config, items):
    """Leave out ``exhaustive`` and ``slow`` tests unless asked for by option or named by ``-m``; group the tests
    for pytest-xdist (``xdist_group``)."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item)))
    markexpr = config.getoption("markexpr") or ""
    left_out = [m for m in ("exhaustive", "slow") if not config.getoption(f"--{m}") and m not in markexpr]
    keep, drop = [], []
    for item in items:
        (drop if any(item.get_closest_marker(m) for m in left_out) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _descendants(root: int) -> dict[int, str]:
    """Live (not zombie) processes below ``root``, by pid, with their command lines (Linux ``/proc``)."""
    parent, cmd = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd[int(entry)] = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            parent[int(entry)] = int(fields[1])
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = cmd.get(child, "?")
                frontier.append(child)
    return found


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# helpers that live for the session by design: multiprocessing's resource tracker, Inductor's compile workers and
# wandb's service (one per process, reused by the next wandb.init: killing it breaks the next tracker test)
SESSION_HELPERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "compile_worker",
    "wandb-core",
)


def _outside_pools(procs: dict[int, str]) -> dict[int, str]:
    """Leave the session's gloo rank pools and long-lived helpers (and what they started) alone."""
    from tests.distributed.harness import pool_pids

    keep = set()
    for pid in pool_pids() | {p for p, c in procs.items() if any(h in c for h in SESSION_HELPERS)}:
        # the fork server's children are test ranks (tests/distributed/harness.py): kept only while pooled
        keep |= {pid} if "multiprocessing.forkserver" in procs.get(pid, "") else {pid, *_descendants(pid)}
    return {p: c for p, c in procs.items() if p not in keep}


@pytest.fixture(autouse=True)
def _no_process_left_behind(request):
    """A process the test started and left running is killed when the test ends, pass or fail, and reported."""
    if not sys.platform.startswith("linux"):
        yield
        return
    before = set(_descendants(os.getpid()))
    yield
    left = _outside_pools({p: c for p, c in _descendants(os.getpid()).items() if p not in before})
    if left:
        _kill(left)
        print(
            f"\n{request.node.nodeid} left {len(left)} process(es) running, killed: "
            + "; ".join(f"{p} {c[:120]}" for p, c in left.items()),
            file=sys.stderr,
        )


# what a launcher sets: a test whose code under test sets one (init_distributed does) must not hand a world of 8
# to whichever test its xdist worker runs next
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


@pytest.fixture(autouse=True)
def _launch_env_restored():
    """The launcher variables are as they were before the test, whatever the test or the code it ran set."""
    before = {k: os.environ.get(k) for k in LAUNCH_VARS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def pytest_sessionfinish(session, exitstatus):
    """The rank pools stop; any process still below this one is killed, and the run fails if there was one; so
    does a file or folder a test left in the repository (tests write under their temporary folders)."""
    from tests.distributed.harness import close_pools

    close_pools()
    before = getattr(session.config, "_loom_untracked", None)
    after = _untracked() if before is not None else None
    if after is not None and after - before:
        print(
            "\nfiles a test left in the repository (tests write under tmp_path): "
            + ", ".join(sorted(after - before)),
            file=sys.stderr,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not sys.platform.startswith("linux"):
        return
    left = _outside_pools(_descendants(os.getpid()))
    if left:
        _kill(left)
        print(
            "\nprocesses left at the end of the session, killed: "
            + "; ".join(f"{p} {c[:120]}" for p, c in left.items()),
            file=sys.stderr,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def cli_error(capsys):
    """``cli_error(*argv)``: ``loom argv`` in this process, expecting a user error; returns its one stderr line
    (exit 2, printed once). Each command keeps one subprocess test (tests/unit/test_cli_commands.py); error cases
    run here, without a process start (~4 s) each."""
    from loom.cli.main import main

    def run(*argv) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            main([str(a) for a in argv])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("loom: error: "), (
            exc.value.code,
            err,
        )
        return err[0]

    return run


@pytest.fixture
def tiny(tmp_path):
    """``tiny(**overrides)``: the tiny run's ``Config``, writing under ``tmp_path`` (``run/`` and ``cache/``)."""

    def make(**overrides):
        return tiny_config(tmp_path / "run", tmp_path / "cache", **overrides)

    return make


@pytest.fixture(autouse=True)
def _fresh_compile_caches(request):
    """A GPU test starts with dynamo's caches empty: the compiled blocks' code objects are shared by every model in
    the process, so the guards earlier tests left (other shapes and dtypes) would count towards the recompile limit,
    which fullgraph compiles turn into a hard failure."""
    if request.node.get_closest_marker("gpu") is not None:
        import torch

        torch._dynamo.reset()
    yield
