"""Paths loom will write to, checked before any work starts: one-line errors for a folder that is a file, a
file path that is a folder, or a place this process cannot write. Nothing is created by the checks."""

from __future__ import annotations

import os
import tempfile

from loom.config.errors import ConfigError


def nearest_existing(path: str) -> str:
    """``path`` itself if it exists, else its closest existing ancestor (where a makedirs would start)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def write_problem(folder: str) -> str | None:
    """Why nothing can be created in existing ``folder`` (the OS's reason), or None. A real probe file, since
    permission bits do not bind root and read-only mounts are not in them."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".loom-write-check-", dir=folder)
    except OSError as err:
        return err.strerror or str(err)
    os.close(fd)
    os.remove(probe)
    return None


def check_folder_writable(field: str, path: str) -> None:
    """``path`` is a folder this process can write into, or one it can create."""
    full = os.path.abspath(path)
    base = nearest_existing(full)
    if not os.path.isdir(base):
        where = "is a file" if base == full else f"cannot be created: {base} is a file"
        raise ConfigError(field, path, f"{where}; expected a folder (created when missing)")
    problem = write_problem(base)
    if problem:
        where = "" if base == full else f" ({base}, where it would be created)"
        raise ConfigError(field, path, f"not writable{where}: {problem}; choose a folder you can write to")


def check_file_writable(field: str, path: str, example: str) -> None:
    """``path`` can be written as a file: not a folder, and its folder writable or creatable. ``example``: a file
    name to suggest inside ``path`` when it is a folder."""
    if os.path.isdir(path):
        raise ConfigError(
            field, path, f"is a folder; expected a file path such as {os.path.join(path, example)}"
        )
    full = os.path.abspath(path)
    base = nearest_existing(os.path.dirname(full))
    if not os.path.isdir(base):
        raise ConfigError(field, path, f"cannot be written: {base} is a file, not a folder")
    problem = write_problem(base)
    if problem:
        raise ConfigError(field, path, f"not writable ({base}: {problem}); choose a path you can write to")
