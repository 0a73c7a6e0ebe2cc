"""optimizer.step_at_gather: each FSDP2 unit's AdamW update runs at the unit's first all-gather of the next forward,
on FSDP2's copy-in stream, beside the compute of the unit before it, instead of every unit's update between the
backward and the forward (in the 8B profile on 2 H200s, 33 ms of AdamW with nothing else on the GPU: Megatron
overlaps its parameter gather with the optimizer step the same way). The same updates in the same kernels, so the
same weights; their rules: loom.train.step_at_gather_rules."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

_TORCH = (
    collectives._get_param_all_gather_inputs
)  # FSDP2's own, called on its copy-in stream before each gather
_WAITING: dict[int, StepAtGather] = {}  # a unit's key -> the owner of its pending updates


def _gather_inputs(fsdp_params: list) -> list:
    """FSDP2's all-gather inputs of a unit, its pending update run first (on the stream FSDP2 copies them on)."""
    owner = _WAITING.pop(id(fsdp_params[0]), None) if fsdp_params else None
    if owner is not None:
        owner.run_unit(id(fsdp_params[0]))
    return _TORCH(fsdp_params)


class StepAtGather:
    """The updates ``hold`` receives, kept per FSDP2 unit until its next all-gather (or ``flush``). ``after_unit``:
    callbacks given each unit's parameters once its updates have run (float8's scales and casts)."""

    def __init__(self, parts: list[nn.Module]):
        from torch.distributed.fsdp import FSDPModule

        self.unit_of: dict[
            int, int
        ] = {}  # id(parameter) -> its unit's key (id of the unit's first FSDPParam)
        for part in parts:
            for module in part.modules():
                group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
                for fsdp_param in group.fsdp_params if group else []:
                    self.unit_of[id(fsdp_param.sharded_param)] = id(group.fsdp_params[0])
        self.pending: dict[int, list] = {}  # unit key -> [(optimizer, its updates of the unit)]
        self.after_unit: list[Callable[[list], None]] = []
        self.optimizers: list = []
        _WAITING.clear()  # a run before this one in the process (tests) left nothing that may run here
        collectives._get_param_all_gather_inputs = _gather_inputs

    def hold(self, optimizer, updates: list) -> None:
        """Keep ``optimizer``'s ``updates`` (``TritonAdamW.updates``) until each one's unit gathers; the gradients
        they read are theirs now: ``.grad`` is dropped, as zero_grad would."""
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
        by_unit: dict[int, list] = {}
        for u in updates:
            by_unit.setdefault(self.unit_of.get(id(u.param)), []).append(u)
            u.param.grad = None
        optimizer.run(by_unit.pop(None, []))  # a parameter no FSDP2 unit gathers: now, as at the step's end
        for key, ups in by_unit.items():
            self.pending.setdefault(key, []).append((optimizer, ups))
            _WAITING[key] = self

    def run_unit(self, key: int) -> None:
        """The unit's updates, on the current stream (at a gather: FSDP2's copy-in stream, which waited for the
        backward and the clipping factor at the forward's start)."""
        _WAITING.pop(key, None)
        held = self.pending.pop(key, [])
        for optimizer, ups in held:
            optimizer.run(ups)
            _keep_until_read(ups)
        params = [u.param for _, ups in held for u in ups]
        for callback in self.after_unit:
            callback(params)
        if not self.pending:
            for optimizer in self.optimizers:
                optimizer.settle_amax()

    def flush(self) -> None:
        """Every pending update now, on the current stream (before the weights are read other than by a gather:
        a checkpoint, a check of the weights)."""
        for key in list(self.pending):
            self.run_unit(key)


def _keep_until_read(updates: list) -> None:
    """The gradients and factors the updates read on this (side) stream: their memory is not handed out again on
    the streams that made them until this stream has read them."""
    stream = None
    for u in updates:
        for t in (u.tensors[1:2] if u.tensors else ()) + ((u.factor,) if u.factor is not None else ()):
            if t.is_cuda:
                stream = stream or torch.cuda.current_stream(t.device)
                t.record_stream(stream)
