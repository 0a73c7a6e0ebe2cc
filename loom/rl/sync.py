"""The policy's weights for the rollout engine. In one process and under DDP the engine runs on the trainer's own
module (every rank's replica is whole and current: nothing to copy). Under FSDP2 each rank holds a shard of every
parameter, so each rank keeps a plain, unsharded copy of the policy (built once, in the run's compute dtype) and
``sync`` refreshes it in place from the shards, one ``full_tensor()`` all-gather per parameter, with no disk round
trip. The first sync copies everything; later ones only the parameters that train (under LoRA the adapters: the
frozen base in the copy cannot have changed). Each sync's seconds and bytes are recorded for the metrics."""

from __future__ import annotations

import time

import torch
from torch import nn

from loom.models.common.init import _shared_parameters, canonical_name
from loom.models.common.lora import apply_lora, dequantized, is_nf4


def is_sharded(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor (FSDP2's shards)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


class EngineWeights:
    """``model``: what the engine generates with; ``sync()`` before each generation makes it the policy's current
    weights (a no-op when it is the trainer's module). ``seconds`` / ``bytes``: the last sync's."""

    def __init__(self, policy: nn.Module, model: nn.Module):
        self.policy, self.model = policy, model
        self.copied = model is not policy
        self.synced_once = False
        self.seconds, self.bytes = 0.0, 0

    @classmethod
    def build(cls, trainer) -> "EngineWeights":
        """The trainer's own module where it is whole; a plain copy of the policy (with its LoRA adapters, if any)
        on the trainer's device under FSDP2. The copy holds no value head or critic: the engine only generates."""
        policy = trainer.parts[0]
        if not is_sharded(policy):
            return cls(policy, policy)
        from loom.models.llama import Llama

        dtype = trainer.dtype if trainer.dtype in (torch.bfloat16, torch.float16) else torch.float32
        with torch.device("meta"):
            copy = Llama(trainer.model_args)
        apply_lora(copy, trainer.cfg.lora)
        shared = _shared_parameters(copy)
        copy = copy.to(dtype).to_empty(device=trainer.device)
        for (mod0, name0), *others in shared:  # to_empty gives each place of a tied weight its own: re-tie
            for mod, name in others:
                setattr(mod, name, getattr(mod0, name0))
        copy.init_buffers(trainer.device)  # the RoPE table in fp32
        copy.requires_grad_(False)
        return cls(policy, copy.eval())

    @torch.no_grad()
    def sync(self) -> None:
        """The policy's current weights into the copy (every rank calls it: the gathers are collectives)."""
        if not self.copied:
            self.seconds, self.bytes = 0.0, 0
            return
        start = time.perf_counter()
        mine = dict(self.model.named_parameters())
        moved, filled = 0, set()
        for name, p in self.policy.named_parameters():  # the same order on every rank
            dst = mine.get(canonical_name(name))
            if dst is None or (self.synced_once and not p.requires_grad):  # value head / critic; unchanged frozen
                continue
            src = dequantized(p) if is_nf4(p) else p  # QLoRA's base: the copy holds its bf16 values
            if hasattr(src, "full_tensor"):
                src = src.to(dst.dtype).full_tensor()  # cast first: the gather moves the copy's dtype
            dst.copy_(src)
            moved += dst.numel() * dst.element_size()
            filled.add(canonical_name(name))
        buffers = dict(self.model.named_buffers())
        for name, b in self.policy.named_buffers():  # replicated, not sharded (an MoE router's bias moves)
            dst = buffers.get(canonical_name(name))
            if dst is not None and dst.shape == b.shape:
                dst.copy_(b)
        if self.model.tok_embeddings.weight.device.type == "cuda":
            torch.cuda.synchronize()
        assert self.synced_once or filled == mine.keys(), sorted(mine.keys() - filled)  # every weight, once
        self.synced_once = True
        self.seconds, self.bytes = time.perf_counter() - start, moved


@torch.no_grad()
def whole_model(model: nn.Module) -> nn.Module:
    """A plain, unsharded fp32 copy of a sharded policy (FSDP2) on its device, its LoRA adapters merged (W + scaling
    x B A), for work that runs the engine on the model outside the rollouts (an eval hook); ``model`` itself when
    it is whole. Every rank calls it (the gathers are collectives)."""
    from loom.models.common.lora import LoRALinear
    from loom.models.llama import Llama

    if not is_sharded(model):
        return model
    full = lambda t: (dequantized(t) if is_nf4(t) else t).float().full_tensor() if hasattr(t, "full_tensor") \
        else (dequantized(t) if is_nf4(t) else t).float()
    device = next(model.parameters()).device
    with torch.device("meta"):
        copy = Llama(model.args)
    shared = _shared_parameters(copy)
    copy = copy.to_empty(device=device)
    for (mod0, name0), *others in shared:
        for mod, name in others:
            setattr(mod, name, getattr(mod0, name0))
    copy.init_buffers(device)
    adapted = {canonical_name(n): m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    for name, dst in copy.named_parameters():
        value = full(params[name])
        owner, _, leaf = name.rpartition(".")
        if owner in adapted and leaf == "weight":  # (out, r) @ (r, in)
            m = adapted[owner]
            value = value + full(m.lora_B.weight) @ full(m.lora_A.weight) * m.scaling
        dst.copy_(value)
    return copy.requires_grad_(False).eval()
