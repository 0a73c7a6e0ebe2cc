"""Token losses. A step's loss is sum(token losses over the global batch) / global valid tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.data.loader import IGNORE


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits: (B, S, V); labels: (B, S) with IGNORE for no loss. Sum over tokens, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE).sum()
