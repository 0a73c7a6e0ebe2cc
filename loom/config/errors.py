"""User-facing errors: one line naming the field, the value and what is allowed."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the configuration or the command line; the CLI exits with code 2."""

    def __init__(self, field: str, value, allowed: str, *, show_value: bool = True):
        self.field, self.value, self.allowed = field, value, allowed
        shown = f" = {value!r}" if show_value else ""
        super().__init__(f"{field}{shown}: {allowed}")


class UserError(RuntimeError):
    """A problem with the user's files or environment (not a bug); printed in one line, exit code 2."""


class TrainingStopped(RuntimeError):
    """The run stopped itself for a reason worth one line (non-finite steps): exit code 1, no traceback."""


class SharedError(UserError):
    """A user error every rank raises from rank 0's answer (a broadcast): printed by rank 0 only."""


def require(module: str, extra: str, *, package: str | None = None, purpose: str = ""):
    """Import an optional dependency, or raise the one-line UserError that names its package and the
    loom-train extra that installs it (``needs the 'X' package (pip install 'loom-train[extra]')``)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        name = package or module.split(".")[0]
        lead = f"{purpose} " if purpose else ""
        raise UserError(f"{lead}needs the {name!r} package (pip install 'loom-train[{extra}]')") from None
