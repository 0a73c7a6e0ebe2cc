"""Faults of one rank, for the hang and straggler tests (standard library only: ``autoload/sitecustomize.py``
arms them at interpreter start; the patches go in when the module they change is first imported).

``LOOM_FAULT_RANK = "<kind>:<rank>:<arg>"`` acts on the process whose RANK is ``<rank>`` when the patched call runs
(a worker of ``mp.spawn`` sets RANK after its interpreter started):

    stall:<rank>:<n>   its n-th ``torch.distributed.all_reduce`` never returns (the rank sleeps in its place): the
                       other ranks wait in that collective for a rank that never joins it
    skip:<rank>:<n>    its n-th ``all_reduce`` returns at once without joining: the rank goes on, one collective
                       out of step with the others (on gloo the next collective of another size aborts every
                       process: "Received data size doesn't match expected size"; NCCL hangs instead)
    stall_save:<rank>:<n>  its n-th checkpoint save (``CheckpointManager.save``) never starts: the others wait at
                       the save's monitored barrier
    slow:<rank>:<s>    each step's data (``loom.data.loader.Loader.next_step``) takes ``s`` seconds longer there
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time

KINDS = ("stall", "skip", "stall_save", "slow")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` once ``name`` has been imported (the first time)."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _after_import(name: str, patch) -> None:
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, patch))


def install(spec: str) -> None:
    kind, rank, arg = (spec.split(":") + ["", ""])[:3]
    if kind not in KINDS or not rank.isdecimal() or not arg:
        raise ValueError(
            f"LOOM_FAULT_RANK={spec!r}: expected <kind>:<rank>:<arg> with kind one of {', '.join(KINDS)}"
        )

    def mine() -> bool:
        return os.environ.get("RANK") == rank

    if kind == "slow":
        delay = float(arg)

        def patch_loader(module):
            run = module.Loader.next_step

            def next_step(self, *args, **kwargs):
                if mine():
                    time.sleep(delay)
                return run(self, *args, **kwargs)

            module.Loader.next_step = next_step

        _after_import("loom.data.loader", patch_loader)
        return
    target, seen = int(arg), {"n": 0}

    def stall(what: str) -> None:
        print(
            f"loom-fault: rank {rank} stalls {what} #{target} (pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(3600)

    if kind == "stall_save":

        def patch_manager(module):
            run = module.CheckpointManager.save

            def save(self, *args, **kwargs):
                seen["n"] += mine()
                if mine() and seen["n"] == target:
                    stall("save")
                return run(self, *args, **kwargs)

            module.CheckpointManager.save = save

        _after_import("loom.checkpoint.manager", patch_manager)
        return

    def patch_dist(module):
        run = module.all_reduce

        def all_reduce(*args, **kwargs):
            seen["n"] += mine()
            if mine() and seen["n"] == target:
                if kind == "stall":
                    stall("all_reduce")
                print(
                    f"loom-fault: rank {rank} skips all_reduce #{target} (pid {os.getpid()})",
                    file=sys.stderr,
                    flush=True,
                )
                return None
            return run(*args, **kwargs)

        module.all_reduce = all_reduce

    _after_import("torch.distributed", patch_dist)
