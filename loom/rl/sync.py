"""The policy's weights for the rollout engine. In one process and under DDP the engine runs on the trainer's own
module (every rank's replica is whole and current: nothing to copy). Under FSDP2 each rank holds a shard of every
parameter, so each rank keeps a plain, unsharded copy of the policy (built once, in the run's compute dtype) and
``sync`` refreshes it in place from the shards, one ``full_tensor()`` all-gather per parameter, with no disk round
trip. The first sync copies everything; later ones only the parameters that train (under LoRA the adapters: the
frozen base in the copy cannot have changed). Each sync's seconds and bytes are recorded for the metrics.

Under tensor parallelism the engine runs tensor-parallel over the trainer's tp group (``tp_engine_model``): a second
module tree, split by the engine's plan (``loom.infer.tp``: the training plan's weight splits, replicated
activations), whose parameters are the trainer's own TP shards. Nothing is copied or synced; only where FSDP2 also
shards the policy (dp_shard x tp, or TP's replicas, which FSDP2 holds) does ``sync`` fill this rank's TP shards,
gathered from the FSDP2 shards."""

from __future__ import annotations

import time

import torch
from torch import nn

from loom.models.common.init import _shared_parameters, canonical_name
from loom.models.common.lora import apply_lora, dequantized, is_nf4
from loom.parallel.shards import local_tensor


def is_sharded(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor (FSDP2's or TP's shards)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


class EngineWeights:
    """``model``: what the engine generates with; ``sync()`` before each generation makes it the policy's current
    weights (a no-op when it is the trainer's module or shares its tensors). ``fills``: the engine's tensors that
    ``sync`` writes, by the policy's parameter name (all of a copy's; under TP those it cannot share); ``shared``:
    the engine's tensors that are the policy's own storage. ``group``: the tensor-parallel group the engine runs
    over (None: each rank generates alone). ``seconds`` / ``bytes``: the last sync's."""

    def __init__(
        self,
        policy: nn.Module,
        model: nn.Module,
        fills: dict | None = None,
        shared: dict | None = None,
        group=None,
    ):
        self.policy, self.model, self.group = policy, model, group
        self.copied = model is not policy
        self.fills = dict(model.named_parameters()) if fills is None and self.copied else (fills or {})
        self.shared = shared or {}
        self.synced_once = False
        self.seconds, self.bytes = 0.0, 0

    @classmethod
    def build(cls, engine, copy: bool = False, device=None) -> EngineWeights:
        """The training engine's own module where it is whole; under TP the inference engine's tensor-parallel
        module on the training shards (``tp_engine_model``); a plain copy of the policy (with its LoRA adapters, if
        any) on the training device under FSDP2, or with ``copy`` (a snapshot that ``sync`` refreshes: asynchronous
        GRPO's sampler, which must not see the weights change under it; not under TP; on ``device``, default the
        training device). The inference engine's model holds no value head or critic: it only generates."""
        policy = engine.parts[0]
        if not is_sharded(policy) and not copy:
            return cls(policy, policy)
        dtype = engine.dtype if engine.dtype in (torch.bfloat16, torch.float16) else torch.float32
        if engine.dims.tp_enabled:
            assert not copy, "a snapshot of a tensor-parallel policy"
            mesh = engine.dims["tp"]
            model, fills, shared = tp_engine_model(
                policy, engine.model_args, engine.cfg.lora, mesh, dtype, engine.device
            )
            return cls(policy, model, fills, shared, group=mesh.get_group())
        from loom.models.registry import build_model

        with torch.device("meta"):
            copy = build_model(engine.model_args)
        apply_lora(copy, engine.cfg.lora)
        tied = _shared_parameters(copy)
        device = engine.device if device is None else device
        copy = copy.to(dtype).to_empty(device=device)
        for (mod0, name0), *others in tied:  # to_empty gives each place of a tied weight its own: re-tie
            for mod, name in others:
                setattr(mod, name, getattr(mod0, name0))
        copy.init_buffers(device)  # the RoPE table in fp32
        copy.requires_grad_(False)
        return cls(policy, copy.eval())

    @torch.no_grad()
    def sync(self) -> None:
        """The policy's current weights into the engine's tensors that do not share its storage (every rank calls
        it: the gathers are collectives)."""
        if not self.copied:
            self.seconds, self.bytes = 0.0, 0
            return
        start = time.perf_counter()
        moved, filled = 0, set()
        for name, p in self.policy.named_parameters():  # the same order on every rank
            name = canonical_name(name)
            if name in self.shared:  # the optimizer updates it in place: still the same storage
                assert local_tensor(self.shared[name]).data_ptr() == local_tensor(p).data_ptr(), name
            dst = self.fills.get(name)
            if dst is None or (
                self.synced_once and not p.requires_grad
            ):  # value head / critic; unchanged frozen
                continue
            src = dequantized(p) if is_nf4(p) else p  # QLoRA's base: the copy holds its bf16 values
            if hasattr(src, "full_tensor"):
                src = src.to(dst.dtype).full_tensor()  # cast first: the gather moves the copy's dtype
            if hasattr(dst, "to_local"):  # the engine's TP shard of it: this rank's part of the whole
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
                dst = dst.to_local()
            dst.copy_(src)
            moved += dst.numel() * dst.element_size()
            filled.add(name)
        buffers = dict(self.model.named_buffers())
        for name, b in self.policy.named_buffers():  # replicated, not sharded (an MoE router's bias moves)
            dst = buffers.get(canonical_name(name))
            if dst is not None and dst.shape == b.shape:
                dst.copy_(b)
        if self.model.tok_embeddings.weight.device.type == "cuda":
            torch.cuda.synchronize()
        assert self.synced_once or filled == self.fills.keys(), sorted(
            self.fills.keys() - filled
        )  # each, once
        self.synced_once = True
        self.seconds, self.bytes = time.perf_counter() - start, moved


@torch.no_grad()
def tp_engine_model(policy: nn.Module, args, lora, tp_mesh, dtype: torch.dtype, device) -> tuple:
    """The engine's tensor-parallel model of a TP policy: a Llama built on meta with the policy's LoRA adapters,
    split over ``tp_mesh`` by the engine's plan (``loom.infer.tp``; adapters sharded like their base), whose
    parameters are the policy's wherever the policy holds exactly that tensor: its DTensor on the tp mesh with the
    same placements (the column / row splits: the same Parameter), or a replicated DTensor where the engine wants a
    plain tensor (norms; a mixture of experts' router and experts: a view of its local tensor). The others (FSDP2's
    shards, experts split over tp) get storage of their own on ``device`` in ``dtype``, which ``sync`` fills.
    Returns (model, fills, shared): the tensors ``sync`` fills and those it shares, by the policy's names."""
    from torch.distributed.tensor import DTensor

    from loom.infer.tp import apply_inference_tp
    from loom.models.registry import build_model

    with torch.device("meta"):
        model = build_model(args)
    apply_lora(model, lora)
    apply_inference_tp(model, tp_mesh)
    theirs = {canonical_name(n): p for n, p in policy.named_parameters()}
    done: dict[int, nn.Parameter] = {}  # a tied weight: one replacement for every place
    fills, shared = {}, {}
    for prefix, module in model.named_modules():
        for leaf, t in list(module._parameters.items()):
            if t is None:
                continue
            if id(t) not in done:
                name = f"{prefix}.{leaf}" if prefix else leaf
                p = theirs[name]
                on_tp = isinstance(p, DTensor) and p.device_mesh == tp_mesh
                if on_tp and isinstance(t, DTensor) and tuple(p.placements) == tuple(t.placements):
                    done[id(t)] = shared[name] = p  # the trainer's own Parameter
                elif on_tp and not isinstance(t, DTensor) and all(x.is_replicate() for x in p.placements):
                    done[id(t)] = shared[name] = nn.Parameter(p.to_local(), requires_grad=False)  # a view
                else:
                    done[id(t)] = fills[name] = nn.Parameter(
                        _empty_like(t, dtype, device), requires_grad=False
                    )
            module._parameters[leaf] = done[id(t)]
    model.init_buffers(device)  # the RoPE table in fp32
    return model.eval(), fills, shared


def _empty_like(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Storage on ``device`` for a meta tensor ``t`` (a DTensor: this rank's shard of it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = torch.empty(t.to_local().shape, dtype=dtype, device=device)
        return DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return torch.empty(t.shape, dtype=dtype, device=device)


@torch.no_grad()
def whole_model(model: nn.Module) -> nn.Module:
    """A plain, unsharded fp32 copy of a sharded policy (FSDP2) on its device, its LoRA adapters merged (W + scaling
    x B A), for work that runs the engine on the model outside the rollouts (an eval hook); ``model`` itself when
    it is whole. Every rank calls it (the gathers are collectives)."""
    from loom.models.common.lora import LoRALinear
    from loom.models.registry import build_model

    if not is_sharded(model):
        return model
    full = lambda t: (
        (dequantized(t) if is_nf4(t) else t).float().full_tensor()
        if hasattr(t, "full_tensor")
        else (dequantized(t) if is_nf4(t) else t).float()
    )
    device = next(model.parameters()).device
    with torch.device("meta"):
        copy = build_model(model.args)
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
