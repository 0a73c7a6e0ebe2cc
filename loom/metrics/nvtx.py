"""NVTX ranges for Nsight Systems (``metrics.nvtx = true``; docs/metrics.md gives the ``nsys profile`` command).

The trainer marks each step, its data wait, micro-batches, forward / backward (``forward_backward`` for a pipeline
schedule run), each transformer block's forward and backward (hooks; not under torch.compile), the optimizer
phase (grad norm, step), validation and checkpoint saves; context parallelism marks
its K/V all-gather and each ring step; the loss and token all-reduces are marked too. Ranges are pushed and popped
on the thread that opens them (``torch.cuda.nvtx.range_push`` / ``range_pop``), so they nest on nsys's timeline
under the CPU thread and project onto the GPU kernels they launch. Off (the default) each range is a shared no-op
context: a flag test; so is on, in a PyTorch built without CUDA (no NVTX library: the banner says the setting
has no effect). Inside a ``torch.compile`` trace nothing is pushed (Dynamo would have to trace it).
"""

from __future__ import annotations

import contextlib

import torch

OFF = contextlib.nullcontext()  # stateless: one shared no-op context (loom.metrics.profile's too)
_enabled = False
_why_off = ""  # why ranges asked for stay off in this process ("" = they do as asked)


def unavailable() -> str:
    """Why this PyTorch cannot emit NVTX ranges ("" = it can): a build without CUDA has no NVTX library."""
    try:
        torch.cuda.nvtx.range_push("loom.nvtx.check")
        torch.cuda.nvtx.range_pop()
    except (RuntimeError, AttributeError) as err:
        return f"this PyTorch ({torch.__version__}) cannot emit NVTX ranges: {str(err).splitlines()[0]}"
    return ""


def enable(on: bool) -> str:
    """Turn NVTX ranges on or off for this process (the trainer, from metrics.nvtx) -> why they stay off though
    asked for ("" = they do as asked): a PyTorch without NVTX accepts the setting and pushes nothing."""
    global _enabled, _why_off
    _why_off = unavailable() if on else ""
    _enabled = bool(on) and not _why_off
    return _why_off


def why_off() -> str:
    """Why the last ``enable(True)`` left ranges off ("" = it did not)."""
    return _why_off


def enabled() -> bool:
    return _enabled


class NvtxRange:
    """An NVTX range as a context (pushed on entry, popped on exit), whatever ``enabled`` says."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc):
        torch.cuda.nvtx.range_pop()
        return False


def nvtx_range(name: str):
    """A context that pushes NVTX range ``name`` on entry and pops it on exit when ranges are on (and not inside
    a torch.compile trace), else a shared no-op context."""
    if not _enabled or torch.compiler.is_compiling():
        return OFF
    return NvtxRange(name)
