"""Per-block torch.compile: one compiled graph reused by every block of the same shape."""

from __future__ import annotations

from torch import nn


def apply_compile(layers: nn.ModuleDict) -> None:
    for block in layers.values():
        block.compile(fullgraph=True)  # in place: parameter names do not change
