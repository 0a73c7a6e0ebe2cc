"""Pick the fastest of several implementations of one op by timing them on the running device and shape.

Used for ``model.attention = auto`` on CUDA (plain causal attention: PyTorch SDPA, cuDNN on H100, vs loom's Triton
kernel): the answer depends on the GPU, head dim, sequence and Triton/cuDNN versions, so a run
measures it once at start-up instead of trusting a table measured elsewhere.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class AttentionShape:
    """What one rank's attention call sees: q (batch, heads, seq, head_dim), k/v with kv_heads."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    dtype: torch.dtype

    def describe(self) -> str:
        return (f"{self.batch}x{self.heads}/{self.kv_heads}x{self.seq}x{self.head_dim} "
                f"{str(self.dtype).removeprefix('torch.')}")


def attention_inputs(shape: AttentionShape, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """Random q, k, v (B, H, S, D) leaves that need gradients."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape.batch, h, shape.seq, shape.head_dim, device=device, dtype=shape.dtype,
                        generator=gen).requires_grad_() for h in (shape.heads, shape.kv_heads, shape.kv_heads)]


@functools.cache
def sleep_cycles_per_ms(device: int) -> float:
    """GPU cycles of ``torch.cuda._sleep`` per millisecond on CUDA device ``device`` (measured once per device)."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


@dataclass(frozen=True)
class QueuedTiming:
    gpu_ms: float  # GPU time per call
    cpu_issue_ms: float  # CPU time to issue one call
    cpu_ahead: bool  # whether the CPU had issued every call before the GPU reached the first


def queued_timing(step: Callable[[], None], iters: int, sleep_ms: float) -> QueuedTiming:
    """``iters`` calls of ``step`` queued behind a GPU sleep of ``sleep_ms``: while the CPU issues them the GPU
    sleeps, so the events around them time the GPU's execution alone (if the CPU got ahead)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_ms * sleep_cycles_per_ms(torch.cuda.current_device())) + 1000)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    issue_ms = (time.perf_counter() - t0) * 1e3 / iters
    ahead = not start.query()  # the start event still pending: the GPU had not reached the first call yet
    end.record()
    torch.cuda.synchronize()
    return QueuedTiming(start.elapsed_time(end) / iters, issue_ms, ahead)


def fwd_bwd_step(fn: Callable, inputs: list[torch.Tensor]) -> Callable[[], None]:
    """One forward + backward of ``fn(*inputs)`` with gradients reset first."""
    grad = torch.ones_like(fn(*inputs))

    def step():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)
    return step


def time_fwd_bwd(fn: Callable, inputs: list[torch.Tensor], warmup: int = 3, iters: int = 10) -> float:
    """GPU milliseconds per forward + backward of ``fn(*inputs)`` on CUDA (the first calls, which may compile or
    autotune, are warm-up).

    The timed calls queue behind a GPU sleep long enough for the CPU to issue them all first, so launch overhead
    is not counted: in a training step the CPU runs ahead of the GPU (the other layers' kernels queue up) and
    a call costs its GPU time. Timing back-to-back calls measured the launch path instead wherever issuing a call
    took the CPU longer than running it took the GPU (loom's kernel at 4x32/8x2048x64 on H100: 1.60 ms back to
    back, 0.80 ms on the GPU; bench/results/attention_overhead_h100.json)."""
    step = fwd_bwd_step(fn, inputs)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    sleep_ms = 2 * iters * (time.perf_counter() - t0) * 1e3  # the calls' issue time is below their wall time
    timing = queued_timing(step, iters, sleep_ms)
    for _ in range(2):  # a CPU slower than the estimate (another process, a page fault): longer sleeps
        if timing.cpu_ahead:
            break
        sleep_ms *= 4
        timing = queued_timing(step, iters, sleep_ms)
    return timing.gpu_ms


def measure(candidates: dict[str, Callable], inputs: list[torch.Tensor], timer=time_fwd_bwd) -> dict[str, float]:
    """Milliseconds per call of each candidate; one that fails (unsupported shape, out of memory, a kernel
    that does not compile for this GPU) gets inf, so it is never chosen, and the others are still measured."""
    times = {}
    for name, fn in candidates.items():
        try:
            times[name] = timer(fn, inputs)
        except Exception as e:  # noqa: BLE001 - any failure only rules the candidate out
            print(f"kernels: {name} not usable here ({type(e).__name__}: {str(e).splitlines()[0][:120]})",
                  flush=True)
            times[name] = math.inf
        for t in inputs:
            t.grad = None
    return times


def fastest(times: dict[str, float]) -> str:
    """The name with the smallest time; ties go to the first listed."""
    if not times or all(math.isinf(t) for t in times.values()):
        raise RuntimeError(f"no candidate ran: {times}")
    return min(times, key=lambda name: times[name])
