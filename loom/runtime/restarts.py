"""Restarts of a job under PyTorch's elastic agent (``loom train --max-restarts N``, ``--nnodes MIN:MAX``, or
``torchrun --max-restarts N -m loom.train``): what a restarted attempt resumes from, and the record of every
restart in ``<run.dir>/restarts.jsonl``.

When a worker fails, the agent stops the whole worker group and starts it again (up to ``--max-restarts`` times);
when nodes join or leave an elastic job, it does the same without counting a restart. The new workers know only
their environment (``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``), so a restarted attempt resumes from
the newest complete checkpoint of the lineage the launch's first attempt trained, whatever ``checkpoint.resume``
says (``none`` would refuse the run's own checkpoints, a path would go back to where the launch began).

``restarts.jsonl`` holds one JSON object per line, ``event`` saying which:

* ``start``: rank 0 of a launch's first attempt (written where restarts can happen): run id, world size, the
  checkpoint lineage and the step it starts from;
* ``failure``: ``loom train``'s agent, each node's, when its workers fail: every failed rank's exit code, signal
  and error (from the error file each worker writes as it raises), and whether the group restarts;
* ``membership``: ``loom train``'s agent on node 0, when nodes wait to join (``--max-restarts`` does not count it);
* ``restart``: rank 0 of every later attempt: its index, the cause (the agents' records since the previous
  attempt began; under plain torchrun, this node's error files of the previous attempt), the world size and the
  step it resumed from. Its index also appears as ``restarts`` in every metrics.jsonl record of that attempt.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass, field

from loom.config.errors import ConfigError, UserError

RESTARTS = "restarts.jsonl"
ELASTIC_ENV = "LOOM_ELASTIC_NODES"  # "MIN:MAX", set by loom train for its agent's workers when MIN < MAX
_PEER_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "connection reset",
    "Broken pipe",
    "ECONNRESET",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
    "Socket Timeout",
)


# ---- the log ---------------------------------------------------------------------------------------------


def append(run_dir: str, record: dict) -> None:
    """One line at the end of ``<run_dir>/restarts.jsonl`` (written whole: several nodes' agents may append)."""
    line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **record}) + "\n"
    fd = os.open(os.path.join(run_dir, RESTARTS), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def read(run_dir: str) -> list[dict]:
    """The records of ``<run_dir>/restarts.jsonl``; a line cut by a kill is skipped."""
    out = []
    try:
        with open(os.path.join(run_dir, RESTARTS)) as fh:
            for line in fh:
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if isinstance(rec, dict) and "event" in rec:
                        out.append(rec)
    except FileNotFoundError:
        pass
    return out


# ---- a worker's attempt ----------------------------------------------------------------------------------


@dataclass
class Attempt:
    """This attempt of a launch, as rank 0 read it from the environment and restarts.jsonl."""

    run_id: str
    index: int  # restarts before this attempt in this launch (0: the first attempt)
    restart_count: int  # TORCHELASTIC_RESTART_COUNT: the agent's count of failure restarts
    max_restarts: int
    lineage: str | None = None  # the first attempt's checkpoint lineage (None: unknown)
    previous_world: int | None = None  # the world size of the attempt before (None: unknown)
    cause: str = ""  # one line: why the previous attempt ended
    failures: list = field(
        default_factory=list
    )  # the agents' failure entries since the previous attempt began

    @property
    def restarted(self) -> bool:
        return self.index > 0


def this_attempt(run_dir: str, environ=None) -> Attempt | None:
    """This process's attempt (rank 0 reads restarts.jsonl); None where no elastic agent can restart it: not
    launched by one, or neither --max-restarts nor an elastic node count."""
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return None
    count = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    max_restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    records = [r for r in read(run_dir) if r.get("run_id") == run_id]
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    launch = records[starts[-1] :] if starts else []  # this launch's records, its start first
    # a membership change restarts the group without counting: loom's agent says so before it restarts
    membership = bool(records) and records[-1]["event"] == "membership"
    restarted = count > 0 or (membership and bool(launch))
    if not restarted and max_restarts == 0 and not env.get(ELASTIC_ENV):
        return None
    if not restarted:
        return Attempt(run_id, 0, count, max_restarts)
    index = sum(1 for r in launch if r["event"] in ("start", "restart"))
    since = next(
        (i for i in range(len(records) - 1, -1, -1) if records[i]["event"] in ("start", "restart")), -1
    )
    agents = records[since + 1 :]
    # the failures of the attempt that ended (an agent on another node may append late, after a restart began)
    ended = [r for r in agents if r["event"] == "failure" and r.get("restart_count") == count - 1] or [
        r for r in agents if r["event"] == "failure"
    ]
    failures = [f for r in ended for f in r.get("failures", [])]
    if failures:
        cause = describe_failures(failures)
    elif any(r["event"] == "membership" for r in agents):
        waiting = max(r.get("nodes_waiting", 0) for r in agents if r["event"] == "membership")
        cause = f"membership change: {waiting} node(s) waiting to join"
    else:
        cause = previous_errors(env.get("TORCHELASTIC_ERROR_FILE", ""), count)
    lineage = launch[0].get("lineage") if launch else None
    previous = records[since].get("world_size") if since >= 0 else None
    return Attempt(
        run_id,
        max(index, 1),
        count,
        max_restarts,
        lineage=lineage,
        previous_world=previous,
        cause=cause,
        failures=failures,
    )


def restart_checkpoint(attempt: Attempt | None, checkpointer) -> str | None:
    """On a restart, the newest complete checkpoint of the launch's lineage (its lineage set on
    ``checkpointer``); None otherwise, and where there is none yet (then ``checkpoint.resume`` decides). Every rank
    calls this with the same ``attempt`` (rank 0's)."""
    if attempt is None or not attempt.restarted or not attempt.lineage:
        return None
    before = checkpointer.lineage
    checkpointer.lineage = attempt.lineage
    folder = checkpointer.latest()  # rank 0 looks and verifies; every rank gets its answer
    if folder is None:
        checkpointer.lineage = before
    return folder


def begin(
    attempt: Attempt | None, run_dir: str, *, step: int, world_size: int, lineage: str | None, is_main: bool
) -> None:
    """Rank 0 records this attempt (``start`` or ``restart``) and, on a restart, prints one line."""
    if attempt is None or not is_main:
        return
    rec = {
        "event": "restart" if attempt.restarted else "start",
        "run_id": attempt.run_id,
        "restart": attempt.index,
        "restart_count": attempt.restart_count,
        "max_restarts": attempt.max_restarts,
        "world_size": world_size,
        "nodes": _nodes(),
        "host": socket.gethostname(),
        "step": step,
        "lineage": lineage,
    }
    if attempt.restarted:
        rec.update(cause=attempt.cause, previous_world_size=attempt.previous_world)
    append(run_dir, rec)
    if attempt.restarted:
        where = (
            f"resumed from step {step}" if step else "no checkpoint of this run yet: started over at step 1"
        )
        ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
        if attempt.previous_world not in (None, world_size):
            ranks += f" (was {attempt.previous_world}: re-formed)"
        print(
            f"loom: restart {attempt.index} (--max-restarts {attempt.max_restarts}, {attempt.restart_count} "
            f"used): {attempt.cause}; {where} on {ranks}",
            flush=True,
        )


def metrics_fields(attempt: Attempt | None) -> dict:
    """What a metrics.jsonl record of this attempt carries: ``restarts`` after a restart, nothing before."""
    return {"restarts": attempt.index} if attempt is not None and attempt.restarted else {}


def _nodes() -> int | None:
    nodes = os.environ.get("GROUP_WORLD_SIZE")
    return int(nodes) if nodes and nodes.isdecimal() else None


def describe_failures(failures: list[dict]) -> str:
    """One line for failed workers: the first cause (a signal other than SIGTERM, which the agent sends to stop a
    group, else an error that is not a lost connection to a peer, else the earliest) and how many failed with it."""

    def rank(f):  # a signal other than the agent's SIGTERM, then an error of its own, then the rest
        peer = any(p.lower() in (f.get("error") or "").lower() for p in _PEER_ERRORS)
        signal, error = f.get("signal"), f.get("error")
        first = 0 if signal and signal != "SIGTERM" else 1 if error and not peer else 2
        return (first, f.get("timestamp", 0), f.get("rank") or 0)

    first, *rest = sorted(failures, key=rank)
    text = describe_failure(first)
    return text + (f" ({len(rest)} other rank{'s' if len(rest) > 1 else ''} failed with it)" if rest else "")


def describe_failure(f: dict) -> str:
    who = f"rank {f['rank']}" if f.get("rank") is not None else f"local rank {f.get('local_rank')}"
    where = ", ".join(
        x
        for x in (f"pid {f['pid']}" if f.get("pid") else "", f"host {f['host']}" if f.get("host") else "")
        if x
    )
    where = f" ({where})" if where else ""
    error = (f.get("error") or "").strip().splitlines()
    signal = f.get("signal")
    if signal and (signal != "SIGTERM" or not error):  # SIGTERM after an error: the agent stopping the group
        return f"{who}{where} was killed by {signal}"
    what = f": {error[-1][:200]}" if error else ""
    if any(p.lower() in what.lower() for p in _PEER_ERRORS):
        what = f": a peer was lost (a worker or its node){what}"
    code = f"exit code {f['exitcode']}" if f.get("exitcode") is not None and not signal else "failed"
    return f"{who}{where} {code}{what}"


def previous_errors(error_file: str, count: int) -> str:
    """Under plain torchrun: this node's error files of the previous attempt (torch's log folder keeps one per
    local rank, ``.../attempt_<n>/<local rank>/error.json``), as one line."""
    unknown = (
        "the previous attempt's cause is unknown here (no worker of this node left an error: a signal such "
        "as SIGKILL or the OOM killer, or another node's failure; the agent's log names it)"
    )
    if not error_file or count < 1:
        return unknown
    attempt_dir = os.path.dirname(os.path.dirname(error_file))
    previous = os.path.join(os.path.dirname(attempt_dir), f"attempt_{count - 1}")
    failures = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(previous), key=lambda n: (not n.isdecimal(), n.zfill(8))):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                with open(os.path.join(previous, name, "error.json")) as fh:
                    data = json.load(fh)
                message, timestamp = _error_message(data)
                rank = (
                    data["message"].get("extraInfo", {}).get("rank")
                    if isinstance(data["message"], dict)
                    else None
                )
                failures.append(
                    {
                        "rank": rank,
                        "local_rank": int(name),
                        "error": message,
                        "timestamp": timestamp,
                        "host": socket.gethostname(),
                    }
                )
    return describe_failures(failures) if failures else unknown


def _error_message(data) -> tuple[str, int]:
    """(message, timestamp) of an error file in torch elastic's format (``ErrorHandler.record_exception``)."""
    message = data.get("message", "") if isinstance(data, dict) else ""
    if isinstance(message, dict):
        return str(message.get("message", "")), int(message.get("extraInfo", {}).get("timestamp", 0) or 0)
    if message == "<NONE>":  # torch's placeholder where a worker left no error file
        message = ""
    return str(message), int(data.get("timestamp", 0) or 0) if isinstance(data, dict) else 0


def record_error(err: BaseException) -> None:
    """A worker that raises writes its error where its agent reads it (``TORCHELASTIC_ERROR_FILE``, torch
    elastic's format): the agent's failure record and the next attempt name it. Call inside ``except``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or isinstance(err, (KeyboardInterrupt, SystemExit)):
        return
    import traceback

    user = isinstance(err, (ConfigError, UserError))
    data = {
        "message": {
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {
                "py_callstack": "" if user else traceback.format_exc(),
                "timestamp": str(int(time.time())),
                "rank": int(os.environ.get("RANK", "0")),
            },
        }
    }
    with contextlib.suppress(OSError):
        with open(path, "w") as fh:
            json.dump(data, fh)


# ---- loom train's agent ----------------------------------------------------------------------------------


def user_stop(failures: list[dict]) -> bool:
    """Whether the workers stopped on purpose: a user error (exit code 2: config, files, disk space) or a run that
    stopped itself (non-finite steps), which a restart would meet again. The others may show as SIGTERM: torch's
    agent stops a group's remaining workers with it as soon as one has failed."""

    def deliberate(f):
        return f.get("exitcode") == 2 or (f.get("error") or "").startswith("TrainingStopped")

    return any(deliberate(f) for f in failures) and all(
        deliberate(f) or f.get("signal") == "SIGTERM" for f in failures
    )


def failure_entries(failures, host: str) -> list[dict]:
    """torch elastic's ``{global rank: ProcessFailure}`` as records."""
    out = []
    for rank, f in sorted(failures.items()):
        message, timestamp = _error_message(getattr(f, "error_file_data", {}) or {})
        signal = f.signal_name() if f.exitcode < 0 else None
        out.append(
            {
                "rank": rank,
                "local_rank": f.local_rank,
                "pid": f.pid,
                "host": host,
                "exitcode": f.exitcode,
                "signal": signal
                if signal and signal != "<N/A>"
                else (f"signal {-f.exitcode}" if f.exitcode < 0 else None),
                "error": message or None,
                "timestamp": timestamp or int(getattr(f, "timestamp", 0) or 0),
            }
        )
    return out


@contextlib.contextmanager
def recording_agent(run_dir: str):
    """While inside, torch's launcher (``torch.distributed.run.run``) builds an agent that records its workers'
    failures and membership restarts in ``<run_dir>/restarts.jsonl`` and does not restart a group whose workers
    all stopped on purpose (``user_stop``). torch's launcher takes no agent class: it builds the agent by the
    module-level name ``LocalElasticAgent``, which is swapped here for this process only."""
    import torch.distributed.launcher.api as launcher

    base = launcher.LocalElasticAgent

    class RecordingAgent(base):
        """torch's local agent, recording each failed or re-formed worker group (see ``recording_agent``)."""

        _loom_failed = False

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                with contextlib.suppress(Exception):  # the record must never stop the agent from restarting
                    self._loom_record_failure(result, worker_group)
            return result

        def _loom_record_failure(self, result, worker_group) -> None:
            spec, host = worker_group.spec, socket.gethostname()
            failures = failure_entries(result.failures, host)
            stop = user_stop(failures)
            restarting = self._remaining_restarts > 0 and not stop
            append(
                run_dir,
                {
                    "event": "failure",
                    "run_id": spec.rdzv_handler.get_run_id(),
                    "node": worker_group.group_rank,
                    "host": host,
                    "restart_count": spec.max_restarts - self._remaining_restarts,
                    "max_restarts": spec.max_restarts,
                    "failures": failures,
                    "restarting": restarting,
                },
            )
            if stop:
                self._remaining_restarts = (
                    0  # the group fails now: loom train's launcher says why in one line
                )
            self._loom_failed = True

        def _restart_workers(self, worker_group):
            if not self._loom_failed and worker_group.group_rank == 0:  # nodes wait to join: one record
                with contextlib.suppress(Exception):
                    append(
                        run_dir,
                        {
                            "event": "membership",
                            "run_id": worker_group.spec.rdzv_handler.get_run_id(),
                            "host": socket.gethostname(),
                            "nodes": worker_group.group_world_size,
                            "nodes_waiting": worker_group.spec.rdzv_handler.num_nodes_waiting(),
                        },
                    )
            self._loom_failed = False
            super()._restart_workers(worker_group)

    launcher.LocalElasticAgent = RecordingAgent
    try:
        yield
    finally:
        launcher.LocalElasticAgent = base
