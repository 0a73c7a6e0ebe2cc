"""The sum of the squares of every element of ``tensors``, in fp32, in plain PyTorch: the definition the Triton
kernel is tested against and what runs where Triton does not."""

from __future__ import annotations

import torch


def sum_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim fp32 tensor (0 for no tensors; inf or NaN where an element is)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([t.detach().float().pow(2).sum() for t in tensors]).sum()
