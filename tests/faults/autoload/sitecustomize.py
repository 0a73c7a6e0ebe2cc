"""Imported by every Python process started with this folder on PYTHONPATH (the trainer, the launcher and
its workers): arms the kill point named by LOOM_FAULT. Without the variable it does nothing."""

import os

if os.environ.get("LOOM_FAULT"):
    from tests.faults.inject import install

    install(os.environ["LOOM_FAULT"])

if os.environ.get(
    "LOOM_FAULT_RANK"
):  # one rank's fault (tests/faults/ranks.py): a stalled collective, a slow rank
    from tests.faults.ranks import install as install_rank_fault

    install_rank_fault(os.environ["LOOM_FAULT_RANK"])
