"""Sharded, atomic, resharding checkpoints on torch distributed checkpoint (DCP).

Layout of ``<checkpoint dir>``::

    step_00000100/            a complete checkpoint
        __0_0.distcp ...      DCP shards (model + optimizer), any number of ranks
        .metadata             DCP's index
        trainer_state.json    step, tokens, loader position, LR schedule, loss scale, RNG
        config.toml           the resolved config of the run that wrote it
        COMPLETE.json         written last: every file above with its size and blake2b hash
    .step_00000200.tmp/       being written (ignored; removed at the next start)
    .step_00000050.deleting/  being removed by retention (ignored)

A checkpoint becomes visible only by renaming its finished ``.tmp`` folder, after the marker is
in it. A kill at any point leaves the previous complete checkpoint untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from typing import Callable

import torch

from loom.config.errors import UserError
from loom.config.sections import CheckpointConfig

MARKER = "COMPLETE.json"
STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def write_marker(folder: str, step: int) -> None:
    files = {}
    for root, _, names in os.walk(folder):
        for n in sorted(names):
            full = os.path.join(root, n)
            rel = os.path.relpath(full, folder)
            if rel == MARKER:
                continue
            files[rel] = {"size": os.path.getsize(full), "blake2b": file_digest(full)}
    tmp = os.path.join(folder, MARKER + ".partial")
    with open(tmp, "w") as fh:
        json.dump({"step": step, "files": files}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(folder, MARKER))


def verify(folder: str, check_hash: bool = True) -> dict:
    """Raise CorruptCheckpoint naming the problem, or return the marker."""
    marker = os.path.join(folder, MARKER)
    if not os.path.isfile(marker):
        raise CorruptCheckpoint(f"checkpoint {folder} is incomplete: no {MARKER}")
    try:
        with open(marker) as fh:
            meta = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise CorruptCheckpoint(f"checkpoint {folder}: unreadable {MARKER} ({err})") from None
    if ".metadata" not in meta["files"]:
        raise CorruptCheckpoint(f"checkpoint {folder}: {MARKER} lists no DCP .metadata file")
    for rel, info in meta["files"].items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise CorruptCheckpoint(f"checkpoint {folder}: file {rel} is missing")
        size = os.path.getsize(path)
        if size != info["size"]:
            raise CorruptCheckpoint(f"checkpoint {folder}: file {rel} has {size} bytes, expected {info['size']} "
                                    "(truncated or overwritten)")
        if check_hash and file_digest(path) != info["blake2b"]:
            raise CorruptCheckpoint(f"checkpoint {folder}: file {rel} does not match its recorded hash")
    return meta


def list_complete(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of folders that look complete (named step_N with a marker), oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in os.listdir(ckpt_dir):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(ckpt_dir, name, MARKER)):
            out.append((int(m.group(1)), os.path.join(ckpt_dir, name)))
    return sorted(out)


def _new_gloo_group():
    import torch.distributed as dist

    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def _app_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, run_dir: str, *, is_main: bool, barrier: Callable[[], None]):
        self.cfg = cfg
        self.dir = cfg.dir or os.path.join(run_dir, "checkpoints")
        self.is_main, self.barrier = is_main, barrier
        self._pending = None  # (future, tmp folder, final folder, step) of an async save
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

    def save(self, step: int, model, optimizer, trainer_state: dict, config_toml: str) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save in flight at a time
        final = os.path.join(self.dir, step_dir_name(step))
        if os.path.isdir(final):
            return  # this step is already saved (e.g. a periodic save at the last step)
        tmp = os.path.join(self.dir, "." + step_dir_name(step) + ".tmp")
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            self._write_json(os.path.join(tmp, STATE), trainer_state)
            with open(os.path.join(tmp, "config.toml"), "w") as fh:
                fh.write(config_toml)
        self.barrier()
        state = _app_state(model, optimizer)
        if self.cfg.async_save:
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._group)
            self._pending = (future, tmp, final, step)
        else:
            dcp.save(state, checkpoint_id=tmp)
            self.barrier()  # every rank's shards are written
            if self.is_main:
                self._commit(tmp, final, step)
            self.barrier()

    def _write_json(self, path: str, obj) -> None:
        with open(path, "w") as fh:
            json.dump(obj, fh)

    def _commit(self, tmp: str, final: str, step: int) -> None:
        write_marker(tmp, step)
        os.replace(tmp, final)  # the checkpoint exists from here on
        self._apply_retention()

    def _apply_retention(self) -> None:
        if self.cfg.keep <= 0:
            return
        complete = list_complete(self.dir)
        for step, folder in complete[: max(0, len(complete) - self.cfg.keep)]:
            doomed = os.path.join(self.dir, "." + os.path.basename(folder) + ".deleting")
            os.replace(folder, doomed)  # atomic: a kill leaves either a complete folder or an ignored one
            shutil.rmtree(doomed, ignore_errors=True)

    def poll(self) -> None:
        """Commit a finished async save without blocking. Ranks decide alone (no collective here):
        rank 0's save completes only after every rank's shards are written and the metadata is."""
        if self._pending is not None and self._pending[0].done():
            self._finish(collective=False)

    def wait(self) -> None:
        """Block until an async save is committed (all ranks call this at the same point)."""
        if self._pending is not None:
            self._finish(collective=True)

    def _finish(self, collective: bool) -> None:
        future, tmp, final, step = self._pending
        self._pending = None
        future.result()
        if self.is_main:
            self._commit(tmp, final, step)
        if collective:
            self.barrier()

    # ---- loading ----------------------------------------------------------------
    def resolve(self) -> str | None:
        """The folder to resume from, verified; None when starting fresh."""
        mode = self.cfg.resume
        if mode == "none":
            return None
        if mode != "auto":
            verify(mode)  # an explicit path must be good: its error names the problem
            return mode
        for step, folder in reversed(list_complete(self.dir)):
            try:
                verify(folder)
                return folder
            except CorruptCheckpoint as err:
                if self.is_main:
                    warnings.warn(f"{err}; falling back to an earlier checkpoint", stacklevel=2)
        return None

    def load(self, model, optimizer) -> dict | None:
        """Load the checkpoint chosen by ``checkpoint.resume`` into model and optimizer (any layout)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        folder = self.resolve()
        if folder is None:
            return None
        with open(os.path.join(folder, STATE)) as fh:
            trainer_state = json.load(fh)
        if trainer_state.get("model_only"):  # `loom convert --from-hf`: weights only; the run starts at step 0
            load_model_weights(folder, model)
            return None
        state = _app_state(model, optimizer)
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        trainer_state["checkpoint"] = folder
        return trainer_state


def load_model_weights(folder: str, model: torch.nn.Module) -> None:
    """Load the model part of a verified checkpoint into a model of any layout (all ranks call it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=folder)
    set_model_state_dict(model, sd["model"])


def load_model_only(folder: str, model: torch.nn.Module) -> None:
    """Load just the model weights of a checkpoint into an unsharded model, in one process."""
    verify(folder)
    load_model_weights(folder, model)
