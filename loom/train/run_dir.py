"""The run directory: checked writable before anything is built and self-contained (the tokenizer copied into
it, the recorded config naming the copy). Its lock is loom.runtime.run_lock's.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from typing import Any

from loom.config.errors import ConfigError, UserError
from loom.config.paths import check_folder_writable
from loom.config.sections import Config


def checkpoint_dir(cfg) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.run.dir, "checkpoints")


def check_writable_dirs(cfg) -> None:
    """``run.dir`` and the checkpoint folder can be written (one line each where not), then created."""
    for field, path in (("run.dir", cfg.run.dir), ("checkpoint.dir", checkpoint_dir(cfg))):
        check_folder_writable(field, path)
        os.makedirs(path, exist_ok=True)


# ---- the files a run records, and reading a recorded config back --------------------------------------
#
# A run dir is self-contained: the run's tokenizer files are copied into it (``<run.dir>/tokenizer/``) and the
# config recorded in ``<run.dir>/config.toml`` and in every checkpoint names the copy. Recorded paths are
# absolute, so the recorded config works as ``--config`` from any folder; whoever reads a checkpoint's config
# finds the copy in the checkpoint's run dir wherever that dir is now, so a moved run dir keeps working.

TOKENIZER_COPY = "tokenizer"
STATE = "trainer_state.json"  # loom.checkpoint.manager's, repeated: the CLI imports this module before torch
_PATH_FIELDS = (
    ("model", "init_from"),
    ("data", "cache_dir"),
    ("data", "chat_template"),
    ("checkpoint", "dir"),
    ("lora", "init_from"),
)


def record_run_files(cfg: Config) -> Config:
    """The config to record for this run (``<run.dir>/config.toml``, every checkpoint's ``config.toml``): paths
    absolute, and ``data.tokenizer`` naming a copy of the tokenizer files inside the run dir, made here. Rank 0
    only, with the run dir locked."""
    out = copy.deepcopy(cfg)
    out.run.dir = os.path.abspath(cfg.run.dir)
    for section, name in _PATH_FIELDS:
        value = getattr(getattr(cfg, section), name)
        if value:
            setattr(getattr(out, section), name, os.path.abspath(value))
    if cfg.checkpoint.resume not in ("none", "auto"):
        out.checkpoint.resume = os.path.abspath(cfg.checkpoint.resume)
    if not _is_byte(cfg.data.tokenizer):
        out.data.tokenizer = copy_tokenizer(cfg.data.tokenizer, out.run.dir)
    return out


def _is_byte(spec: str) -> bool:
    return spec in ("", "byte")


def _read_files(files: dict[str, str]) -> dict[str, bytes]:
    out = {}
    for name, path in files.items():
        with open(path, "rb") as fh:
            out[name] = fh.read()
    return out


def _holds(folder: str, content: dict[str, bytes]) -> bool:
    """Whether ``folder`` holds exactly these files with these bytes."""
    try:
        return (
            sorted(os.listdir(folder)) == sorted(content)
            and _read_files({n: os.path.join(folder, n) for n in content}) == content
        )
    except OSError:
        return False


def copy_tokenizer(spec: str, run_dir: str) -> str:
    """Copy tokenizer ``spec`` (its tokenizer.json and companion files) into ``run_dir``; returns the copy's
    absolute path. The copy is ``tokenizer/``; where that already holds another tokenizer (a config or checkpoint
    may name it), ``tokenizer-<hash>/``. Written under a temporary name and renamed, so it is whole or absent."""
    from loom.data.tokenizers import tokenizer_files

    files = tokenizer_files(spec)
    try:
        content = _read_files(files)
    except OSError as err:
        raise UserError(f"data.tokenizer {spec}: cannot be read ({err.strerror or err})") from None
    digest = hashlib.blake2b(digest_size=4)
    for name in sorted(content):
        digest.update(name.encode() + b"\0" + content[name] + b"\0")
    plain, hashed = (
        os.path.join(run_dir, name) for name in (TOKENIZER_COPY, f"{TOKENIZER_COPY}-{digest.hexdigest()}")
    )
    for target in (plain, hashed):
        if _holds(target, content):
            return os.path.abspath(target)
        if not os.path.exists(target):
            break
    tmp = os.path.join(run_dir, f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name, data in content.items():
            with open(os.path.join(tmp, name), "wb") as fh:
                fh.write(data)
        if os.path.exists(target):  # a damaged hashed copy: replaced whole
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(
            f"run.dir {run_dir}: copying the tokenizer {spec} into it failed ({err.strerror or err})"
        ) from None
    return os.path.abspath(target)


def recorded_run_dir(folder: str, values: dict[str, Any]) -> str:
    """The run dir that checkpoint ``folder`` (or run dir ``folder``) belongs to, where it is now: a checkpoint
    in its run's default ``checkpoints/`` folder (or that folder's ``superseded/<time>/``) finds it there; one
    with another ``checkpoint.dir`` has only the recorded ``run.dir``."""
    folder = os.path.abspath(folder)
    if not os.path.isfile(os.path.join(folder, STATE)):
        return folder  # a run dir's own config.toml
    if values.get("checkpoint.dir"):
        return os.path.abspath(values.get("run.dir") or ".")
    ckpt_dir = os.path.dirname(folder)
    if os.path.basename(os.path.dirname(ckpt_dir)) == "superseded":
        ckpt_dir = os.path.dirname(os.path.dirname(ckpt_dir))
    return os.path.dirname(ckpt_dir)


def _model_only(folder: str) -> bool:
    try:
        with open(os.path.join(folder, STATE)) as fh:
            return bool(json.load(fh).get("model_only"))
    except (OSError, ValueError, AttributeError):
        return False


def tokenizer_candidates(folder: str, values: dict[str, Any]) -> list[str]:
    """Where the tokenizer recorded in ``folder``'s config.toml may be, most likely first: a run's copy in the
    run dir where it is now, then the recorded path (a relative one, recorded before runs kept a copy: from the
    current folder, then from the run dir). An import (``loom convert --from-hf``) keeps its copy inside itself."""
    spec = values.get("data.tokenizer", "byte")
    if _is_byte(spec):
        return [spec]
    if _model_only(folder):
        return [os.path.join(os.path.abspath(folder), TOKENIZER_COPY), spec]
    run_dir = recorded_run_dir(folder, values)
    recorded_dir = os.path.abspath(values.get("run.dir") or ".")
    if os.path.isabs(spec) and os.path.dirname(os.path.normpath(spec)) == recorded_dir:
        return [os.path.join(run_dir, os.path.basename(os.path.normpath(spec))), spec]
    return [spec] if os.path.isabs(spec) else [spec, os.path.join(run_dir, spec)]


def recorded_tokenizer(folder: str, values: dict[str, Any]) -> str:
    """The tokenizer the config recorded in ``folder`` names, found (``tokenizer_candidates``); where none
    exists, the first candidate (``missing_tokenizer`` says so)."""
    candidates = tokenizer_candidates(folder, values)
    return next((c for c in candidates if _is_byte(c) or os.path.exists(c)), candidates[0])


def missing_tokenizer(folder: str, values: dict[str, Any], fix: str) -> ConfigError | None:
    """The one-line error for a recorded tokenizer that is nowhere to be found (None when it is), naming every
    resolved path tried; ``fix``: what to do about it."""
    spec = values.get("data.tokenizer", "byte")
    candidates = tokenizer_candidates(folder, values)
    if any(_is_byte(c) or os.path.exists(c) for c in candidates):
        return None
    tried = " nor at ".join(dict.fromkeys(os.path.abspath(c) for c in candidates))
    return ConfigError(
        "data.tokenizer",
        spec,
        f"recorded in {os.path.join(folder, 'config.toml')}: missing (not at {tried}); {fix}",
    )


def recorded_values(folder: str, raw: dict[str, Any]) -> dict[str, Any]:
    """A recorded config's ``{"section.field": value}`` with its paths resolved where the files are now: the
    tokenizer (``recorded_tokenizer``), and an import's ``model.init_from`` (itself) when it moved."""
    out = dict(raw)
    if "data.tokenizer" in out:
        out["data.tokenizer"] = recorded_tokenizer(folder, out)
    init = out.get("model.init_from")
    if init and not os.path.isdir(init) and _model_only(folder):
        out["model.init_from"] = os.path.abspath(folder)
    return out
