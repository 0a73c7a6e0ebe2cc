"""Drives one faulted run: ``loom train`` started again and again in one run dir, each attempt SIGKILLed where
a seeded ``random.Random`` says, until one finishes; then it is checked against an uninterrupted reference run
with the same arguments.

Kinds of kill (``Kill.kind``; the first four are sent from outside, the rest are ``tests.faults.inject``'s
kill points, reached for the ``n``-th time inside the trainer):

* ``startup``      ``at`` seconds after the start (imports, the lock, data, leftovers, the resume)
* ``step``         ``at`` seconds after the attempt printed step ``n`` (in the next step, or in its save)
* ``save_window``  ``at`` seconds after the ``n``-th new ``.step_N.tmp`` folder appeared
* ``prepare``      once the token cache being written holds ``at`` bytes (data preparation)
* ``shard``, ``marker``, ``rename``, ``renamed``, ``deleting``, ``rmtree``, ``cache_commit``

After every attempt: each ``step_N`` folder verifies (sizes and hashes) and carries the run's lineage; what a
kill may leave (``.step_N.tmp``, ``.step_N.deleting``, token-cache temporaries) is gone once the next attempt
has started; that attempt prints ``resumed from step N`` for the newest complete checkpoint of the lineage at
the time of the kill (or starts at step 1 when there was none); every metrics record any attempt wrote equals
the reference's record of its step bit for bit; no token file is described as complete unless it is. At the
end: metrics.jsonl holds each step once; the two newest checkpoints are kept, with shards bitwise equal to the
reference's; the token cache equals the reference's.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from loom.checkpoint.manager import CorruptCheckpoint, file_digest, marker_lineage, step_dir_name, verify
from loom.data.token_file import TEMP_TAG, meta_path
from tests.faults.inject import descendants, kill_tree
from tests.unit.test_checkpoint_recovery import LOOM, comparable, env, resumed_from, train_args
from tests.unit.test_reliability import alive

AUTOLOAD = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "autoload"
)  # its sitecustomize arms kill points
EVERY, KEEP = 2, 2
STALL_S = 180  # an attempt that prints nothing for this long is hung (a busy machine stays far below it)
OUTSIDE = ("startup", "step", "save_window", "prepare")
_STEP_DIR = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^\.step_\d+\.(tmp|deleting)$")


@dataclass(frozen=True)
class Variant:
    name: str
    nproc: int = 1
    async_save: bool = False
    steps: int = 16
    kills: int = 10
    prepare_kills: int = 1  # the first kills land in data preparation: the run starts with an empty cache
    seed: int = 0
    plan: tuple[str, ...] = ()  # a group of kinds (GROUPS) per kill; empty: prepare kills first, then any


@dataclass
class Kill:
    kind: str
    n: int = 1
    at: float = 0.0

    def __str__(self) -> str:
        if self.kind == "startup":
            return f"startup +{self.at:.2f}s"
        if self.kind == "step":
            return f"step {self.n} +{self.at:.2f}s"
        if self.kind == "save_window":
            return f"save_window tmp #{self.n} +{self.at:.3f}s"
        if self.kind == "prepare":
            return f"prepare at {int(self.at):,} bytes"
        return f"{self.kind} #{self.n}"


@dataclass
class Timing:
    """Seconds to the first step line and per step (the latest attempt's that showed them); token cache bytes."""

    startup_s: float
    step_s: float
    cache_bytes: int

    def update(self, a: Attempt) -> None:
        if a.first_step_s is not None:
            self.startup_s = a.first_step_s
        if a.step_s is not None:
            self.step_s = a.step_s


@dataclass
class Attempt:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    first_step_s: float | None = None
    step_s: float | None = None
    note: str = ""
    hung: bool = False

    @property
    def started(self) -> bool:
        """Whether it got past the checkpoint manager's start (leftovers removed, resume chosen)."""
        return self.rc == 0 or "resumed from step " in self.stdout or _first_step(self.stdout) is not None


@dataclass
class Report:
    test: str
    seed: int
    kills_wanted: int
    nproc: int
    async_save: bool
    steps: int
    kills: int = 0
    kills_by_kind: dict = field(default_factory=dict)
    resumes: int = 0
    fresh_starts: int = 0
    attempts: int = 0
    mismatches: int = 0  # metrics records (any attempt's) not bitwise equal to the reference
    wrong_resumes: int = 0
    corrupt_checkpoints: int = 0
    leftovers_kept: int = 0
    duplicate_steps: int = 0
    hangs: int = 0
    seconds: float = 0.0
    problems: list = field(default_factory=list)
    log: list = field(default_factory=list)

    def line(self) -> str:
        kinds = ",".join(f"{k}={v}" for k, v in sorted(self.kills_by_kind.items()))
        return (
            f"faults {self.test}: seed {self.seed}, {self.kills} kills ({kinds}), {self.resumes} resumes, "
            f"{self.fresh_starts} fresh starts, {self.attempts} attempts, {self.mismatches} mismatches, "
            f"{self.wrong_resumes} wrong resumes, {self.corrupt_checkpoints} corrupt checkpoints, "
            f"{self.leftovers_kept} leftovers kept, {self.duplicate_steps} duplicate steps, {self.hangs} hangs, "
            f"{len(self.problems)} problems, {self.seconds:.0f} s"
        )

    def write(self) -> None:
        """The summary line and one line per attempt to stdout; the counts to LOOM_FAULTS_REPORT if set."""
        print("\n".join([self.line(), *self.log]), flush=True)
        path = os.environ.get("LOOM_FAULTS_REPORT")
        if path:
            with open(path, "a") as fh:
                fh.write(json.dumps({k: v for k, v in asdict(self).items() if k != "log"}) + "\n")

    def failure(self) -> str:
        return "\n".join(
            [
                self.line(),
                f"replay: LOOM_FAULTS_SEED={self.seed} LOOM_FAULTS_KILLS={self.kills_wanted} "
                "(kill points replay exactly; timed kills land where the machine's speed puts them)",
                "problems:",
                *self.problems[:20],
                "attempts:",
                *self.log,
            ]
        )


# ---- running attempts ---------------------------------------------------------------------------------
def run_args(run_dir: str, cache: str, v: Variant) -> list[str]:
    args = train_args(
        run_dir,
        cache,
        **{
            "training.steps": v.steps,
            "checkpoint.every": EVERY,
            "checkpoint.keep": KEEP,
            "checkpoint.resume": "auto",
            "checkpoint.async_save": str(v.async_save).lower(),
        },
    )
    return (["--nproc-per-node", str(v.nproc)] if v.nproc > 1 else []) + args


def _first_step(stdout: str) -> int | None:
    for line in stdout.splitlines():
        if line.startswith("step "):
            return int(line.split()[1].split("/")[0])
    return None


class _Subreaper:
    """While active, orphans of our children (the workers of a killed launcher) become our children, and are
    reaped here; this machine's init may not reap them, and a zombie looks alive to anything that asks by pid
    (the token cache's stale-temporary cleanup does)."""

    def __init__(self):
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl

    def __enter__(self):
        self._prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        return self

    def __exit__(self, *exc):
        self._prctl(36, 0, 0, 0, 0)

    @staticmethod
    def reap(pids) -> None:
        deadline = time.monotonic() + 60
        for pid in pids:
            while time.monotonic() < deadline:
                try:
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        break
                except ChildProcessError:  # not ours (reaped already, or parented elsewhere)
                    if not alive(pid):
                        break
                time.sleep(0.02)


class _Watch:
    """Reads the attempt's stdout as it grows (step lines and their times) and says when an outside kill is due."""

    def __init__(self, kill: Kill | None, out_path: str, ckpt_dir: str, cache: str, started: float):
        self.kill, self.ckpt_dir, self.cache, self.started = kill, ckpt_dir, cache, started
        self._out, self._partial = open(out_path), ""
        self.step_times: list[tuple[int, float]] = []  # (step, when its line appeared)
        self.old_tmp = {
            e for e in _entries(ckpt_dir) if e[0].endswith(".tmp")
        }  # a kill's leftovers, not saves
        self.new_tmp: set = set()
        self.seen_at: float | None = None
        self.note = ""

    def read(self, now: float) -> None:
        self._partial += self._out.read()
        *lines, self._partial = self._partial.split("\n")
        self.step_times += [
            (int(line.split()[1].split("/")[0]), now) for line in lines if line.startswith("step ")
        ]

    def due(self, now: float) -> bool:
        k = self.kill
        if k is None or k.kind not in OUTSIDE:
            return False
        if k.kind == "startup":
            return now - self.started >= k.at
        if k.kind == "step":
            reached = [t for step, t in self.step_times if step >= k.n]
            return bool(reached) and now - reached[0] >= k.at
        if k.kind == "save_window":
            if self.seen_at is None:
                self.new_tmp |= {e for e in _entries(self.ckpt_dir) if e[0].endswith(".tmp")} - self.old_tmp
                if len(self.new_tmp) >= k.n:
                    self.seen_at = now
            return self.seen_at is not None and now - self.seen_at >= k.at
        if any(
            n.endswith(".bin") and os.path.isfile(meta_path(os.path.join(self.cache, n)))
            for n in _names(self.cache)
        ):
            self.note = "the cache was complete before the threshold: killed after data preparation"
            return True
        return any(_size(os.path.join(self.cache, n)) >= k.at for n in _names(self.cache) if TEMP_TAG in n)

    def timings(self) -> tuple[float | None, float | None]:
        """Seconds to the first step line, and per step after it (None where not seen)."""
        t = self.step_times
        first = t[0][1] - self.started if t else None
        per_step = (t[-1][1] - t[0][1]) / (t[-1][0] - t[0][0]) if len(t) > 1 and t[-1][0] > t[0][0] else None
        return first, per_step

    def close(self) -> None:
        self._out.close()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return -1


def _names(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _entries(folder: str) -> set[tuple[str, int]]:
    """(name, inode) of a folder's entries: a leftover still there after a start has the same inode."""
    out = set()
    for name in _names(folder):
        try:
            out.add((name, os.stat(os.path.join(folder, name)).st_ino))
        except FileNotFoundError:
            pass
    return out


def run_attempt(cmd: list[str], kill: Kill | None, ckpt_dir: str, cache: str, logs: str) -> Attempt:
    """Run ``cmd`` (its output in ``logs``.out / .err) until it exits, ``kill`` takes the whole run down, or it
    prints nothing for STALL_S (then it is killed and ``hung``)."""
    e = env()
    e["PYTHONPATH"] = AUTOLOAD + os.pathsep + e["PYTHONPATH"]
    e.pop("LOOM_FAULT", None)
    if kill is not None and kill.kind not in OUTSIDE:
        e["LOOM_FAULT"] = f"{kill.kind}:{kill.n}"
    out_path, err_path = logs + ".out", logs + ".err"
    with _Subreaper() as reaper, open(out_path, "w") as out, open(err_path, "w") as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=e, stdout=out, stderr=err, start_new_session=True)
        watch, family, looked, hung = _Watch(kill, out_path, ckpt_dir, cache, t0), set(), 0.0, False
        output, output_at = 0, t0
        try:
            while proc.poll() is None:
                now = time.monotonic()
                watch.read(now)
                if now - looked > 0.25:  # the workers, to reap them if a kill point in one takes the run down
                    family, looked = family | set(descendants(proc.pid)), now
                    if _size(out_path) + _size(err_path) != output:
                        output, output_at = _size(out_path) + _size(err_path), now
                if watch.due(now) or now - output_at > STALL_S:
                    hung = now - output_at > STALL_S
                    family |= set(kill_tree(proc.pid))
                    break
                time.sleep(0.005)
        finally:
            rc = proc.wait()
            reaper.reap(sorted(family - {proc.pid}))
            watch.read(time.monotonic())
            watch.close()
        seconds = time.monotonic() - t0
    with open(out_path) as o, open(err_path) as r:
        return Attempt(rc, o.read(), r.read(), seconds, *watch.timings(), watch.note, hung)


# ---- the reference -------------------------------------------------------------------------------
def reference_run(run_dir: str, cache: str, v: Variant) -> tuple[dict[int, tuple], Timing, dict]:
    """An uninterrupted run: (its record of each step, its timings, the shard hashes of its last checkpoint)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    a = run_attempt(
        [sys.executable, "-c", LOOM, "train", *run_args(run_dir, cache, v)],
        None,
        ckpt_dir,
        cache,
        run_dir + "-log",
    )
    assert a.rc == 0, (
        f"the reference run {'hung' if a.hung else 'failed'}:\n{a.stdout[-2000:]}\n{a.stderr[-3000:]}"
    )
    recs = _records(os.path.join(run_dir, "metrics.jsonl"))[0]
    assert [r[0] for r in recs] == list(range(1, v.steps + 1)), recs
    (cache_file,) = [n for n in _names(cache) if n.endswith(".bin")]
    timing = Timing(a.first_step_s or 5.0, a.step_s or 0.2, os.path.getsize(os.path.join(cache, cache_file)))
    return {r[0]: r for r in recs}, timing, _shard_hashes(os.path.join(ckpt_dir, step_dir_name(v.steps)))


def _shard_hashes(folder: str) -> dict:
    files = verify(folder)["files"]
    return {n: f["blake2b"] for n, f in files.items() if n.endswith(".distcp")}


def _records(path: str) -> tuple[list[tuple], int]:
    """The comparable records of a metrics file, and how many lines were not records (cut short by a kill)."""
    recs, partial = [], 0
    with open(path) as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:
                partial += 1
                continue
            recs.append(comparable([rec])[0])
    return recs, partial


# ---- choosing the next kill ------------------------------------------------------------------------
GROUPS = {
    "prepare": ("prepare", "prepare", "prepare", "cache_commit"),  # mostly mid-tokenization
    "save": ("shard", "marker", "rename", "renamed"),  # kill points: each lands where it is aimed
    "retention": ("deleting", "rmtree"),
    "any": (
        "startup",
        "step",
        "step",
        "step",
        "save_window",
        "shard",
        "marker",
        "rename",
        "renamed",
        "deleting",
        "rmtree",
    ),
}


def choose_kill(
    rng: random.Random, v: Variant, timing: Timing, start: int, complete: int, group: str
) -> Kill:
    """A kill of ``group`` for an attempt that resumes at ``start`` with ``complete`` checkpoints of the lineage.
    Aimed at most 6 steps or 2 saves ahead, so that a run lasts for many kills."""
    saves = (v.steps - start) // EVERY
    removals = max(0, complete + saves - KEEP)  # retention renames this many folders before the run ends
    if group == "any" and not saves:
        kinds = ["startup"]  # nothing left to train: a resumed run that only starts and stops
    else:
        kinds = [k for k in GROUPS[group] if removals or k not in GROUPS["retention"]] or list(GROUPS["save"])
    kind = rng.choice(kinds)
    if kind == "prepare":
        return Kill(kind, at=rng.uniform(0.02, 0.98) * timing.cache_bytes)
    if kind == "startup":
        return Kill(kind, at=rng.uniform(0.0, timing.startup_s))
    if kind == "step":
        return Kill(
            kind, start + rng.randint(1, min(6, v.steps - start)), rng.uniform(0.0, 1.5 * timing.step_s)
        )
    if kind == "cache_commit":
        return Kill(kind, 1)
    n = rng.randint(1, max(1, min(2, removals if kind in GROUPS["retention"] else saves)))
    return Kill(kind, n, rng.uniform(0.0, 0.3) if kind == "save_window" else 0.0)


# ---- checks ----------------------------------------------------------------------------------------
class FaultedRun:
    """One run dir killed ``kills`` times (then left to finish), checked after every attempt and at the end."""

    def __init__(
        self,
        v: Variant,
        seed: int,
        kills: int,
        root: str,
        cache: str,
        reference: dict[int, tuple],
        timing: Timing,
        ref_shards: dict,
        ref_cache: str,
    ):
        self.v, self.seed, self.kills_wanted = v, seed, kills
        self.run_dir = os.path.join(root, "run")
        os.makedirs(root, exist_ok=True)
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")
        self.root, self.cache = root, cache
        self.reference, self.ref_shards, self.ref_cache = reference, ref_shards, ref_cache
        self.timing = replace(timing)  # updated from each attempt; the reference's stays
        self.rng = random.Random(seed)
        self.lineage: str | None = None
        self.report = Report(v.name, seed, kills, v.nproc, v.async_save, v.steps)
        self.bad_records: set = set()
        self.corrupt: set = set()  # (name, inode) of corrupt step folders, counted once

    def problem(self, text: str) -> None:
        self.report.problems.append(text)

    def cmd(self) -> list[str]:
        return [sys.executable, "-c", LOOM, "train", *run_args(self.run_dir, self.cache, self.v)]

    def cache_ready(self) -> bool:
        return any(
            n.endswith(".bin") and os.path.isfile(meta_path(os.path.join(self.cache, n)))
            for n in _names(self.cache)
        )

    def inspect(self, where: str) -> tuple[int | None, int, set]:
        """Check the checkpoint folder: (newest complete step of the lineage, complete count, leftovers)."""
        complete, leftovers = [], set()
        for name, ino in sorted(_entries(self.ckpt_dir)):
            folder = os.path.join(self.ckpt_dir, name)
            m = _STEP_DIR.match(name)
            if _LEFTOVER.match(name):
                leftovers.add((name, ino))
            elif m:
                try:
                    verify(folder)
                except CorruptCheckpoint as err:
                    if (name, ino) not in self.corrupt:
                        self.corrupt.add((name, ino))
                        self.report.corrupt_checkpoints += 1
                        self.problem(f"{where}: a corrupt checkpoint folder: {err}")
                    continue
                lineage = marker_lineage(folder)
                if self.lineage is None:
                    self.lineage = lineage
                if lineage != self.lineage:
                    self.problem(f"{where}: {name} has lineage {lineage}, the run's is {self.lineage}")
                    continue
                complete.append(int(m.group(1)))
            else:
                self.problem(f"{where}: unexpected entry {name} in {self.ckpt_dir}")
        return (max(complete) if complete else None), len(complete), leftovers

    def check_cache(self, where: str) -> set:
        """No token file is described as complete unless it is; returns the temporaries present."""
        temps = set()
        for name, ino in _entries(self.cache):
            path = os.path.join(self.cache, name)
            if TEMP_TAG in name:
                temps.add((name, ino))
            elif name.endswith(".bin.json"):
                with open(path) as fh:
                    meta = json.load(fh)
                size = os.path.getsize(path[: -len(".json")]) if os.path.exists(path[: -len(".json")]) else -1
                want = meta["tokens"] * (2 if meta["dtype"] == "uint16" else 4)
                if size != want:
                    self.problem(f"{where}: {name} describes {want} bytes, the token file has {size}")
        return temps

    def check_metrics(self, where: str) -> None:
        """Every record in every metrics file of the run dir equals the reference's record of its step."""
        for name in _names(self.run_dir):
            if not (name.startswith("metrics") and name.endswith(".jsonl")):
                continue
            for rec in _records(os.path.join(self.run_dir, name))[0]:
                if rec != self.reference.get(rec[0]) and (name, rec) not in self.bad_records:
                    self.bad_records.add((name, rec))
                    self.report.mismatches += 1
                    self.problem(
                        f"{where}: {name} step {rec[0]}: {rec} != reference {self.reference.get(rec[0])}"
                    )

    def check_start(self, a: Attempt, where: str, expected: int | None, leftovers: set, temps: set) -> None:
        """The attempt resumed from ``expected`` (None: a fresh start at step 1) and removed the leftovers."""
        if "resumed from step " in a.stdout:
            got = resumed_from(a.stdout)
            self.report.resumes += 1
            if got != expected:
                self.report.wrong_resumes += 1
                self.problem(
                    f"{where}: resumed from step {got}, the newest complete checkpoint was {expected}"
                )
        elif a.started:
            self.report.fresh_starts += 1
            first = _first_step(a.stdout)
            if expected is not None or (first is not None and first != 1):
                self.report.wrong_resumes += 1
                self.problem(
                    f"{where}: started at step {first} without resuming; newest checkpoint {expected}"
                )
        if a.started:
            still = leftovers & _entries(self.ckpt_dir)
            if still:
                self.report.leftovers_kept += len(still)
                self.problem(f"{where}: leftovers of the kill still there after a start: {sorted(still)}")
        if self.cache_ready():
            still = temps & _entries(self.cache)
            if still:
                self.report.leftovers_kept += len(still)
                self.problem(f"{where}: token-cache temporaries of the kill still there: {sorted(still)}")

    def group(self, i: int, prepare_left: int) -> str:
        """The kinds kill ``i`` is drawn from: the variant's plan, else data preparation while the cache is
        being built and prepare kills are left, else any kind."""
        if self.v.plan:
            return self.v.plan[i % len(self.v.plan)]
        return "prepare" if prepare_left > 0 and not self.cache_ready() else "any"

    def run(self) -> Report:
        t0 = time.monotonic()
        expected, complete, leftovers = self.inspect("before the first attempt")
        temps: set = set()
        prepare_left = self.v.prepare_kills
        final = None
        for i in range(self.kills_wanted + 1):
            last = i == self.kills_wanted
            kill = (
                None
                if last
                else choose_kill(
                    self.rng, self.v, self.timing, expected or 0, complete, self.group(i, prepare_left)
                )
            )
            if kill is not None and kill.kind in GROUPS["prepare"]:
                prepare_left -= 1
            a = run_attempt(
                self.cmd(), kill, self.ckpt_dir, self.cache, os.path.join(self.root, f"attempt{i}")
            )
            self.timing.update(a)
            self.report.attempts += 1
            where = f"attempt {i} ({kill or 'no kill'})"
            killed = a.rc == -signal.SIGKILL and kill is not None
            self.check_start(a, where, expected, leftovers, temps)
            expected_before = expected
            expected, complete, leftovers = self.inspect(f"after {where}")
            temps = self.check_cache(f"after {where}")
            self.check_metrics(f"after {where}")
            resumed = resumed_from(a.stdout) if "resumed from step " in a.stdout else None
            self.report.log.append(
                f"  #{i} {kill or 'no kill'}: rc {a.rc}, {a.seconds:.1f}s, expected resume {expected_before}, "
                f"resumed {resumed}, last step {_last_step(a.stdout)}, now newest {expected}, "
                f"leftovers {sorted(n for n, _ in leftovers)}{', ' + a.note if a.note else ''}"
            )
            if a.hung:
                self.report.hangs += 1
                self.problem(
                    f"{where}: hung, no output for {STALL_S} s after {a.stdout.splitlines()[-1:]}; "
                    f"its output is in {self.root}/attempt{i}.out and .err"
                )
                break
            if killed and "saved step" in a.stdout:  # a worker outlived the kill and saved like a preemption
                self.problem(f"{where}: a process survived the SIGKILL: {a.stdout[-500:]}")
            if killed:
                self.report.kills += 1
                kind = kill.kind if kill else "?"
                self.report.kills_by_kind[kind] = self.report.kills_by_kind.get(kind, 0) + 1
                continue
            if a.rc != 0:
                self.problem(f"{where}: exit code {a.rc}: {a.stderr[-3000:]}")
                break
            final = a
            break
        if final is not None:
            self.check_end()
        elif not self.report.problems:
            self.problem("no attempt finished")
        self.report.seconds = time.monotonic() - t0
        return self.report

    def check_end(self) -> None:
        """The finished run against the reference: metrics, kept checkpoints, weights, token cache."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        recs, partial = _records(path)
        steps = [r[0] for r in recs]
        self.report.duplicate_steps = len(steps) - len(set(steps))
        if self.report.duplicate_steps or partial:
            self.problem(f"the final metrics.jsonl has steps {steps} and {partial} partial line(s)")
        last = {r[0]: r for r in recs}  # the last record of each step
        if sorted(last) != list(range(1, self.v.steps + 1)):
            self.problem(f"the final metrics.jsonl has steps {sorted(last)}")
        for step, rec in sorted(last.items()):
            if rec != self.reference.get(step) and (os.path.basename(path), rec) not in self.bad_records:
                self.report.mismatches += 1
                self.problem(f"final step {step}: {rec} != reference {self.reference.get(step)}")
        names = sorted(n for n, _ in _entries(self.ckpt_dir))
        want = [step_dir_name(self.v.steps - EVERY), step_dir_name(self.v.steps)]
        if names != want:
            self.problem(f"the run ended with {names} in {self.ckpt_dir}, expected {want}")
        final = os.path.join(self.ckpt_dir, step_dir_name(self.v.steps))
        if os.path.isdir(final) and _shard_hashes(final) != self.ref_shards:
            self.problem(
                f"{final}: shards differ from the reference's ({_shard_hashes(final)} != {self.ref_shards})"
            )
        usual = {".lock", "config.toml", "data_sources.json", "checkpoints", "metrics.jsonl"}
        other = [
            n for n in _names(self.run_dir) if n not in usual and not re.match(r"^metrics\.[\d-]+\.jsonl$", n)
        ]
        if other:  # noted, not failed: e.g. a metrics rewrite's temporary left by a kill
            self.report.log.append(f"  the run dir also holds {sorted(other)}")
        cache_names = sorted(_names(self.cache))
        if cache_names != sorted(_names(self.ref_cache)):
            self.problem(
                f"the token cache holds {cache_names}, the reference's {sorted(_names(self.ref_cache))}"
            )
        else:
            for n in cache_names:
                if n.endswith(".bin") and file_digest(os.path.join(self.cache, n)) != file_digest(
                    os.path.join(self.ref_cache, n)
                ):
                    self.problem(f"token cache {n} differs from the reference's")


def _last_step(stdout: str) -> int | None:
    steps = [int(line.split()[1].split("/")[0]) for line in stdout.splitlines() if line.startswith("step ")]
    return steps[-1] if steps else None


def settings(default_seed: int, default_kills: int) -> tuple[int, int]:
    """The seed and kill count: the test's, or LOOM_FAULTS_SEED / LOOM_FAULTS_KILLS to reproduce or widen."""
    return (
        int(os.environ.get("LOOM_FAULTS_SEED", default_seed)),
        int(os.environ.get("LOOM_FAULTS_KILLS", default_kills)),
    )
