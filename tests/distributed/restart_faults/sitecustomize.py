"""Imported by every Python process started with this folder on PYTHONPATH (the restart tests' agents and their
workers): ``LOOM_RESTART_FAULT = "<point>:<n>[:how]"`` with ``LOOM_RESTART_FAULT_RANK = r`` (default 1; ``*``: any
rank) makes rank r fail the n-th time it reaches ``point``, in the first attempt only (``TORCHELASTIC_RESTART_COUNT``
0), so the restarted group runs through. By default the worker dies alone (SIGKILL), not its agent or its peers: a
worker lost mid-run, which the agent restarts; ``raise``: it raises a RuntimeError; ``node``: its agent and that
agent's other workers are SIGKILLed with it (stopped first, so none reacts): a lost node.

Points: ``step`` (the n-th training step, as it starts: ``Loop.train_step``), ``slow:S`` (no fault: every step
waits S seconds as it starts, while TORCHELASTIC_RESTART_COUNT is 0, so that a test can act while it trains) and tests.faults.inject's
kill points (``shard``: a rank about to fsync a checkpoint shard it has just written; ``marker``, ``rename``, ...)."""

import os


def _armed() -> bool:
    rank = os.environ.get("LOOM_RESTART_FAULT_RANK", "1")
    return (
        bool(os.environ.get("LOOM_RESTART_FAULT"))
        and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        and rank in ("*", os.environ.get("RANK"))
    )


if _armed():
    import importlib.abc
    import importlib.machinery
    import signal
    import sys
    import time

    import tests.faults.inject as inject

    point, _, rest = os.environ["LOOM_RESTART_FAULT"].partition(":")
    n, _, how = rest.partition(":")

    def fail(where: str) -> None:
        print(
            f"loom-fault: rank {os.environ['RANK']} fails at {where} ({how or 'SIGKILL'}, pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        if how == "raise":
            raise RuntimeError(f"injected fault at {where}")
        if how == "node":  # its agent and every worker of that agent too: a lost node
            inject.kill_tree(os.getppid(), spare=os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)

    if point in ("step", "slow"):
        calls = {"n": 0}

        def patch(module) -> None:
            train_step = module.Loop.train_step

            def counted(self, *args, **kwargs):
                calls["n"] += 1
                if point == "slow":
                    time.sleep(float(n))
                elif calls["n"] == int(n):
                    fail(f"step {calls['n']}")
                return train_step(self, *args, **kwargs)

            module.Loop.train_step = counted

        class _PatchTrainer(importlib.abc.MetaPathFinder):
            """Wraps Loop.train_step as loom.train.loop is first imported."""

            def find_spec(self, name, path, target=None):
                if name != "loom.train.loop":
                    return None
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                run = spec.loader.exec_module

                def exec_module(module):
                    run(module)
                    patch(module)

                spec.loader.exec_module = exec_module
                return spec

        sys.meta_path.insert(0, _PatchTrainer())
    else:
        inject.kill_run = fail  # this worker alone, not the run (inject's points call kill_run)
        inject.install(f"{point}:{n}")
