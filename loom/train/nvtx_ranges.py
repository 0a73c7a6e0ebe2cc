"""metrics.nvtx as a step hook: the per-block NVTX ranges for the whole run, and the banner's line.

The blocks' ranges (``block.<i>`` / ``block.<i>.backward``) are attached when the run is built and removed when it
stops; the step-level ranges are ``nvtx_range`` contexts (loom.metrics.nvtx) where their phases run."""

from __future__ import annotations

from torch import nn

from loom.metrics import nvtx
from loom.metrics.profile import nvtx_block_ranges
from loom.train.hooks import StepHook


class NvtxRanges(StepHook):
    """The block ranges (``blocks`` None under torch.compile: none) and what the banner says of metrics.nvtx."""

    def __init__(self, blocks: dict[str, nn.Module] | None):
        # the engine turned them on (loom.metrics.nvtx.enable) unless this PyTorch has no NVTX: then they do nothing
        self.why_not = nvtx.why_off()
        self.blocks = nvtx_block_ranges(blocks) if blocks and not self.why_not else None

    def describe(self) -> list[str]:
        if self.why_not:
            return [f"metrics.nvtx: no effect ({self.why_not}; a CUDA build of PyTorch emits them)"]
        where = "per block too" if self.blocks else "none per block under training.compile"
        return [f"metrics.nvtx: NVTX ranges on ({where}); docs/metrics.md gives the nsys command"]

    def close(self) -> None:
        if self.blocks:
            self.blocks.close()
            self.blocks = None
