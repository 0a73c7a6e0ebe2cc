"""loom: train large language models with every form of parallelism on one device mesh."""

from __future__ import annotations

import os

DIST = "loom-train"  # the distribution name in pyproject.toml, whose version is the only one written down


def version() -> str:
    """The installed distribution's version, else (a source tree used without installing) pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(DIST)
    except PackageNotFoundError:
        pass
    import tomllib

    try:
        with open(
            os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"), "rb"
        ) as fh:
            return tomllib.load(fh)["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def __getattr__(name: str):
    """``loom.__version__``, read when asked (importing loom stays free of metadata lookups)."""
    if name == "__version__":
        return version()
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
