"""Built-in profiling of a window of optimizer steps (``metrics.profile_steps = "A:B"``).

Over steps A..B (1-based, as the trainer logs them; the profiler warms up over step A - 1, whose events it
drops) every rank writes to ``<run.dir>/profile/``:

* ``trace_rank<r>.json``: a ``torch.profiler`` trace (Chrome / Perfetto JSON; CPU, plus CUDA on a GPU) with
  named ranges: ``ProfilerStep#<n>`` per step (torch.profiler's own step ranges, numbered as the trainer's
  steps), ``forward`` / ``backward`` / ``optimizer`` (``forward_backward`` for a
  pipeline schedule run) from the trainer, and ``block.<i>`` / ``block.<i>.backward`` per transformer block
  from hooks. The collectives of FSDP2 / DDP / TP / PP carry their own names (``c10d::`` ops, ``gloo:`` or
  ``nccl:`` ranges, NCCL kernels). With ``metrics.profile_host = false`` (CUDA) the GPU's activity alone: kernels,
  copies and their launch calls, no host ops or ranges; the trace's ``loom_profiled_steps`` says how many steps.
* on CUDA, ``memory_snapshot_rank<r>.pickle``: the allocator's history over the window (pytorch.org/memory_viz).

Outside the window nothing is registered and ``phase`` hands back a shared no-op context: profiling that is
off costs an attribute test per phase.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn
from torch.autograd.profiler import record_function

from loom.metrics.nvtx import OFF, NvtxRange, nvtx_range
from loom.metrics.trace_summary import STEPS_KEY

_OFF = OFF  # stateless, so one instance serves every phase
MEMORY_HISTORY_ENTRIES = 100_000  # allocator events kept (the oldest are dropped): bounds the snapshot's size


class _Both:
    """Two contexts entered in order and left in reverse (a profiler range and an NVTX range of one phase)."""

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner

    def __enter__(self):
        self.outer.__enter__()
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        self.outer.__exit__(*exc)
        return False


class BlockRanges:
    """``block.<i>`` (forward) and ``block.<i>.backward`` ranges for transformer blocks, from hooks that
    this class registers and removes, so the model code holds no profiling calls.

    Forward: a module pre-hook (prepended, so it runs before FSDP2's all-gather hook) opens the range and a
    module post-hook (appended, after FSDP2's reshard) closes it. Backward: a gradient hook on the block's
    output opens ``block.<i>.backward`` when the gradient reaches the block, and one on its input closes it
    when the block's input gradient is done (with split-backward pipeline schedules that is the input
    gradient only). Backward runs one block at a time per thread, so opening a backward range first closes
    any other one: block i's input is block i-1's output, and its two hooks run in registration order."""

    def __init__(self, blocks: dict[str, nn.Module], opener=record_function):
        """``opener(name)``: the range's context (a profiler range, or ``NvtxRange`` for metrics.nvtx)."""
        self._opener = opener
        self._open: dict[str, object] = {}
        self._closed = False
        self._handles = []
        for name, block in blocks.items():
            self._handles.append(
                block.register_forward_pre_hook(functools.partial(self._pre, name), prepend=True)
            )
            self._handles.append(block.register_forward_hook(functools.partial(self._post, name)))

    def _enter(self, key: str) -> None:
        if self._closed or key in self._open:
            return
        rf = self._opener(key)
        rf.__enter__()
        self._open[key] = rf

    def _exit(self, key: str) -> None:
        rf = self._open.pop(key, None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def _enter_backward(self, key: str, grad) -> None:
        for open_key in [k for k in self._open if k.endswith(".backward")]:
            self._exit(open_key)
        self._enter(key)

    def _exit_backward(self, key: str, grad) -> None:
        self._exit(key)

    def _pre(self, name: str, module: nn.Module, args: tuple) -> None:
        self._enter(f"block.{name}")
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(functools.partial(self._exit_backward, f"block.{name}.backward"))

    def _post(self, name: str, module: nn.Module, args: tuple, out) -> None:
        self._exit(f"block.{name}")
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(functools.partial(self._enter_backward, f"block.{name}.backward"))

    def close(self) -> None:
        """Remove the module hooks and end any range left open (a step cut short); gradient hooks still
        attached to live graphs become no-ops."""
        self._closed = True
        for handle in self._handles:
            handle.remove()
        for key in list(self._open):
            self._exit(key)


def nvtx_block_ranges(blocks: dict[str, nn.Module] | None) -> BlockRanges | None:
    """``block.<i>`` / ``block.<i>.backward`` NVTX ranges for the whole run (metrics.nvtx; ``blocks`` None under
    torch.compile: none). Backward ranges open and close on the thread that runs the block's backward (autograd's
    device thread on CUDA), so each thread's NVTX stack stays balanced."""
    return BlockRanges(blocks, opener=NvtxRange) if blocks else None


def transformer_blocks(parts: list[nn.Module]) -> dict[str, nn.Module]:
    """This rank's blocks by their model-wide index (the ``layers`` keys survive pipeline splitting)."""
    return {name: block for part in parts for name, block in part.layers.items()}


class StepProfiler:
    """One job: profile optimizer steps ``window = (first, last)`` on this rank (``None`` = off).

    The trainer calls ``start(step)`` before each step, wraps its phases in ``phase(name)`` and calls
    ``step_done(step)`` after it; ``close()`` (in a ``finally``) writes out a window that training left early.
    ``blocks`` are the modules that get ``block.<i>`` ranges (``None``: none, e.g. under torch.compile,
    where the hooks would run inside the compiled graph)."""

    def __init__(
        self,
        window: tuple[int, int] | None,
        run_dir: str,
        rank: int,
        device: torch.device,
        blocks: dict[str, nn.Module] | None = None,
        is_main: bool = True,
        no_snapshot: str = "",
        host: bool = True,
    ):
        self.window = window
        self.out_dir = os.path.join(run_dir, "profile")
        self.rank, self.device, self.blocks, self.is_main = rank, device, blocks, is_main
        self.cuda = device.type == "cuda"
        self.host = host  # metrics.profile_host: the host's ops recorded too (False: the GPU alone, on CUDA)
        # why this run writes no memory snapshot on CUDA ("" = it writes one)
        self.no_snapshot = no_snapshot
        self.snapshot = self.cuda and not no_snapshot
        self._prof: torch.profiler.profile | None = None
        self._block_ranges: BlockRanges | None = None
        self._first_step = self._last_step = 0
        self._snapshotting = self._exported = False
        self.done = False

    @property
    def active(self) -> bool:
        return self._prof is not None

    def phase(self, name: str):
        """A named range while the window is being profiled, and an NVTX range with metrics.nvtx; else a shared
        no-op context."""
        nvtx = nvtx_range(name)
        if self._prof is None:
            return nvtx
        return record_function(name) if nvtx is _OFF else _Both(record_function(name), nvtx)

    def start(self, step: int) -> None:
        """Begin profiling at the step before the window (a warm-up step whose events are dropped: the profiler's
        start-up costs fall there, not in the window, as torch.profiler's schedules and torchtitan do), or at the
        window's first step, or at a later one after a resume; once running, torch.profiler opens each step's
        ``ProfilerStep#<step>`` range itself."""
        if self.window is None or self.done:
            return
        first, last = self.window
        if self._prof is None:
            if not max(first - 1, 1) <= step <= last:
                return
            self._begin(step)
        if step >= first and self.snapshot and not self._snapshotting:
            torch.cuda.memory._record_memory_history(
                max_entries=MEMORY_HISTORY_ENTRIES, stacks="python", device=self.device
            )
            self._snapshotting = True
        if step >= first and self.blocks and self._block_ranges is None:
            self._block_ranges = BlockRanges(self.blocks)
        if step >= first and not self._first_step:
            self._first_step = step

    def step_done(self, step: int) -> None:
        if self._prof is None:
            return
        self._last_step = max(self._last_step, step)
        if step >= self.window[1]:
            self._finish()
        else:
            if step + 1 == self.window[0]:
                self._drain()
            self._prof.step()

    def _drain(self) -> None:
        """Wait for the GPU before the first recorded step: the loop does not wait for a step's loss, so the warm-up
        step's backward and optimizer would still be running inside the recorded steps, their kernels in the trace
        without their launches (loom.metrics.trace_summary drops such kernels from its figures either way)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Write out what was recorded if training stopped inside the window (SIGTERM, an error)."""
        if self._prof is not None:
            self._finish()

    # ---- internals ----------------------------------------------------------------
    def _begin(self, step: int) -> None:
        from torch.profiler import ProfilerAction

        os.makedirs(self.out_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU] if self.host or not self.cuda else []
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        first, last = self.window

        def schedule(n: int) -> ProfilerAction:
            if n < first:
                return ProfilerAction.WARMUP
            return ProfilerAction.RECORD if n < last else ProfilerAction.RECORD_AND_SAVE

        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._export,
            record_shapes=False,
            with_stack=False,
        )
        # numbered as the trainer's steps, in the phase of this one
        self._prof.step_num = step
        self._prof.current_action = schedule(step)
        if (
            step >= first
        ):  # recording from this step on, with no warm-up step before it (a resume inside the window)
            self._drain()
        self._prof.start()

    def _export(self, prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(os.path.join(self.out_dir, f"trace_rank{self.rank}.json"))
        self._exported = True

    def _finish(self) -> None:
        if self._block_ranges is not None:
            self._block_ranges.close()
            self._block_ranges = None
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the window's kernels are in the trace
        prof, self._prof = self._prof, None
        # how many steps the trace holds (a GPU-only one has no ProfilerStep ranges to count)
        if self._first_step:
            prof.add_metadata_json(STEPS_KEY, str(self._last_step - self._first_step + 1))
        prof.stop()  # from a recording step: the trace is exported (_export); from the warm-up: nothing recorded
        if self._snapshotting:
            torch.cuda.memory._dump_snapshot(
                os.path.join(self.out_dir, f"memory_snapshot_rank{self.rank}.pickle")
            )
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            self._snapshotting = False
        self.done = True
        if self.is_main and self._exported:
            print(self.describe(), flush=True)

    def describe(self) -> str:
        """The one log line: which steps, where the files are, how to open them."""
        steps = (
            f"step {self._first_step}"
            if self._first_step == self._last_step
            else f"steps {self._first_step}-{self._last_step}"
        )
        memory = (
            "memory_snapshot_rank<r>.pickle (pytorch.org/memory_viz)"
            if self.snapshot
            else f"no memory snapshot ({self.no_snapshot})"
            if self.cuda
            else f"no memory snapshot (CUDA only; this run is on {self.device.type})"
        )
        blocks = (
            ""
            if self.blocks is not None
            else " (no block ranges: hooks would run inside torch.compile's graph)"
        )
        return (
            f"profile: {steps} -> {self.out_dir}: trace_rank<r>.json (ui.perfetto.dev or chrome://tracing)"
            f"{blocks}, {memory}"
        )
