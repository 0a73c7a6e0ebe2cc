"""The mixture-of-experts balance loss seen from the trainer: its scale each step, and its value for the log."""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.models.common.moe import set_aux_scale, take_balance


class MoEBalance:
    """``scale`` before a step: the balance loss is a mean over the step's sequences, reduced across ranks like
    the token loss. ``read`` after it: the step's balance per block and sequence (1 when tokens spread evenly
    over the experts, up to n_experts / top_k when every token of a sequence picks the same experts)."""

    def __init__(self, parts, dims, global_batch: int, n_layers: int, compiled: bool, stage_sum):
        self.parts, self.dims, self.global_batch, self.n_layers = parts, dims, global_batch, n_layers
        self.compiled, self.stage_sum = compiled, stage_sum

    def scale(self, loss_scale: float) -> None:
        for part in self.parts:
            set_aux_scale(part, self.dims.dp_size * self.dims.cp * loss_scale / self.global_batch)

    def read(self, device) -> torch.Tensor | None:
        sums = [b for part in self.parts if (b := take_balance(part)) is not None]
        if self.compiled:  # compiled blocks do not record it (loom.models.common.moe)
            return None
        total = torch.stack(sums).sum() if sums else torch.zeros((), device=device)
        total = self.stage_sum(total)  # each pp rank holds some of the blocks
        if self.dims.tp > 1:  # each tp rank holds a slice of every sequence (sequence parallelism)
            dist.all_reduce(total, group=self.dims["tp"].get_group())
        return self.dims.data_sum(total) / (self.global_batch * self.n_layers)
