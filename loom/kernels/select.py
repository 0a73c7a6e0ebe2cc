"""Pick the fastest of several implementations of one op by timing them on the running device and shape.

Used for ``model.attention = auto`` on CUDA (plain causal attention: PyTorch SDPA with cuDNN first vs loom's
Triton kernel): the answer depends on the GPU, head dim, sequence and Triton/cuDNN versions, so a run
measures it once at start-up instead of trusting a table measured elsewhere.
"""

from __future__ import annotations

import math
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


def time_fwd_bwd(fn: Callable, inputs: list[torch.Tensor], warmup: int = 3, iters: int = 10) -> float:
    """Milliseconds per forward + backward of ``fn(*inputs)`` on CUDA (the first calls, which may compile
    or autotune, are warm-up; gradients are reset before every call)."""
    def step():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)

    grad = torch.ones_like(fn(*inputs))
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


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
