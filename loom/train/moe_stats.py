"""The mixture-of-experts balance loss seen from the trainer: its scale each step, and its value for the log."""

from __future__ import annotations

import torch
import torch.distributed as dist

from loom.models.common.init import canonical_name
from loom.models.common.moe import MoE, set_aux_scale, take_balance, update_expert_bias
from loom.models.registry import build_model
from loom.train.hooks import StepHook


class MoEBalance(StepHook):
    """``scale`` before a step: the balance loss is a mean over the step's sequences, reduced across ranks like
    the token loss. ``read`` after it: the step's balance per block and sequence (1 when tokens spread evenly
    over the experts, up to n_experts / top_k when every token of a sequence picks the same experts)."""

    def __init__(self, parts, dims, global_batch: int, n_layers: int, compiled: bool, stage_sum, args=None):
        self.parts, self.dims, self.global_batch, self.n_layers = parts, dims, global_batch, n_layers
        self.compiled, self.stage_sum = compiled, stage_sum
        self.names: list[
            str
        ] = []  # every MoE block of the whole model, by canonical name (the same on every rank)
        if args is not None:
            with torch.device("meta"):
                self.names = [
                    n for n, m in build_model(args.with_(max_seq_len=1)).named_modules() if isinstance(m, MoE)
                ]
            self.n_layers = len(self.names)
        self.args = args

    def before_step(self, loss_scale: float) -> None:
        self.scale(loss_scale)

    def step_out(self, applies: torch.Tensor, shape_inference: bool, device: torch.device) -> dict:
        """Aux-loss-free balancing: the selection biases move after the update; then the step's balance (a
        pipeline's first schedule run in a process also runs each stage on placeholder inputs, shape inference,
        whose routing is noise: that step's balance is not reported)."""
        bias = self.update_bias(applies, device)
        balance = self.read(device)
        return {"moe_bias": bias, "moe_balance": None if shape_inference else balance}

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

    def update_bias(self, applies: torch.Tensor, device) -> dict[str, torch.Tensor]:
        """After the optimizer step: the selection biases move by the step's loads summed over every rank
        (``update_expert_bias``; every rank calls this). Returns ``moe_max_load``: the step's max / mean expert load,
        averaged over the blocks (1 = balanced), and, across ranks, ``moe_bias_spread``: the largest difference of
        one expert's bias between the ranks that hold it (0: agreed everywhere); {} without selection biases."""
        if self.args is None or not self.args.moe_bias:
            return {}
        blocks = {
            canonical_name(n): m for part in self.parts for n, m in part.named_modules() if isinstance(m, MoE)
        }
        spread_across = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        reduce = None
        if spread_across:

            def reduce(t):
                dist.all_reduce(t)
                return t

        load = update_expert_bias(
            blocks, self.names, self.args.moe_experts, self.args.moe_bias_speed, device, applies, reduce
        )
        out = {}
        counted = load.sum(dim=1) > 0
        if counted.any():
            out["moe_max_load"] = (load.amax(dim=1) / load.mean(dim=1).clamp(min=1e-9))[counted].mean()
        if spread_across:
            held = torch.full((2, len(self.names), self.args.moe_experts), float("-inf"), device=device)
            for i, name in enumerate(self.names):
                if name in blocks:
                    bias = blocks[name].router.expert_bias.to(device)
                    held[0, i], held[1, i] = bias, -bias
            dist.all_reduce(held, op=dist.ReduceOp.MAX)
            seen = held[0] > float("-inf")
            out["moe_bias_spread"] = (
                (held[0] + held[1])[seen].max() if seen.any() else torch.zeros((), device=device)
            )
        return out
