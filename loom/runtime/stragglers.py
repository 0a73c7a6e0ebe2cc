"""Stragglers: at every logged step each rank's step time, data wait and time in collectives are gathered with one
small all_gather, and a rank whose own time per step exceeds the ranks' median by more than
``metrics.straggler_fraction`` is named (docs/operations.md: Stragglers).

In synchronous training every rank's step takes as long as the slowest one's: the others wait for it inside the
collectives. A rank's own time is therefore its step time less that wait:

* on a GPU, the wait is the time NCCL collectives ran on the device (CUDA events that PyTorch records with
  TORCH_NCCL_ENABLE_TIMING, summed by an on-completion hook on each NCCL group): a slow rank's collectives find
  the others there and finish at once, the others' collectives wait for it;
* on the CPU (gloo), where a rank waiting in a collective sleeps, own time is the data wait plus the CPU time
  the process used outside the loader, per intra-op thread; collectives are not timed (``comm_time`` is null).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import threading
import time

import torch

RANKS_FILE = "ranks.jsonl"  # per-rank figures of every logged step, written by rank 0
FIELDS = ("step_time", "data_wait", "comm_time", "own_time")


class CommTimer:
    """Seconds this rank's NCCL collectives ran (CUDA-event durations from each group's on-completion hook).
    Needs TORCH_NCCL_ENABLE_TIMING=1 before the groups formed (loom.runtime.health.process_env sets it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seconds = 0.0
        self.groups = 0

    def attach(self) -> bool:
        """Hook every NCCL group of this process; False where none could be (no CUDA, timing off)."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not (
            dist.is_initialized()
            and torch.cuda.is_available()
            and os.environ.get("TORCH_NCCL_ENABLE_TIMING") == "1"
        ):
            return False
        for pg in list(c10d._world.pg_map):
            with contextlib.suppress(Exception):  # a gloo group, or a group without this rank
                pg._register_on_completion_hook(self._hook)
                self.groups += 1
        return self.groups > 0

    def _hook(self, info) -> None:
        d = getattr(info, "active_duration", None)
        seconds = d.total_seconds() if hasattr(d, "total_seconds") else float(d or 0.0)
        if seconds > 0:
            with self._lock:
                self._seconds += seconds

    def take(self) -> float:
        """Seconds since the last call."""
        with self._lock:
            s, self._seconds = self._seconds, 0.0
        return s


def find_stragglers(own: list[float], fraction: float) -> list[int]:
    """The ranks whose own time exceeds the median by more than ``fraction`` of it."""
    if fraction <= 0 or len(own) < 2:
        return []
    med = statistics.median(own)
    return [r for r, t in enumerate(own) if t > med * (1 + fraction)]


def summarize(per_rank: dict[str, list[float | None]], fraction: float) -> dict:
    """The metrics.jsonl fields from every rank's figures (``per_rank[field][rank]``, None where not measured)."""
    out: dict = {}
    for name in FIELDS:
        values = [v for v in per_rank[name] if v is not None]
        out[f"{name}_median"] = statistics.median(values) if values else None
        out[f"{name}_max"] = max(values) if values else None
    out["straggler_ranks"] = find_stragglers(per_rank["own_time"], fraction)
    return out


def straggler_line(step: int, per_rank: dict[str, list[float | None]], stragglers: list[int]) -> str:
    """The console line rank 0 prints for an interval with stragglers."""
    med = statistics.median(per_rank["own_time"])
    parts = []
    for r in stragglers[:8]:
        own = per_rank["own_time"][r]
        comm = per_rank["comm_time"][r]
        parts.append(
            f"rank {r} {own:.3f} s/step of its own vs median {med:.3f} s (+{100 * (own / med - 1):.0f}%; "
            f"data wait {per_rank['data_wait'][r]:.3f} s"
            + (f", in collectives {comm:.3f} s" if comm is not None else "")
            + ")"
        )
    more = f" and {len(stragglers) - 8} more" if len(stragglers) > 8 else ""
    # not "step N: ...": tools read lines that start with "step " as metric lines
    return f"straggler{'s' if len(stragglers) > 1 else ''} at step {step}: " + "; ".join(parts) + more


class Stragglers:
    """One rank's timing of each logged interval, gathered on ``group`` (a gloo group, or None for the default
    one when it is gloo: no device work). ``fraction`` 0 turns it off (nothing is measured or gathered)."""

    def __init__(self, env, fraction: float, run_dir: str, device: torch.device, group=None):
        self.env, self.fraction, self.run_dir, self.group = env, fraction, run_dir, group
        self.enabled = fraction > 0 and env.world_size > 1
        self.comm = CommTimer() if self.enabled and device.type == "cuda" else None
        if self.comm is not None and not self.comm.attach():
            self.comm = None
        self._threads = max(1, torch.get_num_threads())
        self._fresh = False  # the next data wait starts the interval (``start``)
        self._reset()

    def start(self, step: int) -> None:
        """Training starts (or resumes) at ``step``: rank 0 drops ranks.jsonl's records past it, as metrics.jsonl's.
        The first interval is timed from the first step's data wait (not the banner and start-up barrier before)."""
        if self.enabled and self.env.is_main:
            from loom.metrics.logger import rewind_metrics

            rewind_metrics(os.path.join(self.run_dir, RANKS_FILE), step)
        self._fresh = True

    def _reset(self) -> None:
        self._steps, self._data_s, self._data_cpu = 0, 0.0, 0.0
        self._cpu0 = time.process_time()
        if self.comm is not None:
            self.comm.take()

    @contextlib.contextmanager
    def data_wait(self):
        """Around the loader's ``next_step``: one step's data wait."""
        if not self.enabled:
            yield
            return
        if self._fresh:
            self._fresh = False
            self._reset()
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._steps += 1
            self._data_s += time.perf_counter() - t0
            self._data_cpu += time.process_time() - c0

    def local(self, seconds: float) -> list[float]:
        """This rank's figures per step over the interval of ``seconds`` (FIELDS; NaN: not measured)."""
        n = max(1, self._steps)
        step_time, data = seconds / n, self._data_s / n
        if self.comm is not None:
            comm = self.comm.take() / n
            own = max(0.0, step_time - comm)
        else:
            comm = math.nan
            cpu = max(0.0, time.process_time() - self._cpu0 - self._data_cpu) / n / self._threads
            own = data + cpu
        return [step_time, data, comm, own]

    def interval(self, step: int, seconds: float) -> dict:
        """Every rank: gather the interval's figures (one all_gather); rank 0 gets the metrics.jsonl fields, prints
        the stragglers and appends the per-rank figures to ranks.jsonl; the other ranks get {}."""
        if not self.enabled:
            return {}
        import torch.distributed as dist

        mine = torch.tensor(self.local(seconds), dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        self._reset()
        if not self.env.is_main:
            return {}
        table = torch.stack(gathered).tolist()  # [world][FIELDS]
        per_rank = {
            name: [None if math.isnan(row[i]) else row[i] for row in table] for i, name in enumerate(FIELDS)
        }
        fields = summarize(per_rank, self.fraction)
        if fields["straggler_ranks"]:
            print(straggler_line(step, per_rank, fields["straggler_ranks"]), flush=True)
        with open(os.path.join(self.run_dir, RANKS_FILE), "a") as fh:
            fh.write(json.dumps({"step": step, **per_rank}) + "\n")
        return fields
