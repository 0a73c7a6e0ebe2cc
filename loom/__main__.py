"""``python -m loom ...``: the ``loom`` command without its installed entry point (e.g. a checkout on PYTHONPATH)."""

from loom.cli.main import entry

entry()
