"""Shared test setup: the tiny run builder (``tests/tiny.py``, importable from worker processes too) and the
``exhaustive`` marker; GPU tests start with empty compile caches.

Markers (pyproject.toml lists them):

- ``slow``: broad matrices and the slowest tests. They run by default (``python -m pytest -q``, what CI runs);
  ``python -m pytest -q -m "not slow"`` is the quick inner loop without them.
- ``exhaustive``: the widest matrices (the fault-injection matrix, 4-rank layout matrices), run by hand before an
  issue is closed.
  Deselected unless ``--exhaustive`` is given or ``-m`` names them (``-m exhaustive``); a ``-m`` that does not
  name them leaves them out too.
"""

from __future__ import annotations

import pytest

from tests.tiny import TINY, tiny_args, tiny_config, tiny_overrides

__all__ = ["TINY", "tiny_args", "tiny_config", "tiny_overrides"]  # re-exported; tests import them from tests.tiny


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="also run the tests marked exhaustive (deselected by default)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--exhaustive") or "exhaustive" in (config.getoption("markexpr") or ""):
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("exhaustive") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def tiny(tmp_path):
    """``tiny(**overrides)``: the tiny run's ``Config``, writing under ``tmp_path`` (``run/`` and ``cache/``)."""
    def make(**overrides):
        return tiny_config(tmp_path / "run", tmp_path / "cache", **overrides)
    return make


@pytest.fixture(autouse=True)
def _fresh_compile_caches(request):
    """A GPU test starts with dynamo's caches empty: the compiled blocks' code objects are shared by every model in
    the process, so the guards earlier tests left (other shapes and dtypes) would count towards the recompile limit,
    which fullgraph compiles turn into a hard failure."""
    if request.node.get_closest_marker("gpu") is not None:
        import torch

        torch._dynamo.reset()
    yield
