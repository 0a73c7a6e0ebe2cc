"""Measurements across a job's ranks for ``loom doctor``: all-reduce / all-gather bandwidth as nccl-tests
reports it (algbw, busbw) and a fixed GEMM's TFLOP/s per rank, with the rule that names a slow one."""

from __future__ import annotations

import os
import statistics
import time

MIB = 1 << 20


BUS_FACTOR = {
    # nccl-tests, doc/PERFORMANCE.md: busbw = algbw x factor, so it compares with the hardware's link bandwidth
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
}


def bandwidth(op: str, nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) as nccl-tests defines them. ``nbytes`` is nccl-tests' size: the buffer
    of an all-reduce, the gathered output (n x each rank's part) of an all-gather."""
    algbw = nbytes / 1e9 / seconds
    return algbw, algbw * BUS_FACTOR[op](n)


def default_sizes(device_type: str) -> list[int]:
    return (
        [1 * MIB, 32 * MIB, 256 * MIB, 1024 * MIB] if device_type == "cuda" else [64 << 10, 1 * MIB, 8 * MIB]
    )


def collective_test(op: str, sizes: list[int], iters: int, device, warmup: int = 2) -> list[dict]:
    """Time ``op`` (all_reduce / all_gather, float32 as nccl-tests by default) at each size over the default
    group; each rank's mean time per call is averaged over ranks (nccl-tests' default), then the results are
    checked once with known data. Every rank gets the same rows."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rows = []
    for size in sizes:
        per_rank = max(1, size // 4 // n) if op == "all_gather" else max(1, size // 4)
        nbytes = per_rank * 4 * (n if op == "all_gather" else 1)
        inp = torch.zeros(per_rank, dtype=torch.float32, device=device)  # (per_rank,)
        out = torch.empty(per_rank * n, dtype=torch.float32, device=device) if op == "all_gather" else inp

        def call():
            if op == "all_reduce":
                dist.all_reduce(inp)
            else:
                gather(out, inp)

        for _ in range(warmup):
            call()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        _sync(device)
        seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(seconds)
        t = float(seconds) / n
        algbw, busbw = bandwidth(op, nbytes, t, n)
        rows.append(
            {
                "op": op,
                "bytes": nbytes,
                "time_us": t * 1e6,
                "algbw_gbps": algbw,
                "busbw_gbps": busbw,
                "wrong": _verify(op, inp, out, rank, n, gather),
            }
        )
    return rows


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _verify(op, inp, out, rank, n, gather) -> int:
    """Wrong elements after one call with known data (rank r contributes r + 1), agreed over ranks."""
    import torch
    import torch.distributed as dist

    inp.fill_(rank + 1)
    if op == "all_reduce":
        dist.all_reduce(inp)
        wrong = (inp != n * (n + 1) / 2).sum()
    else:
        gather(out, inp)
        expect = torch.arange(1, n + 1, dtype=out.dtype, device=out.device).repeat_interleave(inp.numel())
        wrong = (out != expect).sum()
    wrong = wrong.to(torch.int64).reshape(1)
    dist.all_reduce(wrong)
    return int(wrong)


def matmul_tflops(device, size: int, iters: int, warmup: int = 2) -> dict:
    """TFLOP/s of a fixed square GEMM (size^3, 2 size^3 FLOPs): bf16 on a GPU, fp32 on the CPU."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=gen, device=device, dtype=dtype)  # (size, size)
    b = torch.randn(size, size, generator=gen, device=device, dtype=dtype)  # (size, size)
    for _ in range(warmup):
        c = a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        c = a @ b  # (size, size)
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    return {
        "tflops": 2 * size**3 / seconds / 1e12,
        "dtype": str(dtype).removeprefix("torch."),
        "size": size,
        "finite": bool(torch.isfinite(c).all()),
    }


def flag_slow(results: list[dict], fraction: float) -> tuple[float, list[dict]]:
    """(median TFLOP/s, the results more than ``fraction`` below it)."""
    median = statistics.median(r["tflops"] for r in results)
    return median, [r for r in results if r["tflops"] < median * (1 - fraction)]


def physical_gpu(local_index: int) -> str:
    """The host's GPU index behind this process's CUDA device (CUDA_VISIBLE_DEVICES renumbers them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        items = [s.strip() for s in visible.split(",")]
        if local_index < len(items):
            return items[local_index]
    return str(local_index)
