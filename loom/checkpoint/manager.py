"""Sharded, atomic, resharding checkpoints on torch distributed checkpoint (DCP).

Layout of ``<checkpoint dir>``::

    step_00000100/            a complete checkpoint
        __0_0.distcp ...      DCP shards (model + optimizer), any number of ranks
        __0_hashes.json ...   each rank's sizes and hashes of the shards it wrote
        .metadata             DCP's index
        trainer_state.json    step, tokens, loader position, LR schedule, loss scale, RNG
        config.toml           the resolved config of the run that wrote it
        COMPLETE.json         written last: every file above with its size and blake2b hash
    .step_00000200.tmp/       being written (ignored; removed at the next start)
    .step_00000050.deleting/  being removed by retention (ignored)

A checkpoint becomes visible only by renaming its finished ``.tmp`` folder, after the marker is
in it. A kill at any point leaves the previous complete checkpoint untouched. A folder of the same
step left by an earlier run is moved aside and replaced at that rename.

Every run has a lineage: an id drawn at a fresh start, carried over on resume and written into each
marker. Retention only removes checkpoints of the current lineage; a fresh start in a folder that holds
checkpoints is refused unless ``checkpoint.overwrite`` moves them into ``superseded/<time>/``, and so is a resume from
an older checkpoint (a branch) where newer ones exist. A corrupt checkpoint that ``auto`` skips moves into
``corrupt/<time>/``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable

import torch
from torch.distributed.checkpoint import FileSystemWriter

from loom.config.errors import SharedError, UserError
from loom.config.sections import CheckpointConfig


def _quiet_dcp() -> None:
    """DCP warns on every single-process save/load even when told so (no_dist); it is the intended mode here.
    Set when a manager is made, not at import: an import inside ``warnings.catch_warnings`` (the CLI's
    precheck) would lose the filter when the block ends."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


_quiet_dcp()

MARKER = "COMPLETE.json"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_HASHES = "hashes.json"  # __<rank>_hashes.json: a rank's record of its shards


class CorruptCheckpoint(UserError):
    pass


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def file_digest(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def content_fingerprint(path: str) -> str:
    """A short hash of the weights a folder (or file) holds, by content, not by name: a loom checkpoint's marker
    already records every file's hash; in any other folder (a Hugging Face export, a PEFT adapter) each weight,
    config and tokenizer file is hashed. Re-exporting other weights to the same path changes it."""
    h = hashlib.blake2b(digest_size=8)
    if os.path.isfile(os.path.join(path, MARKER)):
        with open(os.path.join(path, MARKER), "rb") as fh:
            meta = json.loads(fh.read() or b"{}")
        h.update(json.dumps(meta.get("files") if isinstance(meta, dict) else meta, sort_keys=True).encode())
        return h.hexdigest()
    if os.path.isfile(path):
        names, root = [os.path.basename(path)], os.path.dirname(path)
    else:
        names, root = (
            sorted(
                n
                for n in os.listdir(path)
                if n.endswith((".safetensors", ".json", ".bin", ".pt", ".model", ".jinja", ".txt"))
            ),
            path,
        )
    for name in names:
        full = os.path.join(root, name)
        if os.path.isfile(full):
            h.update(f"{name}\0{os.path.getsize(full)}\0{file_digest(full)}\0".encode())
    return h.hexdigest()


def file_record(path: str) -> dict:
    return {"size": os.path.getsize(path), "blake2b": file_digest(path)}


def _write_synced(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: str) -> None:
    """Make a rename or removal in ``path`` durable (a power cut could otherwise undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hashed_by_writers(folder: str) -> dict:
    """The records ranks wrote for their own shards (``__<rank>_hashes.json``, see _HashingWriter)."""
    out = {}
    for name in os.listdir(folder):
        if name.startswith("__") and name.endswith("_" + _HASHES):
            with open(os.path.join(folder, name)) as fh:
                out.update(json.load(fh))
    return out


def write_marker(folder: str, step: int, lineage: str | None = None) -> None:
    """Write ``COMPLETE.json``: every file with its size and hash. Shards whose writer recorded them
    are not read again; everything else (DCP's .metadata, the small files) is hashed here."""
    recorded = _hashed_by_writers(folder)
    files = {}
    for root, _, names in os.walk(folder):
        for n in sorted(names):
            full = os.path.join(root, n)
            rel = os.path.relpath(full, folder)
            if rel in (MARKER, MARKER + ".partial"):
                continue
            rec = recorded.get(rel)
            files[rel] = (
                rec if rec is not None and rec["size"] == os.path.getsize(full) else file_record(full)
            )
    tmp = os.path.join(folder, MARKER + ".partial")
    _write_synced(tmp, json.dumps({"step": step, "lineage": lineage, "files": files}, indent=1))
    os.replace(tmp, os.path.join(folder, MARKER))


def _marker_files(folder: str, meta) -> dict:
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(i, dict) and isinstance(i.get("size"), int) and isinstance(i.get("blake2b"), str)
        for i in files.values()
    ):
        raise CorruptCheckpoint(
            f"checkpoint {folder}: unreadable {MARKER} (no file list with sizes and hashes)"
        )
    return files


def verify(folder: str, check_hash: bool = True) -> dict:
    """Raise CorruptCheckpoint naming the problem, or return the marker."""
    marker = os.path.join(folder, MARKER)
    if not os.path.isfile(marker):
        holds = (
            os.path.join(folder, "checkpoints")
            if os.path.isdir(os.path.join(folder, "checkpoints"))
            else folder
        )
        found = list_complete(holds) if os.path.isdir(holds) else []
        if found:  # a run dir or its checkpoint folder, not one checkpoint
            raise CorruptCheckpoint(
                f"checkpoint {folder} is not one checkpoint but a folder of them: give one of its step_N folders "
                f"(the newest complete: {found[-1][1]}), or resume that run's newest with --run.dir and "
                "--checkpoint.resume auto"
            )
        raise CorruptCheckpoint(f"checkpoint {folder} is incomplete: no {MARKER}")
    try:
        with open(marker) as fh:
            meta = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise CorruptCheckpoint(f"checkpoint {folder}: unreadable {MARKER} ({err})") from None
    files = _marker_files(folder, meta)
    if ".metadata" not in files:
        raise CorruptCheckpoint(f"checkpoint {folder}: {MARKER} lists no DCP .metadata file")
    for rel, info in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise CorruptCheckpoint(f"checkpoint {folder}: file {rel} is missing")
        size = os.path.getsize(path)
        if size != info["size"]:
            raise CorruptCheckpoint(
                f"checkpoint {folder}: file {rel} has {size} bytes, expected {info['size']} "
                "(truncated or overwritten)"
            )
        if check_hash and file_digest(path) != info["blake2b"]:
            raise CorruptCheckpoint(f"checkpoint {folder}: file {rel} does not match its recorded hash")
    return meta


def list_steps(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of every ``step_N`` folder, complete or not, oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in os.listdir(ckpt_dir):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(ckpt_dir, name)):
            out.append((int(m.group(1)), os.path.join(ckpt_dir, name)))
    return sorted(out)


def list_complete(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of folders that look complete (named step_N with a marker), oldest first."""
    return [(step, f) for step, f in list_steps(ckpt_dir) if os.path.isfile(os.path.join(f, MARKER))]


def marker_lineage(folder: str) -> str | None:
    """The lineage a checkpoint's marker names; None when unreadable or written before lineages existed."""
    try:
        with open(os.path.join(folder, MARKER)) as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return None
    return meta.get("lineage") if isinstance(meta, dict) else None


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(folder) for n in names)


# a write that found no room: a full disk, a full quota, a file size limit (ulimit -f)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFull(UserError):
    pass


def _disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` is, or wraps, a write that found no room: ENOSPC, or a quota or file size limit (EDQUOT,
    EFBIG) (DCP reports each rank's exception inside a CheckpointException)."""
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, OSError) and err.errno in NO_ROOM:
            return True
        failures = getattr(err, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict) and any(
            _disk_full(f[0] if isinstance(f, tuple) else f) for f in failures.values()
        ):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _single_process() -> bool:
    """No process group: DCP runs in one process (said explicitly, so it does not warn)."""
    import torch.distributed as dist

    return not dist.is_initialized()


def _new_gloo_group():
    import torch.distributed as dist

    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # optimizer state keyed by parameter name ("state.layers.0.attention.wq.weight.exp_avg"), so the
    # states of pipeline stages merge into one dict and load into any other split of the model
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _as_parts(model, optimizer) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """(part, its optimizer) pairs from a model and an optimizer, or from lists of parts and an
    ``OptimizerParts`` (one optimizer per part)."""
    parts = [model] if isinstance(model, torch.nn.Module) else list(model)
    opts = getattr(optimizer, "optimizers", None) or [optimizer]
    assert len(parts) == len(opts), "one optimizer per model part"
    return list(zip(parts, opts))


def _part_states(pairs) -> list[tuple[dict, dict]]:
    """(model state, optimizer state) of every model part."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return [
        (
            get_model_state_dict(part, options=_options()),
            get_optimizer_state_dict(part, opt, options=_options()),
        )
        for part, opt in pairs
    ]


def _merged(states: list[tuple[dict, dict]]) -> dict:
    """One app state for DCP. A name held by two local parts (a tied weight in the first and the last
    pipeline stage of one rank) appears once: the two copies are equal."""
    model, optim = {}, {}
    for m, o in states:
        model.update(m)
        optim.update(o)
    return {"model": model, "optimizer": optim}


def _app_state(state: dict, replica, extra: dict | None = None) -> dict:
    """What DCP writes or reads: ``state`` (model and optimizer), or under DiLoCo (``replica``:
    loom.train.diloco.DiLoCo) this group's state under its own key beside the state all groups share, whose
    ``model`` is the outer weights; ``extra``: entries of the step hooks beside them (pipedream_2bw's older
    weight version), read back into the same tensors."""
    out = state if replica is None else {replica.key: state, **replica.shared_state(state["model"])}
    return {**out, **extra} if extra else out


class _HashingWriter(FileSystemWriter):
    """DCP's file writer that also records the size and hash of the shards this rank wrote, in
    ``__<rank>_hashes.json``: every rank hashes its own files and rank 0 only the small rest. The
    record is written before ``write_data`` returns, so before DCP gathers the write results and
    before the save completes on rank 0 (async saves included)."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        names = sorted({r.storage_data.relative_path for r in future.wait()})
        if names:
            folder = str(self.path)
            records = {n: file_record(os.path.join(folder, n)) for n in names}
            _write_synced(os.path.join(folder, plan.storage_data.prefix + _HASHES), json.dumps(records))
        return future


def refuse_fresh_start(cfg: CheckpointConfig, ckpt_dir: str) -> None:
    """``resume none`` without ``overwrite`` in a folder that holds checkpoints: a UserError saying what to do."""
    found = list_steps(ckpt_dir)
    if cfg.resume == "none" and found and not cfg.overwrite:
        raise UserError(
            f"checkpoint.resume none: {ckpt_dir} already holds {len(found)} checkpoint(s), the newest step "
            f"{found[-1][0]}: continue it with --checkpoint.resume auto, use another --run.dir (or "
            "--checkpoint.dir), or start over with --checkpoint.overwrite true (moves them into "
            f"{os.path.join(ckpt_dir, 'superseded')}/, nothing is deleted)"
        )


class CheckpointManager:
    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str,
        *,
        is_main: bool,
        barrier: Callable[[], None],
        share: Callable[[object], object] | None = None,
    ):
        """``share(obj)`` returns rank 0's ``obj`` on every rank (a broadcast); without it every rank
        verifies checkpoints itself."""
        _quiet_dcp()
        self.cfg = cfg
        self.dir = cfg.dir or os.path.join(run_dir, "checkpoints")
        self.is_main, self.barrier, self.share = is_main, barrier, share
        self._pending = None  # (future, tmp folder, final folder, step) of an async save
        self._last_saved = None  # the step this manager saved last
        self.lineage: str | None = None  # set by choose(): the resumed checkpoint's, or a new one
        self.resumed_from: str | None = None  # set by load(): the checkpoint this run continues
        # async saves run collectives from a background thread: they need their own group, or their
        # messages interleave with the training step's on the default group
        self._group = _new_gloo_group() if cfg.async_save else None
        if is_main:
            os.makedirs(self.dir, exist_ok=True)
            self._remove_leftovers()
        barrier()

    # ---- saving ---------------------------------------------------------------
    def _remove_leftovers(self) -> None:
        for name in os.listdir(self.dir):
            if name.startswith(".step_") and name.endswith((".tmp", ".deleting")):
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def save(
        self, step: int, parts, optimizers, trainer_state: dict, config_toml: str, replica=None, extra=None
    ) -> None:
        """``parts``: a model or this rank's model parts; ``optimizers``: its optimizer or an
        ``OptimizerParts`` over the parts; ``replica``: DiLoCo's outer state, ``extra``: the hooks' (``_app_state``)."""
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save in flight at a time
        if step == self._last_saved:
            return  # this step is already saved (e.g. a periodic save at the last step)
        self._last_saved = step
        final = os.path.join(self.dir, step_dir_name(step))
        tmp = os.path.join(self.dir, "." + step_dir_name(step) + ".tmp")
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            _write_synced(os.path.join(tmp, STATE), json.dumps(trainer_state))
            _write_synced(os.path.join(tmp, "config.toml"), config_toml)
        self.barrier()
        state = _app_state(_merged(_part_states(_as_parts(parts, optimizers))), replica, extra)
        writer = _HashingWriter(tmp)
        if self.cfg.async_save:
            future = dcp.async_save(state, storage_writer=writer, process_group=self._group)
            self._pending = (future, tmp, final, step)
        else:
            with self._disk_full_is_one_line(tmp, step):
                dcp.save(state, storage_writer=writer, no_dist=_single_process())
            self.barrier()  # every rank's shards are written
            if self.is_main:
                with self._disk_full_is_one_line(tmp, step):
                    self._commit(tmp, final, step)
            self.barrier()

    @contextlib.contextmanager
    def _disk_full_is_one_line(self, tmp: str, step: int):
        """A full disk during a save: the partial folder goes, the previous checkpoint stays, and the error
        is one line naming the folder, the bytes the save needs (the newest checkpoint's size) and those free."""
        try:
            yield
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if not _disk_full(err):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            done = list_complete(self.dir)
            need = (
                f"about {folder_bytes(done[-1][1]):,} bytes (the size of step {done[-1][0]})"
                if done
                else "more space"
            )
            free = shutil.disk_usage(self.dir).free
            kept = f"; step {done[-1][0]} is intact" if done else ""
            raise DiskFull(
                f"checkpoint.dir {self.dir}: no space left on the device while saving step {step}: it "
                f"needs {need}, {free:,} bytes are free{kept}"
            ) from None

    def _commit(self, tmp: str, final: str, step: int) -> None:
        write_marker(tmp, step, self.lineage)
        # a folder of this step from an earlier run is replaced, never kept in place of this save, and never
        # deleted: it moves into superseded/ (resume refuses a branch over newer checkpoints unless overwrite)
        if os.path.lexists(final):  # kept, never deleted: moved into superseded/<time>/
            self._set_aside([final], "superseded", f"step {step} is saved again by this run")
        os.replace(tmp, final)  # the checkpoint exists from here on
        _fsync_dir(self.dir)
        self._apply_retention()

    def _move_aside(self, folder: str) -> str:
        """Rename ``step_N`` to ``.step_N.deleting`` (atomic: a kill leaves a complete folder or an
        ignored one) and return the new name; the caller removes it."""
        doomed = os.path.join(self.dir, "." + os.path.basename(folder) + ".deleting")
        shutil.rmtree(doomed, ignore_errors=True)  # a leftover of a removal that failed
        os.replace(folder, doomed)
        return doomed

    def _apply_retention(self) -> None:
        """Keep the newest ``keep`` complete checkpoints of this lineage; other lineages' are never touched."""
        if self.cfg.keep <= 0:
            return
        complete = [(s, f) for s, f in list_complete(self.dir) if marker_lineage(f) == self.lineage]
        doomed = [self._move_aside(folder) for _, folder in complete[: max(0, len(complete) - self.cfg.keep)]]
        if doomed:
            _fsync_dir(self.dir)
        for folder in doomed:
            shutil.rmtree(folder, ignore_errors=True)

    @property
    def last_saved_step(self) -> int | None:
        """The step this manager saved last in this process (None before its first save)."""
        return self._last_saved

    def poll(self) -> None:
        """Commit a finished async save without blocking. Ranks decide alone (no collective here):
        rank 0's save completes only after every rank's shards are written and the metadata is."""
        if self._pending is not None and self._pending[0].done():
            self._finish(collective=False)

    def wait(self) -> None:
        """Block until an async save is committed (all ranks call this at the same point). The barrier runs on
        every rank whether or not its own ``poll`` already committed: ranks poll alone, and a barrier only where a
        save was still pending would pair with another collective on the others (a hang)."""
        if self._pending is not None:
            self._finish(collective=False)
        if self.cfg.async_save:
            self.barrier()

    def _finish(self, collective: bool) -> None:
        future, tmp, final, step = self._pending
        self._pending = None
        with self._disk_full_is_one_line(tmp, step):
            future.result()
        if self.is_main:
            with self._disk_full_is_one_line(tmp, step):
                self._commit(tmp, final, step)
        if collective:
            self.barrier()

    # ---- loading ----------------------------------------------------------------
    def resolve(self) -> str | None:
        """The folder to resume from, verified; None when starting fresh. Starting fresh is only ever an
        explicit choice: ``none`` in an empty folder (or with ``overwrite``), or ``auto`` with no checkpoint."""
        mode = self.cfg.resume
        if mode == "none":
            self._refuse_or_supersede()
            return None
        if mode != "auto":
            verify(mode)  # an explicit path must be good: its error names the problem
            self._refuse_or_supersede_newer(mode)
            return mode
        found = list_steps(self.dir)
        problems, skipped = [], []
        for step, folder in reversed(found):
            try:
                verify(folder)
            except CorruptCheckpoint as err:
                problems.append(str(err))
                skipped.append(folder)
                continue
            if problems and self.is_main:
                # kept for inspection, out of the way of this run's saves of the same steps
                dest = self._set_aside(skipped, "corrupt")
                warnings.warn(
                    f"{'; '.join(problems)}; falling back to step {step} (the skipped folder(s) moved "
                    f"into {dest}/)",
                    stacklevel=2,
                )
            return folder
        if found:
            raise CorruptCheckpoint(
                f"checkpoint.resume auto: none of the {len(found)} checkpoint(s) in {self.dir} can be loaded ("
                + "; ".join(problems)
                + "): repair or move them, resume from a path, or start fresh with "
                "--checkpoint.resume none --checkpoint.overwrite true (moves them aside)"
            )
        return None

    def _refuse_or_supersede_newer(self, folder: str) -> None:
        """A resume from ``folder`` (an explicit path) where this run's checkpoint folder holds newer steps: the
        branch would save over them, so it is refused in one line, or with ``overwrite`` they move into
        ``superseded/<time>/`` (never deleted)."""
        with open(os.path.join(folder, STATE)) as fh:
            state = json.load(fh)
        step = 0 if state.get("model_only") else int(state.get("step", 0))
        here = os.path.realpath(folder)
        newer = [(s, f) for s, f in list_steps(self.dir) if s > step and os.path.realpath(f) != here]
        broken = []
        for _s, f in newer:
            try:
                verify(f)
            except CorruptCheckpoint:
                broken.append(f)
        if broken:  # nothing a branch could lose: kept for inspection, out of its way
            self._set_aside(broken, "corrupt", "incomplete or damaged, newer than the checkpoint resumed")
            newer = [(s, f) for s, f in newer if f not in broken]
        if not newer:
            return
        names = ", ".join(str(s) for s, _ in newer)
        if not self.cfg.overwrite:
            raise UserError(
                f"checkpoint.resume {folder}: {self.dir} holds newer checkpoint(s) (step {names}) that a run "
                f"branching from step {step} would save over: continue the newest with --checkpoint.resume auto, "
                "use another --checkpoint.dir, or branch here with --checkpoint.overwrite true (moves them into "
                f"{os.path.join(self.dir, 'superseded')}/, nothing is deleted)"
            )
        self._set_aside([f for _, f in newer], "superseded", f"branching from step {step}")

    def _set_aside(self, folders: list[str], kind: str, why: str | None = None) -> str:
        """Move ``folders`` into ``<dir>/<kind>/<time>/`` (never deleted; one printed line when ``why``) and return
        that folder."""
        dest = os.path.join(self.dir, kind, time.strftime("%Y%m%d-%H%M%S"))
        while os.path.exists(dest):
            dest += "+"
        os.makedirs(dest)
        for folder in folders:
            os.replace(folder, os.path.join(dest, os.path.basename(folder)))
        _fsync_dir(self.dir)
        if why:
            print(f"checkpoint: moved {len(folders)} checkpoint(s) into {dest} ({why})", flush=True)
        return dest

    def _refuse_or_supersede(self) -> None:
        """``resume none`` where checkpoints exist: exit 2, or with ``overwrite`` move them (never delete)."""
        found = list_steps(self.dir)
        if not found:
            return
        refuse_fresh_start(self.cfg, self.dir)
        dest = self._set_aside([f for _, f in found], "superseded")
        print(f"checkpoint.overwrite: moved {len(found)} checkpoint(s) into {dest}", flush=True)

    def _resolve_once(self) -> tuple[str | None, str]:
        """Rank 0 reads and hashes the candidates; the others take its answer (or its error)."""
        if self.share is None:
            return self._resolve_with_lineage()
        answer = None
        if self.is_main:
            try:
                answer = ("ok", self._resolve_with_lineage())
            except UserError as err:
                answer = ("error", str(err))
        kind, value = self.share(answer)
        if kind == "error":
            raise SharedError(value)
        return value

    def choose(self) -> str | None:
        """The verified folder ``checkpoint.resume`` picks (the same on every rank), None for a fresh start;
        sets the lineage: the chosen checkpoint's (a weights-only one starts a new lineage), else a new one."""
        folder, lineage = self._resolve_once()
        self.lineage = lineage
        return folder

    def latest(self) -> str | None:
        """The newest complete, verified checkpoint of this lineage (rank 0 checks, every rank gets its answer)."""
        folder = None
        if self.is_main:
            for _, candidate in reversed(list_complete(self.dir)):
                if marker_lineage(candidate) == self.lineage:
                    try:
                        verify(candidate)
                    except CorruptCheckpoint:
                        continue
                    folder = candidate
                    break
        return self.share(folder) if self.share is not None else folder

    def _resolve_with_lineage(self) -> tuple[str | None, str]:
        folder = self.resolve()
        lineage = None
        if folder is not None:
            with open(os.path.join(folder, STATE)) as fh:
                state = json.load(fh)
            lineage = None if state.get("model_only") else (state.get("lineage") or marker_lineage(folder))
        return folder, lineage or new_lineage()

    def load(self, folder: str, parts, optimizers, replica=None, extra=None) -> dict | None:
        """Load checkpoint ``folder`` (from ``choose``) into the model parts and their optimizers (any layout:
        the names do not depend on it); returns its trainer state, None for a weights-only checkpoint."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        with open(os.path.join(folder, STATE)) as fh:
            trainer_state = json.load(fh)
        if trainer_state.get(
            "model_only"
        ):  # `loom convert --from-hf`: weights only; the run starts at step 0
            for part, _ in _as_parts(parts, optimizers):
                load_model_weights(folder, part)
            return None
        pairs = _as_parts(parts, optimizers)
        states = _part_states(pairs)
        state = _merged(states)
        dcp.load(_app_state(state, replica, extra), checkpoint_id=folder, no_dist=_single_process())
        given: set[str] = set()
        for (part, opt), (m, o) in zip(pairs, states):
            # from the merged dict: a name shared by two local parts was loaded into one tensor, which each
            # part gets its own copy of (an optimizer keeps the tensors it is given: shared state would be
            # updated twice per step)
            set_model_state_dict(part, _take(state["model"], m, given), options=_options())
            set_optimizer_state_dict(part, opt, _take(state["optimizer"], o, given), options=_options())
        trainer_state["checkpoint"] = folder
        self.resumed_from = folder
        if os.path.realpath(folder) == os.path.realpath(
            os.path.join(self.dir, step_dir_name(trainer_state["step"]))
        ):
            self._last_saved = trainer_state["step"]  # e.g. at_end of a finished run: already saved here
        return trainer_state


def _take(merged: dict, names, given: set[str]) -> dict:
    """``merged``'s entries for ``names``; tensors already handed to another part are cloned."""
    out = {}
    for k in names:
        v = merged[k]
        out[k] = v.clone() if k in given and isinstance(v, torch.Tensor) else v
        given.add(k)
    return out


def load_model_weights(folder: str, model: torch.nn.Module) -> None:
    """Load the model part of a verified checkpoint into a model of any layout (all ranks call it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=folder, no_dist=_single_process())
    set_model_state_dict(model, sd["model"])


def save_model_weights(
    model: torch.nn.Module,
    folder: str,
    *,
    is_main: bool,
    barrier: Callable[[], None],
    lineage: str | None = None,
) -> None:
    """Only ``model``'s weights (any layout; all ranks call it) as a complete, verifiable folder, made visible by one
    rename (a kill leaves the previous folder or none); a folder of that name is replaced."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    parent, name = os.path.split(os.path.abspath(folder))
    tmp = os.path.join(parent, "." + name + ".tmp")
    if is_main:
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        _write_synced(os.path.join(tmp, STATE), json.dumps({"model_only": True}))
    barrier()
    dcp.save(
        {"model": get_model_state_dict(model)}, storage_writer=_HashingWriter(tmp), no_dist=_single_process()
    )
    barrier()
    if is_main:
        write_marker(tmp, 0, lineage)
        old = os.path.join(parent, "." + name + ".deleting")
        if os.path.lexists(folder):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
        os.replace(tmp, folder)
        _fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_model_only(folder: str, model: torch.nn.Module) -> None:
    """Load just the model weights of a checkpoint into an unsharded model, in one process."""
    verify(folder)
    load_model_weights(folder, model)
