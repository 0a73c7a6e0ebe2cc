"""FSDP2's reduce-scatter copy-in in plain PyTorch: each tensor split along its first dim into ``chunks`` equal
parts, chunk r of every tensor (flattened, in order) laid into row r of ``out``, cast to ``out``'s dtype. The
definition the Triton kernel is tested against, and ``torch._chunk_cat``'s layout where every first dim divides."""

from __future__ import annotations

import torch


def chunk_copy_(tensors: list[torch.Tensor], out: torch.Tensor, chunks: int) -> None:
    """``out`` (``chunks`` x the tensors' elements / ``chunks``, contiguous) in place."""
    rows = out.view(chunks, -1)
    col = 0
    for t in tensors:
        n = t.numel() // chunks
        rows[:, col : col + n].copy_(t.reshape(chunks, n))
        col += n
