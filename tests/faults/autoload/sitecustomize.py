"""Imported by every Python process started with this folder on PYTHONPATH (the trainer, the launcher and
its workers): arms the kill point named by LOOM_FAULT. Without the variable it does nothing."""

import os

if os.environ.get("LOOM_FAULT"):
    from tests.faults.inject import install

    install(os.environ["LOOM_FAULT"])
