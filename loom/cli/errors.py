"""User errors leave as one line on stderr and exit code 2; bugs keep their traceback."""

from __future__ import annotations

import functools
import sys

from loom.config.errors import ConfigError, UserError

EXIT_USER_ERROR = 2


def user_errors_exit(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ConfigError, UserError) as err:
            print(f"loom: error: {err}", file=sys.stderr, flush=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper
