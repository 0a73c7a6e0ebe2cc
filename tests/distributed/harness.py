"""Run several training jobs inside one process group per world size (process start dominates cost).

``run_jobs(world, jobs)`` spawns ``world`` gloo ranks once; each rank builds a Trainer for every job
in turn (same group, fresh meshes) and rank 0 returns each job's logged records.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import traceback

import torch.multiprocessing as mp

HANG_SECONDS = int(os.environ.get("LOOM_TEST_HANG_SECONDS", "300"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(overrides: dict) -> list[dict]:
    """One job in this process (distributed or not); returns rank 0's records."""
    from loom.config import build_config
    from loom.parallel.env import init_distributed
    from loom.train.trainer import Trainer

    cfg = build_config(None, {k: str(v) for k, v in overrides.items()})
    trainer = Trainer(cfg, env=init_distributed(cfg.run.device, cfg.parallel.backend))
    return trainer.fit()


def _worker(rank: int, world: int, port: int, jobs: list[dict], out_path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a native crash (SIGABRT/SIGSEGV) prints every thread's Python stack
    dist.init_process_group("gloo")
    results = []
    try:
        for job in jobs:
            # a hang fails loudly, with stacks; the timer covers one job, not the sum of all of them
            faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
            try:
                results.append({"records": run_one(job)})
            except Exception:  # keep going: report the failure with its traceback
                results.append({"error": traceback.format_exc()})
                traceback.print_exc()  # now, too: a peer may hang in a collective before the report
                dist.barrier()
    finally:
        gc.collect()  # trainers (DDP reducers hold the group) go before the group does
        _teardown(dist)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(results, fh)
    _exit_now()


def _exit_now() -> None:
    """End a rank whose work is done and reported without the interpreter's shutdown: on gloo, a rank that had run
    functional collectives (context parallelism's all-gathers) was sometimes killed at exit by PyTorch's C++
    teardown ('terminate called without an active exception', SIGABRT; about 1 in 25 runs of a 2-rank CP test,
    torch 2.13 CPU) after its results were written, which failed the test. The results are on disk; stop here."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _teardown(dist) -> None:
    """All ranks meet before the group goes: none closes its connections while a peer still uses them."""
    import faulthandler

    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def run_jobs(world: int, jobs: list[dict], tmp_dir: str) -> list[dict]:
    out = os.path.join(tmp_dir, f"results_w{world}_{os.getpid()}.json")
    if world == 1:
        return [{"records": run_one(job)} for job in jobs]
    mp.spawn(_worker, args=(world, free_port(), jobs, out), nprocs=world, join=True)
    with open(out) as fh:
        return json.load(fh)


def losses(result: dict) -> list[float]:
    assert "error" not in result, result["error"]
    return [r["loss"] for r in result["records"]]


def _fn_worker(rank: int, world: int, port: int, fn, out_path: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    dist.init_process_group("gloo")
    try:
        result = fn(rank, world)
    finally:
        _teardown(dist)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    _exit_now()


def run_fn(world: int, fn, tmp_dir: str):
    """Run ``fn(rank, world)`` (a module-level function) on ``world`` gloo ranks; rank 0's JSON result."""
    out = os.path.join(tmp_dir, f"fn_w{world}_{os.getpid()}.json")
    mp.spawn(_fn_worker, args=(world, free_port(), fn, out), nprocs=world, join=True)
    with open(out) as fh:
        return json.load(fh)
