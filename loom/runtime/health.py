"""Hangs: collective timeouts, PyTorch's flight recorder, monitored barriers and the report that names the stuck
ranks (docs/operations.md: Collective timeouts, the flight recorder and hang reports).

Every rank keeps PyTorch's flight recorder: a ring of its last collectives with their sequence numbers, per
process group (NCCL on GPUs, gloo on the CPU). On a GPU, NCCL's watchdog writes every rank's ring to
``<run.dir>/flight_recorder/rank_<r>`` when a collective times out, and the next start (or ``python -m
loom.runtime.health RUN_DIR``) reads them. On gloo a timeout raises on the ranks that waited; they signal
every rank through the job's store, each rank's watcher thread answers with its ring and its Python stack, and one
of them writes the report: ``<run.dir>/hang_report.txt`` (and ``.json``) and a one-line summary on the console.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from loom.config.errors import TrainingStopped

STARTUP_TIMEOUT_S = 1800.0  # start-up (rank 0 tokenizing, the resume, compiling) waits at least this long
FR_FOLDER = "flight_recorder"
FR_PREFIX = "rank_"  # the dump of rank r is <run.dir>/flight_recorder/rank_<r> (torch's analyzer reads this layout)
FR_ENTRIES = 20000  # collectives each rank's flight recorder keeps
REPORT = "hang_report"  # <run.dir>/hang_report.txt and .json
POLL_S = 1.0  # how often a rank's watcher looks for a hang signal in the store (per 1024 ranks: the store's load)
ANSWER_S = 15.0  # how long the reporting rank waits for the others' answers
EXIT_HANG = 1


class CollectiveTimeout(TrainingStopped):
    """A collective timed out (or a monitored barrier was missed): the run stops with the report's one line."""


# ---- before the process group forms ------------------------------------------------------------------------

def process_env(run_dir: str, device_type: str, distributed_debug: str = "OFF",
                comm_timing: bool = False) -> dict[str, str]:
    """The variables that must be set before the process group forms: the flight recorder's size (gloo and
    NCCL collectives; PyTorch 2.9 renamed TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_NCCL_DEBUG_INFO_TEMP_FILE to
    TORCH_FR_BUFFER_SIZE and TORCH_FR_DUMP_TEMP_FILE and warns about the old names), NCCL's dump on timeout into
    the run dir, its watchdog's monitor, and (``comm_timing``) CUDA-event timing of every NCCL collective, which
    the straggler figures read."""
    env = {"TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES)}
    if device_type == "cuda":
        prefix = os.path.join(os.path.abspath(run_dir), FR_FOLDER, FR_PREFIX)
        env.update({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
                    "TORCH_NCCL_ENABLE_MONITORING": "1"})
        if comm_timing:
            env["TORCH_NCCL_ENABLE_TIMING"] = "1"
    if distributed_debug != "OFF":
        env["TORCH_DISTRIBUTED_DEBUG"] = distributed_debug
    return env


def prepare_process(run_dir: str, device_kind: str, distributed_debug: str = "OFF", comm_timing: bool = False) -> None:
    """Set ``process_env``'s variables (a value already in the environment wins, except TORCH_DISTRIBUTED_DEBUG
    when the config asks for a level) and create the dump folder; call before ``init_distributed``."""
    import torch

    device_type = "cuda" if device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available()) else "cpu"
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

def dump_flight_recorder() -> dict | None:
    """This process's flight recorder (NCCL's on CUDA builds, merged with the CPU one that gloo feeds), or None
    where this PyTorch has none."""
    import torch

    c10d = torch._C._distributed_c10d
    merged = None
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            try:
                raw = fn(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            except TypeError:  # a build whose binding takes no arguments
                raw = fn()
            dump = pickle.loads(raw)
        except Exception:  # no recorder of this kind in this process
            continue
        if merged is None:
            merged = dump
        else:
            merged["entries"] = list(merged.get("entries", [])) + list(dump.get("entries", []))
            merged.setdefault("pg_config", {}).update(dump.get("pg_config", {}))
            merged.setdefault("pg_status", {}).update(dump.get("pg_status", {}))
    return merged


def summarize_dump(dump: dict | None, last: int = 4) -> dict[str, dict]:
    """Per process group of a flight-recorder dump: its description, member ranks (when recorded), last
    enqueued / completed sequence numbers, its ``last`` collectives (sequence number, op, sizes, state) and its
    ``last`` point-to-point ops (a pipeline's sends and receives: shown, not compared)."""
    if not dump:
        return {}
    groups: dict[str, dict] = {}
    config = dump.get("pg_config") or {}
    status = dump.get("pg_status") or {}
    for e in dump.get("entries") or []:
        name, desc = (tuple(e.get("process_group") or ("?", "?")) + ("?",))[:2]
        g = groups.setdefault(str(name), {"desc": desc, "ranks": None, "collectives": {}, "p2p": {}})
        p2p = bool(e.get("is_p2p"))
        seq = int(e.get("p2p_seq_id" if p2p else "collective_seq_id", 0))
        g["p2p" if p2p else "collectives"][seq] = {
            "seq": seq, "op": _op_name(e.get("profiling_name")), "sizes": e.get("input_sizes"),
            "dtypes": e.get("input_dtypes"), "state": e.get("state"), "duration_ms": e.get("duration_ms")}
    for name, g in groups.items():
        for kind in ("collectives", "p2p"):
            g[kind] = [g[kind][seq] for seq in sorted(g[kind])][-last:]
        cfg = config.get(name) or next((c for c in config.values() if c.get("desc") == g["desc"]), None)
        if cfg and cfg.get("ranks"):
            try:
                g["ranks"] = [int(r) for r in str(cfg["ranks"]).strip("[]").split(",") if r.strip()]
            except ValueError:
                g["ranks"] = None
        st = status.get(name) or {}
        g["last_enqueued"] = st.get("last_enqueued_collective", g["collectives"][-1]["seq"] if g["collectives"] else 0)
        g["last_completed"] = st.get("last_completed_collective")
    return groups


def _op_name(profiling_name) -> str:
    """``nccl:all_reduce`` -> ``all_reduce``."""
    return str(profiling_name or "?").split(":", 1)[-1]


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


def _where(stack: list[str]) -> str:
    """The innermost frame, and the innermost of loom's own when that is another one."""
    own = next((f for f in reversed(stack) if f.startswith("loom/")), None)
    return stack[-1] + (f", called from {own}" if own and own != stack[-1] else "")


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/loom/", "/tests/"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1:] if marker != "/site-packages/" else path[i + len(marker):]
    return path


# ---- the report ------------------------------------------------------------------------------------------------

@dataclass
class Finding:
    """One process group where the ranks disagree: ``behind`` never joined collective ``seq`` (``op``) that
    ``waiting`` were in, or (``desync``) the ranks issued different collectives under one sequence number."""
    group: str
    desc: str
    seq: int
    op: str
    waiting: list[int]
    behind: dict[int, str]  # rank -> its last collective on this group ("broadcast #56", "none")
    desync: bool = False


@dataclass
class HangReport:
    world: int
    stuck: list[int]
    silent: list[int]  # ranks that did not answer (dead, or stuck holding the interpreter)
    findings: list[Finding]
    ranks: dict[int, dict] = field(default_factory=dict)  # each rank's answer
    detected_by: list[int] = field(default_factory=list)
    error: str = ""

    def line(self, where: str = "") -> str:
        """The console's one line."""
        text = "collective timeout: "
        if self.findings:
            f = self.findings[0]
            who = _ranks(list(f.behind))
            if f.op == BARRIER:
                text += (f"rank{_s(f.behind)} {who} never reached the monitored barrier ({f.desc}) that "
                         f"rank{_s(f.waiting)} {_ranks(f.waiting)} waited at")
            elif f.desync:
                text += (f"rank{_s(f.behind)} {who} issued another collective than rank{_s(f.waiting)} "
                         f"{_ranks(f.waiting)} at #{f.seq} ({f.op}) on group {f.desc}")
            else:
                lasts = "; ".join(f"rank {r}'s last: {last}" for r, last in list(f.behind.items())[:3])
                text += (f"rank{_s(f.behind)} {who} never joined {f.op} #{f.seq} on group {f.desc}, which "
                         f"rank{_s(f.waiting)} {_ranks(f.waiting)} waited in ({lasts})")
            extra = [r for r in self.silent if r not in f.behind]
            if extra:
                text += f"; no answer from rank{_s(extra)} {_ranks(extra)}"
        elif self.silent:
            text += f"no answer from rank{_s(self.silent)} {_ranks(self.silent)} (dead, or stuck holding Python)"
        else:
            text += f"every rank reached the same collective; {self.error or 'see the report'}"
        stuck = [r for r in self.stuck if r in self.ranks and self.ranks[r].get("stack")]
        if stuck:
            r = stuck[0]
            info = self.ranks[r]
            after = f" (after step {info['step']})" if info.get("step") is not None else ""
            text += f"; rank {r}{after} is in {_where(info['stack'])}"
        return text + (f"; report {where}" if where else "")

    def text(self) -> str:
        """The report file: the summary, then each rank's answer."""
        out = [self.line(), "", f"world {self.world}; stuck: {_ranks(self.stuck) or 'none named'}; "
               f"detected by rank(s) {_ranks(self.detected_by) or '?'}"]
        if self.error:
            out.append(f"error: {self.error}")
        for f in self.findings:
            kind = "desync" if f.desync else "hang"
            out.append(f"{kind} on group {f.desc} ({f.group}): collective #{f.seq} {f.op}; waiting: "
                       f"{_ranks(f.waiting)}; " + ", ".join(f"rank {r}: {v}" for r, v in f.behind.items()))
        for r in range(self.world):
            info = self.ranks.get(r)
            out.append("")
            if info is None:
                out.append(f"rank {r}: no answer")
                continue
            out.append(f"rank {r} ({info.get('host', '?')}, pid {info.get('pid', '?')}): {info.get('source', '?')}, "
                       f"after step {info.get('step')}, {info.get('phase', '')}" +
                       (f"; error: {info['error']}" if info.get("error") else ""))
            for name, g in sorted((info.get("groups") or {}).items()):
                colls = ", ".join(f"#{c['seq']} {c['op']} {c['sizes']} {c['state']}" for c in g["collectives"])
                out.append(f"  group {g['desc']} ({name}): last enqueued #{g.get('last_enqueued')}: {colls}")
                if g.get("p2p"):
                    out.append("    point-to-point: " + ", ".join(f"#{c['seq']} {c['op']} {c['sizes']} {c['state']}"
                                                                 for c in g["p2p"]))
            for frame in info.get("stack") or []:
                out.append(f"  at {frame}")
        out += ["", "Flight-recorder dumps (where written): flight_recorder/rank_<r>; PyTorch's analyzer of NCCL's "
                "dumps: python -m torch.distributed.flight_recorder.fr_trace <run.dir>/flight_recorder --prefix rank_ "
                "(python -m loom.runtime.health <run.dir> appends its output here)"]
        return "\n".join(out) + "\n"

    def to_json(self) -> dict:
        d = asdict(self)
        d["ranks"] = {str(k): v for k, v in self.ranks.items()}
        return d


def _s(ranks) -> str:
    return "s" if len(ranks) > 1 else ""


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks[:16])) + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")


BARRIER = "monitored barrier"
_MISSED = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def build_report(answers: dict[int, dict | None], world: int, detected_by: list[int] | None = None,
                 error: str = "") -> HangReport:
    """Compare every rank's last collectives per process group (``answers[r]["groups"]``, as
    ``summarize_dump`` makes them; None: rank r did not answer) and name the ranks the others waited for; a
    monitored barrier's error (in ``error`` or a rank's answer) names the ranks that never reached it."""
    silent = sorted(r for r in range(world) if answers.get(r) is None)
    findings: list[Finding] = []
    missed: set[int] = set()
    for text in [error] + [(a or {}).get("error") or "" for a in answers.values()]:
        m = _MISSED.search(text)
        if m:
            missed |= {int(r) for r in re.findall(r"\d+", m.group(1))}
    if missed:
        phase = next((a.get("phase") for a in answers.values() if a and a.get("error")), None) or "?"
        findings.append(Finding(BARRIER, phase, 0, BARRIER, sorted(r for r, a in answers.items()
                                                                  if a is not None and r not in missed),
                                {r: "no answer" if answers.get(r) is None else
                                 (_where(answers[r]["stack"]) if answers[r].get("stack") else "?")
                                 for r in sorted(missed)}))
    groups: dict[str, dict] = {}
    for r, info in answers.items():
        for name, g in ((info or {}).get("groups") or {}).items():
            entry = groups.setdefault(name, {"desc": g.get("desc"), "members": set(g.get("ranks") or []),
                                             "by_rank": {}})
            entry["by_rank"][r] = g
    for name, entry in groups.items():
        by_rank = entry["by_rank"]
        seqs = {r: int(g.get("last_enqueued") or 0) for r, g in by_rank.items()}
        top = max(seqs.values())
        waiting = sorted(r for r, s in seqs.items() if s == top)
        op = _coll_at(by_rank[waiting[0]], top)
        members = entry["members"] or set(by_rank)
        behind = {r: _last_of(by_rank[r]) for r, s in sorted(seqs.items()) if s < top}
        behind.update({r: "no answer" for r in sorted(members) if r not in by_rank and r in silent})
        if behind:
            findings.append(Finding(name, entry["desc"], top, op["op"] if op else "?", waiting, behind))
            continue
        sigs = {r: _signature(_coll_at(by_rank[r], top)) for r in waiting}
        if len(set(sigs.values())) > 1:  # one sequence number, different collectives: a desync
            counts: dict = {}
            for s in sigs.values():
                counts[s] = counts.get(s, 0) + 1
            major = max(counts, key=lambda s: (counts[s], s == sigs[waiting[0]]))
            odd = {r: f"{s[0]} {s[1]}" for r, s in sigs.items() if s != major}
            findings.append(Finding(name, entry["desc"], top, f"{major[0]} {major[1]}",
                                    sorted(r for r, s in sigs.items() if s == major), odd, desync=True))
    detected = sorted(detected_by or [])
    # the group where the detecting ranks waited first, then hangs before desyncs, then the furthest collective
    findings.sort(key=lambda f: (f.op != BARRIER, not set(f.waiting) & set(detected), f.desync, -f.seq))
    stuck = sorted({r for f in findings for r in f.behind} | set(silent))
    return HangReport(world, stuck, silent, findings, {r: a for r, a in answers.items() if a is not None},
                      detected, error)


def _coll_at(g: dict, seq: int) -> dict | None:
    for c in reversed(g.get("collectives") or []):
        if c["seq"] == seq:
            return c
    return None


def _last_of(g: dict) -> str:
    colls = g.get("collectives") or []
    if not colls:
        return "none"
    c = colls[-1]
    return f"{c['op']} #{c['seq']}"


def _signature(c: dict | None) -> tuple:
    if c is None:
        return ("?", "")
    return (c["op"], json.dumps(c.get("sizes")))


def write_report(run_dir: str, report: HangReport) -> str:
    """``hang_report.txt`` and ``.json`` in the run dir; returns the text file's path."""
    path = os.path.join(run_dir, REPORT + ".txt")
    with open(path, "w") as fh:
        fh.write(report.text().replace(report.line(), report.line(path), 1))
    with open(os.path.join(run_dir, REPORT + ".json"), "w") as fh:
        json.dump(report.to_json(), fh, indent=1, default=str)
    return path


def read_dumps(folder: str, since: float = 0.0) -> dict[int, dict]:
    """The flight-recorder dumps ``rank_<r>`` in ``folder`` written at or after ``since`` (a time.time()),
    as ``{rank: dump}`` (unreadable files are skipped)."""
    out = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in names:
        rank = name[len(FR_PREFIX):]
        path = os.path.join(folder, name)
        if not (name.startswith(FR_PREFIX) and rank.isdecimal()) or os.path.getmtime(path) < since:
            continue
        try:
            with open(path, "rb") as fh:
                out[int(rank)] = pickle.load(fh)
        except Exception:
            continue
    return out


def report_from_dumps(run_dir: str, since: float = 0.0, world: int | None = None) -> HangReport | None:
    """The report from the dumps NCCL's watchdog wrote (``TORCH_NCCL_DUMP_ON_TIMEOUT``), or None without any."""
    dumps = read_dumps(os.path.join(run_dir, FR_FOLDER), since)
    if not dumps:
        return None
    answers = {r: {"rank": r, "source": "flight-recorder dump", "groups": summarize_dump(d)}
               for r, d in dumps.items()}
    if world is None:
        members = [r for a in answers.values() for g in a["groups"].values() for r in (g.get("ranks") or [])]
        world = max([*answers, *members]) + 1
    return build_report(answers, world, error=f"from the flight-recorder dumps in {os.path.join(run_dir, FR_FOLDER)}")


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
    return isinstance(err, RuntimeError) and any(s in text for s in (
        "Timed out waiting", "timed out", "Timeout", "monitoredBarrier", "Connection closed by peer",
        "Connection reset by peer", "DistBackendError"))


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

        token = env.share_from_main(uuid.uuid4().hex[:12])  # this start's keys (a store may outlive a restart)
        self.store = dist.PrefixStore(f"loom_health/{token}/", c10d._get_default_store())
        # monitored_barrier needs gloo: the default group where it is gloo, else a gloo side group
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo",
                                                                              timeout=startup_timeout(timeout_s))
        self._thread = threading.Thread(target=self._watch, name="loom-health", daemon=True)
        self._thread.start()

    # ---- used by the trainer ----
    def barrier(self, what: str = "checkpoint", timeout_s: float | None = None) -> None:
        """A barrier that names the ranks that never arrived (``monitored_barrier``); a miss is a hang report."""
        if not self.enabled:
            return
        import torch.distributed as dist

        if timeout_s is None:  # before training (the checkpoint manager's start, the resume): the start-up timeout
            timeout_s = self.timeout_s if self.phase != "start-up" else startup_timeout(self.timeout_s).total_seconds()
        with self.watch(what):
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)

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
        return self.enabled and not isinstance(err, TrainingStopped) and is_collective_failure(err)

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
        info = {"rank": self.env.rank, "host": socket.gethostname(), "pid": os.getpid(), "source": source,
                "step": self.step, "phase": self.phase, "error": error, "stack": stack or main_stack(),
                "groups": summarize_dump(dump)}
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
                print(f"loom: stopped: {line or 'another rank reported a collective timeout'}", file=sys.stderr,
                      flush=True)
            sys.stdout.flush()
            os._exit(EXIT_HANG)


def analyzer_text(folder: str, timeout_s: float = 300.0) -> str:
    """PyTorch's own analyzer (``torch.distributed.flight_recorder.fr_trace``) on the dumps in ``folder``: its
    output, or why there is none. It reads NCCL's dumps; gloo's (PyTorch 2.13) lack the group names it needs."""
    import subprocess

    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", folder, "--prefix",
                               FR_PREFIX], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"PyTorch's analyzer did not run: {err}"
    text = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        last = text.splitlines()[-1] if text else f"exit code {proc.returncode}"
        return f"PyTorch's analyzer could not read these dumps: {last}"
    return "PyTorch's analyzer (torch.distributed.flight_recorder):\n" + "\n".join(text.splitlines()[-200:])


def _main(argv: list[str]) -> int:
    """``python -m loom.runtime.health RUN_DIR``: the report from the flight-recorder dumps in RUN_DIR, with
    PyTorch's analyzer's output appended."""
    if len(argv) != 1:
        print("usage: python -m loom.runtime.health RUN_DIR", file=sys.stderr)
        return 2
    report = report_from_dumps(argv[0])
    if report is None:
        print(f"no flight-recorder dumps in {os.path.join(argv[0], FR_FOLDER)}", file=sys.stderr)
        return 1
    path = write_report(argv[0], report)
    with open(path, "a") as fh:
        fh.write("\n" + analyzer_text(os.path.join(argv[0], FR_FOLDER)) + "\n")
    with open(path) as fh:
        print(fh.read(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


__all__ = ["CollectiveTimeout", "Health", "HangReport", "Finding", "build_report", "summarize_dump", "process_env",
           "prepare_process", "startup_timeout", "set_timeouts", "report_from_dumps", "previous_hang",
           "is_collective_failure", "dump_flight_recorder", "read_dumps", "write_report"]
