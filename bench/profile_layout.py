"""Where a layout's step time goes, from a torch.profiler trace: compute kernels, communication (NCCL)
kernels, how much communication no compute kernel overlaps (exposed), and how long the GPU runs no
kernel at all (idle: launch-bound host, waits).

Run under torchrun, one process per GPU, with loom config overrides:

    torchrun --nproc-per-node 2 bench/profile_layout.py --out prof.json -- --model.flavor=1B --parallel.dp_shard=2 ...

Rank 0 writes every rank's figures (milliseconds per step, fractions of the step) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(xs, ys) -> float:
    """Total overlap of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_breakdown(prof, steps: int, wall_ms: float) -> dict:
    """Per step: compute / communication kernel time (unions), exposed communication, GPU idle."""
    from torch.autograd import DeviceType

    comm, compute = [], []
    for ev in prof.events():
        if ev.device_type != DeviceType.CUDA:
            continue
        span = (ev.time_range.start / 1e3, ev.time_range.end / 1e3)  # ms
        (comm if "nccl" in ev.name.lower() else compute).append(span)
    comm, compute = union(comm), union(compute)
    busy = union(comm + compute)
    per = 1.0 / steps
    return {
        "step_ms": wall_ms * per,
        "compute_ms": length(compute) * per,
        "comm_ms": length(comm) * per,
        "comm_exposed_ms": (length(comm) - intersect(comm, compute)) * per,
        "gpu_idle_ms": (wall_ms - length(busy)) * per,
        "gpu_idle_fraction": 1 - length(busy) / wall_ms,
        "comm_exposed_fraction": (length(comm) - intersect(comm, compute)) / wall_ms,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="profile_layout.json")
    p.add_argument("overrides", nargs="*", help="-- then loom --section.field=value overrides")
    a = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from loom.config import build_config, parse_overrides
    from loom.train.trainer import Trainer

    cfg = build_config(None, parse_overrides(a.overrides))
    cfg.training.steps = a.warmup + a.steps
    trainer = Trainer(cfg)
    for _ in range(a.warmup):
        trainer.train_step(trainer.loader.next_step().micro_batches)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            trainer.train_step(trainer.loader.next_step().micro_batches)
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    mine = kernel_breakdown(prof, a.steps, wall_ms)
    mine["rank"] = dist.get_rank() if dist.is_initialized() else 0
    everyone = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if mine["rank"] == 0:
        with open(a.out, "w") as fh:
            json.dump({"overrides": a.overrides, "torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "ranks": everyone}, fh, indent=1)
        for r in everyone:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
