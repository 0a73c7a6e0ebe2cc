"""Peak memory: reserved CUDA memory on GPU, peak resident set size on CPU."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def peak_allocated_gib(device: torch.device) -> float | None:
    """The most memory tensors held at once (CUDA; None elsewhere): the reserved peak also counts the caching
    allocator's free blocks, and near the card's capacity it reads the capacity whatever the tensors needed."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
