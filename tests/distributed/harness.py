"""Multi-process CPU tests on gloo: ranks that meet over a store the test process holds (port 0, so no port is
raced for) and run the jobs sent to them. Each call starts its own ranks, forked from a fork server that imported
torch and loom once (``PRELOAD``: a start costs a fork, not an import); with LOOM_TEST_REUSE_RANKS=1 one pool of
ranks per (world size, backend) serves every call instead, see ``REUSE_RANKS``. ``run_jobs(world, jobs)`` trains each job (dotted
overrides) in turn on the pool's group and returns rank 0's records; ``run_fn(world, fn)`` runs a module-level
``fn(rank, world)`` on every rank and returns rank 0's JSON result. A job that raises on any rank, or hangs, ends
its pool: the next call starts a fresh one, so no test inherits a group in an unknown state. ``reference(job)``
is a single-process run computed once per session per configuration, shared across test files.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import os
import queue
import sys
import time
import traceback

HANG_SECONDS = int(os.environ.get("LOOM_TEST_HANG_SECONDS", "480"))  # a compile under load can pass 300 s
SESSION_ENV = dict(
    os.environ
)  # what pooled ranks start with: not the variables a test had set when one started
PATH_KEYS = ("run.dir", "data.cache_dir")  # where a run writes; never what it computes


def rendezvous_store():
    """A TCPStore this test process serves on a port the kernel picked (port 0), for child launchers' c10d
    rendezvous (``loom launch``, ``loom train --rdzv-endpoint``): the agent that would host finds the port taken and
    joins as a client (torch's fallback), so no port is chosen by bind-and-close and raced for. Keep it alive while
    the children run."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)


def run_one(overrides: dict) -> list[dict]:
    """One job in this process (distributed or not); returns rank 0's records."""
    from loom.config import build_config
    from loom.runtime.env import init_distributed
    from loom.train.trainer import Trainer

    cfg = build_config(None, {k: str(v) for k, v in overrides.items()})
    trainer = Trainer(cfg, env=init_distributed(cfg.run.device, cfg.parallel.backend))
    return trainer.fit()


def job_tmp() -> str:
    """The calling test's temporary folder, inside a pooled rank (``run_fn``'s ``tmp_dir``)."""
    return os.environ["LOOM_TEST_TMP"]


# ---- the ranks ------------------------------------------------------------------------------------------------


def _serve(rank: int, world: int, port: int, backend: str, inbox, outbox) -> None:
    """A pooled rank: for each job sent (until ``None``), join a fresh group, run it, tear the group down."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import threading

    import torch.distributed as dist

    faulthandler.enable()  # a native crash (SIGABRT/SIGSEGV) prints every thread's Python stack
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_timedelta(HANG_SECONDS))
    generation = 0
    while (msg := inbox.get()) is not None:
        fn, tmp = msg
        if not dist.is_initialized():
            dist.init_process_group(
                backend, store=dist.PrefixStore(f"group{generation}", store), rank=rank, world_size=world
            )
            generation += 1
        reply = _run_job(fn, rank, world, tmp)
        _tidy()
        # every job gets a fresh group: the meshes' subgroups (and their gloo threads,
        if dist.is_initialized():
            _teardown(dist)  # thousands after a few dozen jobs, each waking up) go with it
        outbox.put((rank, *reply))
    _exit_now()


def _exit_with_parent(parent: int) -> None:
    """A rank whose test process died (killed, interrupted) ends too: none is left waiting for jobs."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _run_job(fn, rank: int, world: int, tmp: str) -> tuple[str, object]:
    """``("ok", result)`` or ``("error", traceback)``; the job's environment changes are undone after it. A hang
    fails loudly, with every thread's stack, and ends the rank (its pool is then replaced)."""
    saved_env = dict(os.environ)
    os.environ["LOOM_TEST_TMP"] = tmp
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    try:
        result = fn(rank, world)
        return "ok", (json.loads(json.dumps(result)) if rank == 0 else None)
    except BaseException:
        traceback.print_exc()
        return "error", traceback.format_exc()
    finally:
        faulthandler.cancel_dump_traceback_later()
        os.environ.clear()
        os.environ.update(saved_env)


def _tidy() -> None:
    """Between jobs: trainers (DDP reducers hold the group) go, and compiled code's guards do not pile up."""
    import sys

    gc.collect()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _exit_now() -> None:
    """End a rank whose work is done and reported without the interpreter's shutdown: on gloo, a rank that had run
    functional collectives (context parallelism's all-gathers) was sometimes killed at exit by PyTorch's C++
    teardown ('terminate called without an active exception', SIGABRT; about 1 in 25 runs of a 2-rank CP test,
    torch 2.13 CPU) after its results were written, which failed the test. The results are reported; stop here."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _teardown(dist) -> None:
    """All ranks meet before the group goes: none closes its connections while a peer still uses them."""
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


# ---- the pools ------------------------------------------------------------------------------------------------


class RankFailure(AssertionError):
    """A pooled job raised on some rank, or a rank died or hung."""


class Pool:
    """``world`` gloo ranks meeting over a store this process holds; ``call(fn, tmp)`` runs ``fn(rank, world)``
    on each and returns rank 0's result. ``env``: the ranks' environment (default: the session's at its start)."""

    def __init__(self, world: int, backend: str = "gloo", env: dict | None = None):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.world = world
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        ctx = _context(mp, env)
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.SimpleQueue() for _ in range(world)]
        self.procs = [
            ctx.Process(
                target=_serve,
                name=f"loom-test-rank{r}",
                args=(r, world, self.store.port, backend, self.inboxes[r], self.outbox),
            )
            for r in range(world)
        ]
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(SESSION_ENV if env is None else env)
        try:
            for p in self.procs:
                p.start()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def call(self, fn, tmp: str):
        for box in self.inboxes:
            box.put((fn, tmp))
        replies: dict[int, tuple[str, object]] = {}
        start = time.monotonic()
        deadline = start + HANG_SECONDS * _jobs_in(fn) + 60
        while len(replies) < self.world:
            try:
                rank, status, payload = self.outbox.get(timeout=0.5)
                replies[rank] = (status, payload)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if r not in replies and not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    why = f"rank(s) {dead} died" if dead else f"no reply in {deadline - start:.0f} s"
                    raise RankFailure(
                        f"{why} running {_name(fn)} on {self.world} ranks (stacks above)"
                    ) from None
        errors = [f"rank {r}:\n{p}" for r, (s, p) in sorted(replies.items()) if s == "error"]
        if errors:
            raise RankFailure("\n".join(errors))
        return replies[0][1]

    def close(self, grace: float = 10.0) -> None:
        """Stop the ranks: politely when they are idle, then by force; none outlives this call."""
        for box in self.inboxes:
            try:
                box.put(None)
            except (OSError, ValueError):
                pass
        end = time.monotonic() + grace
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


# what a rank imports to run a job: the fork server imports it once, and each rank forked from it starts with it
# imported (spawned, every rank of every call imported torch and loom anew: most of a layout test's CPU time)
PRELOAD = [
    "tests.distributed.harness",
    "loom.train.trainer",
    "torch.distributed.pipelining",
    "torch._inductor.compile_fx",
]


def _context(mp, env: dict | None):
    """Ranks in the session's environment are forked from a fork server that never joined a group (no state to
    inherit but imports); ranks with an environment of their own (``env``) are spawned with it."""
    if env is not None or not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    from loom.config.methods import METHODS

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + sorted({module for module, _ in METHODS.values()}))
    return ctx


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", repr(fn))


_POOLS: dict[tuple[int, str], Pool] = {}


# Reusing ranks across calls (LOOM_TEST_REUSE_RANKS=1) is off by default: in its second call on reused ranks, the
# PP x TP resharding test (test_model_parallel, slow) fails in the embedding's TP redistribute with "Could not
# resolve the process group registered under the name 15" (a stale mesh outlives the group's teardown; clearing
# DTensor's sharding-propagation caches between jobs did not cure it) or hangs, so each call starts its ranks, as
# mp.spawn did, over the store of this process.
REUSE_RANKS = os.environ.get("LOOM_TEST_REUSE_RANKS") == "1"


def pool_call(world: int, fn, tmp_dir: str, backend: str = "gloo"):
    """``fn(rank, world)`` on ``world`` ranks: the session's pool (LOOM_TEST_REUSE_RANKS=1; a failed or
    interrupted call ends it), else ranks started for this call."""
    if not REUSE_RANKS:
        pool = Pool(world, backend)
        try:
            return pool.call(fn, str(tmp_dir))
        finally:
            pool.close()
    key = (world, backend)
    if key not in _POOLS:
        _POOLS[key] = Pool(world, backend)
    try:
        return _POOLS[key].call(fn, str(tmp_dir))
    except BaseException:  # an error, a hang, or the test's timeout: the group's state is unknown
        _POOLS.pop(key).close(grace=2.0)
        raise


@atexit.register
def close_pools() -> None:
    """Every pooled rank stopped (the session's end; conftest calls it too)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def pool_pids() -> set[int]:
    return {p.pid for pool in _POOLS.values() for p in pool.procs if p.pid is not None}


# ---- what tests call ------------------------------------------------------------------------------------------


def _jobs_in(fn) -> int:
    """How many jobs a call runs (its ranks' watchdog restarts at each): ``_jobs_on_rank``'s list, else 1."""
    return len(fn.args[0]) if getattr(fn, "func", None) is _jobs_on_rank else 1


def _jobs_on_rank(jobs: list[dict], rank: int, world: int) -> list[dict]:
    """Each job in turn on this rank; a failed job is reported with its traceback and the rest still run."""
    import torch.distributed as dist

    results = []
    for job in jobs:
        start = time.monotonic()
        faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)  # the hang watchdog counts per job
        try:
            results.append({"records": run_one(job), "seconds": time.monotonic() - start})
        except Exception:
            results.append({"error": traceback.format_exc()})
            traceback.print_exc()  # now, too: a peer may hang in a collective before the report
            dist.barrier()
        gc.collect()
    return results


def run_jobs(world: int, jobs: list[dict], tmp_dir: str, fresh: bool = False) -> list[dict]:
    """Each job's rank-0 records (``{"records": [...]}``, or ``{"error": traceback}``), one process per rank.
    ``fresh``: on ranks started for this call, with the test's environment and output capture (a fault injected
    through variables, output checked with ``capfd``), instead of the session's pool."""
    import functools

    if world == 1:
        results = []
        for job in jobs:
            start = time.monotonic()
            results.append({"records": run_one(job), "seconds": time.monotonic() - start})
    elif fresh:
        pool = Pool(world, env=dict(os.environ))
        try:
            results = pool.call(functools.partial(_jobs_on_rank, jobs), tmp_dir)
        finally:
            pool.close()
    else:
        results = pool_call(world, functools.partial(_jobs_on_rank, jobs), tmp_dir)
        # start afresh after a failed job
        if any("error" in r for r in results) and (world, "gloo") in _POOLS:
            _POOLS.pop((world, "gloo")).close()
    _log_times(world, jobs, results)
    return results


def _log_times(world: int, jobs: list[dict], results: list[dict]) -> None:
    """With LOOM_TEST_JOB_TIMES=path, each job's seconds on rank 0 go to that file as a JSON line: where a layout
    test's time goes, job by job (pytest's --durations sees only the whole test)."""
    path = os.environ.get("LOOM_TEST_JOB_TIMES")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    with open(path, "a") as fh:
        for job, res in zip(jobs, results):
            fh.write(
                json.dumps(
                    {
                        "test": test,
                        "world": world,
                        "job": os.path.basename(str(job.get("run.dir", "?"))),
                        "seconds": round(res.get("seconds", -1), 1),
                    }
                )
                + "\n"
            )


def run_fn(world: int, fn, tmp_dir: str):
    """Run ``fn(rank, world)`` (a module-level function or a partial of one) on ``world`` gloo ranks; rank 0's
    JSON result. Inside, ``job_tmp()`` is ``tmp_dir``."""
    return pool_call(world, fn, tmp_dir)


_REFERENCES: dict[str, list[dict]] = {}


def reference(job: dict) -> list[dict]:
    """A single-process run's records, computed once per session per configuration (the job without its paths):
    test files that compare layouts against the same configuration share it."""
    key = json.dumps({k: str(v) for k, v in job.items() if k not in PATH_KEYS}, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_one(job)
    return json.loads(json.dumps(_REFERENCES[key]))


def losses(result: dict) -> list[float]:
    assert "error" not in result, result["error"]
    return [r["loss"] for r in result["records"]]
