"""Numbers every layer shares: the training dtypes by name, the label that takes no loss, and the summed
token loss (a step's loss is sum(token losses over the global batch) / global valid tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IGNORE = -100  # a label that takes no loss (the kernels and losses skip it; packed pretraining text has none)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits: (B, S, V); labels: (B, S) with IGNORE for no loss. Sum over tokens, in fp32."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE).sum()
