"""User errors leave as one line on stderr and exit code 2, a run that stopped itself (non-finite steps) as
one line and exit code 1, a second Ctrl-C as one line and exit code 130; bugs keep their traceback."""

from __future__ import annotations

import errno
import functools
import os
import sys

from loom.config.errors import ConfigError, SharedError, TrainingStopped, UserError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # the shell's code for a SIGINT


def _leave(code: int) -> None:
    """Exit with ``code`` after shutting down this process's process group, if it made one: a gloo group left for
    the interpreter's teardown while a peer had already exited aborted that rank now and then (SIGABRT, "terminate
    called without an active exception"), and the launcher then reported a crash instead of the user error. torch
    is not imported here for it: an error before torch loaded stays one line."""
    dist = sys.modules.get("torch.distributed")
    # gloo only: NCCL's own teardown aborts its communicators, where a graceful destroy could wait on a peer
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        try:
            dist.destroy_process_group()
        except Exception:  # leaving anyway: the exit code is what matters now
            pass
    sys.exit(code)


def user_errors_exit(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ConfigError, UserError) as err:
            if not (isinstance(err, SharedError) and os.environ.get("RANK", "0") != "0"):
                print(f"loom: error: {err}", file=sys.stderr, flush=True)
            _leave(EXIT_USER_ERROR)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # no room: disk, quota, ulimit -f
                raise
            where = f" writing {err.filename}" if err.filename else ""
            print(
                f"loom: error: no space left on the device{where} ({err.strerror}): free some space or choose "
                "another folder",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:  # a second Ctrl-C (the first one saves at the next step)
            print(
                "loom: interrupted: stopped without a new checkpoint (the last complete one stays)",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(EXIT_INTERRUPTED)
        except TrainingStopped as err:  # decided on every rank alike: rank 0 says it
            if os.environ.get("RANK", "0") == "0":
                print(f"loom: stopped: {err}", file=sys.stderr, flush=True)
            _leave(1)

    return wrapper
