"""Hangs: collective timeouts, monitored barriers and the watcher thread that answers another rank's hang
(docs/operations.md: Collective timeouts, the flight recorder and hang reports). The recorder's dumps are
loom.runtime.flight_recorder's, the report that names the stuck ranks loom.runtime.hang_report's.

Every rank keeps PyTorch's flight recorder: a ring of its last collectives with their sequence numbers, per
process group (NCCL on GPUs, gloo on the CPU). On a GPU, NCCL's watchdog writes every rank's ring to
``<run.dir>/flight_recorder/rank_<r>`` when a collective times out, and the next start (or ``python -m
loom.runtime.hang_report RUN_DIR``) reads them. On gloo a timeout raises on the ranks that waited; they signal
every rank through the job's store, each rank's watcher thread answers with its ring and its Python stack, and one
of them writes the report: ``<run.dir>/hang_report.txt`` (and ``.json``) and a one-line summary on the console.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import socket
import sys
import threading
import time
import traceback
import uuid
from datetime import timedelta

from loom.config.errors import TrainingStopped, UserError
from loom.runtime.flight_recorder import (
    FR_ENTRIES,
    FR_FOLDER,
    FR_PREFIX,
    dump_flight_recorder,
    summarize_dump,
)
from loom.runtime.hang_report import REPORT, build_report, report_from_dumps, write_report

STARTUP_TIMEOUT_S = 1800.0  # start-up (rank 0 tokenizing, the resume, compiling) waits at least this long
POLL_S = (
    1.0  # how often a rank's watcher looks for a hang signal in the store (per 1024 ranks: the store's load)
)
ANSWER_S = 15.0  # how long the reporting rank waits for the others' answers
EXIT_HANG = 1


class CollectiveTimeout(TrainingStopped):
    """A collective timed out (or a monitored barrier was missed): the run stops with the report's one line."""


# ---- before the process group forms ------------------------------------------------------------------------


def process_env(
    run_dir: str, device_type: str, distributed_debug: str = "OFF", comm_timing: bool = False
) -> dict[str, str]:
    """The variables that must be set before the process group forms: the flight recorder's size (gloo and
    NCCL collectives; PyTorch 2.9 renamed TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE to
    TORCH_FR_BUFFER_SIZE and TORCH_FR_DUMP_TEMP_FILE and warns about the old names), NCCL's dump on timeout into
    the run dir, its watchdog's monitor, and (``comm_timing``) CUDA-event timing of every NCCL collective, which
    the straggler figures read."""
    env = {"TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES)}
    if device_type == "cuda":
        prefix = os.path.join(os.path.abspath(run_dir), FR_FOLDER, FR_PREFIX)
        env.update(
            {
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_FR_DUMP_TEMP_FILE": prefix,
                "TORCH_NCCL_ENABLE_MONITORING": "1",
            }
        )
        if comm_timing:
            env["TORCH_NCCL_ENABLE_TIMING"] = "1"
    if distributed_debug != "OFF":
        env["TORCH_DISTRIBUTED_DEBUG"] = distributed_debug
    return env


def prepare_process(
    run_dir: str, device_kind: str, distributed_debug: str = "OFF", comm_timing: bool = False
) -> None:
    """Set ``process_env``'s variables (a value already in the environment wins, except TORCH_DISTRIBUTED_DEBUG
    when the config asks for a level) and create the dump folder; call before ``init_distributed``."""
    import torch

    device_type = (
        "cuda" if device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available()) else "cpu"
    )
    for key, value in process_env(run_dir, device_type, distributed_debug, comm_timing).items():
        if key == "TORCH_DISTRIBUTED_DEBUG":
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    if distributed_debug != "OFF":
        import torch.distributed as dist

        dist.set_debug_level_from_env()  # torch.distributed read it at import


def startup_timeout(timeout_s: float) -> timedelta:
    """The process group's timeout until training starts: at least STARTUP_TIMEOUT_S."""
    return timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))


def set_timeouts(seconds: float) -> int:
    """``seconds`` as the timeout of every process group this rank belongs to (the default group, the meshes'
    groups, side groups); returns how many were set."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return 0
    done = 0
    for pg in list(c10d._world.pg_map):
        try:
            c10d._set_pg_timeout(timedelta(seconds=seconds), pg)
            done += 1
        except (ValueError, RuntimeError, AssertionError):  # not a member, or a backend without timeouts
            pass
    return done


# ---- what one rank knows ---------------------------------------------------------------------------------------


def main_stack(limit: int = 8) -> list[str]:
    """The main thread's innermost ``limit`` Python frames, ``path:line in function``, innermost last."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return _frames(traceback.extract_stack(frame), limit)


def error_stack(err: BaseException, limit: int = 8) -> list[str]:
    """Where ``err`` was raised (the collective that failed), innermost last."""
    return _frames(traceback.extract_tb(err.__traceback__), limit)


def _frames(summary, limit: int) -> list[str]:
    return [f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in summary][-limit:]


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/loom/", "/tests/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1 :] if marker != "/site-packages/" else path[i + len(marker) :]
    return path


def previous_hang(run_dir: str) -> str | None:
    """Rank 0 at start-up: the report of dumps newer than the last report (an attempt that hung, e.g. before a
    restart), written and returned as its line; None when there is nothing new."""
    folder = os.path.join(run_dir, FR_FOLDER)
    last = os.path.join(run_dir, REPORT + ".json")
    # a rank that timed out late answers after the report is written: its dump belongs to that report
    since = os.path.getmtime(last) + 2 * ANSWER_S + 5 if os.path.exists(last) else 0.0
    report = report_from_dumps(run_dir, since) if os.path.isdir(folder) else None
    if report is None:
        return None
    return report.line(write_report(run_dir, report))


def is_collective_failure(err: BaseException) -> bool:
    """A collective that timed out or lost a peer (gloo's and NCCL's messages), or a missed monitored barrier."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        s in text
        for s in (
            "Timed out waiting",
            "timed out",
            "Timeout",
            "monitoredBarrier",
            "Connection closed by peer",
            "Connection reset by peer",
            "DistBackendError",
        )
    )


# ---- one rank's part ------------------------------------------------------------------------------------------


class Health:
    """One rank's hang handling: monitored barriers, the timeouts, the watcher that answers a hang signal, and
    the report. A single process (or no process group) has none of it."""

    def __init__(self, env, timeout_s: float, run_dir: str, step=lambda: None):
        import torch.distributed as dist

        self.env, self.timeout_s, self.run_dir, self._step = env, timeout_s, run_dir, step
        self.phase = "start-up"
        self.enabled = env.world_size > 1 and dist.is_initialized()
        self.group = None
        self._handling = False
        self._stop = threading.Event()
        self._thread = None
        if env.is_main:  # dumps NCCL's watchdog wrote when an earlier attempt hung (e.g. before a restart)
            line = previous_hang(run_dir)
            if line:
                print(f"loom: the previous attempt in this run dir hung: {line}", flush=True)
        if not self.enabled:
            return
        os.makedirs(os.path.join(run_dir, FR_FOLDER), exist_ok=True)  # where NCCL's watchdog dumps
        from torch.distributed import distributed_c10d as c10d

        token = env.share_from_main(
            uuid.uuid4().hex[:12]
        )  # this start's keys (a store may outlive a restart)
        self.store = dist.PrefixStore(f"loom_health/{token}/", c10d._get_default_store())
        # monitored_barrier needs gloo: the default group where it is gloo, else a gloo side group
        self.group = (
            None
            if dist.get_backend() == "gloo"
            else dist.new_group(backend="gloo", timeout=startup_timeout(timeout_s))
        )
        self._thread = threading.Thread(target=self._watch, name="loom-health", daemon=True)
        self._thread.start()

    # ---- used by the trainer ----
    def barrier(self, what: str = "checkpoint", timeout_s: float | None = None) -> None:
        """A barrier that names the ranks that never arrived (``monitored_barrier``); a miss is a hang report."""
        if not self.enabled:
            return
        import torch.distributed as dist

        # before training (the checkpoint manager's start, the resume): the start-up timeout
        if timeout_s is None:
            timeout_s = (
                self.timeout_s
                if self.phase != "start-up"
                else startup_timeout(self.timeout_s).total_seconds()
            )
        with self.watch(what):
            dist.monitored_barrier(
                group=self.group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True
            )

    def start_barrier(self) -> None:
        """Every rank is built and about to train (the start-up timeout)."""
        self.barrier("start-up", startup_timeout(self.timeout_s).total_seconds())

    def start_training(self) -> None:
        """From here on every collective waits at most parallel.timeout_s."""
        self.phase = "training"
        if self.enabled:
            set_timeouts(self.timeout_s)

    @property
    def step(self) -> int | None:
        with contextlib.suppress(Exception):
            return self._step()
        return None

    def is_hang(self, err: BaseException) -> bool:
        """Whether ``err`` is a collective's timeout (or lost peer) that the hang report explains."""
        # a user error is never a hang, whatever its text says (a reward function's "TimeoutError: timed out")
        return (
            self.enabled and not isinstance(err, (TrainingStopped, UserError)) and is_collective_failure(err)
        )

    @contextlib.contextmanager
    def watch(self, phase: str | None = None):
        """Inside: a collective that times out becomes the hang report and a ``CollectiveTimeout``."""
        before = self.phase
        if phase:
            self.phase = phase
        try:
            yield
        except RuntimeError as err:
            if self.is_hang(err):
                raise self.hang(err) from None
            raise
        finally:
            self.phase = before

    def close(self) -> None:
        """Stop the watcher and wait for it: it must not be inside a store call while the group is torn down."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * POLL_S)

    # ---- the hang ----
    def _key(self, *parts) -> str:
        return "/".join(map(str, parts))

    def answer(self, source: str, error: str = "", stack: list[str] | None = None) -> dict:
        """This rank's answer: where it is (step, phase, Python stack) and its flight recorder's last collectives;
        the whole dump goes to ``flight_recorder/rank_<r>``."""
        dump = None
        with contextlib.suppress(Exception):
            dump = dump_flight_recorder()
        if dump is not None:
            with contextlib.suppress(OSError):
                folder = os.path.join(self.run_dir, FR_FOLDER)
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, f"{FR_PREFIX}{self.env.rank}"), "wb") as fh:
                    pickle.dump(dump, fh)
        info = {
            "rank": self.env.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "source": source,
            "step": self.step,
            "phase": self.phase,
            "error": error,
            "stack": stack or main_stack(),
            "groups": summarize_dump(dump),
        }
        self.store.set(self._key("answer", self.env.rank), json.dumps(info, default=str))
        return info

    def hang(self, err: BaseException) -> CollectiveTimeout:
        """On a rank whose collective failed: signal every rank, answer, and (the first such rank) gather the
        answers and write the report; every such rank stops with its line."""
        self._handling = True
        error = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        line = f"collective timeout on rank {self.env.rank}: {error}"
        try:
            self.store.set(self._key("signal"), json.dumps({"rank": self.env.rank, "error": error}))
            self.store.set(self._key("detected", self.env.rank), "1")
            self.answer("timed out", error, error_stack(err))
            if self.store.add(self._key("reporter"), 1) == 1:
                answers = self._gather_answers()
                detected = [r for r in range(self.env.world_size) if self._has(self._key("detected", r))]
                report = build_report(answers, self.env.world_size, detected, error)
                line = report.line(write_report(self.run_dir, report))
                self.store.set(self._key("report"), line)
                if answers.get(0) is None:  # rank 0 prints the stop line; here it cannot
                    print(f"loom: stopped: {line}", file=sys.stderr, flush=True)
            else:
                line = self._wait_for(self._key("report"), ANSWER_S + 5) or line
        except Exception as store_err:  # the store is gone too: the error itself is all there is
            line += f" (no report: {type(store_err).__name__}: {store_err})"
        return CollectiveTimeout(line)

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def _wait_for(self, key: str, seconds: float) -> str | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._has(key):
                return self.store.get(key).decode()
            time.sleep(0.1)
        return None

    def _gather_answers(self) -> dict[int, dict | None]:
        answers: dict[int, dict | None] = {}
        deadline = time.monotonic() + ANSWER_S
        for r in range(self.env.world_size):
            text = self._wait_for(self._key("answer", r), max(0.0, deadline - time.monotonic()))
            answers[r] = json.loads(text) if text else None
        return answers

    def _watch(self) -> None:
        """The watcher thread: when another rank signals a hang, answer it; if this rank's own code is not
        handling one, wait for the report and end the process (its main thread is stuck)."""
        while not self._stop.wait(POLL_S * max(1, self.env.world_size // 1024)):
            if not self._has(self._key("signal")):
                continue
            if self._handling:
                return
            try:
                self.answer("answered the signal (not in a timed-out collective)")
                line = self._wait_for(self._key("report"), ANSWER_S + 5)
            except Exception:
                line = None
            if self._handling or self._stop.is_set():
                return  # this rank's own collective failed meanwhile: its main thread reports and stops
            if self.env.rank == 0:
                print(
                    f"loom: stopped: {line or 'another rank reported a collective timeout'}",
                    file=sys.stderr,
                    flush=True,
                )
            sys.stdout.flush()
            os._exit(EXIT_HANG)
