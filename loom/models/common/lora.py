"""LoRA and QLoRA: low-rank adapters on a plain model's linears, applied after the model is built (like
parallelism), so the model code stays plain.

``apply_lora`` swaps each target ``nn.Linear`` for a ``LoRALinear`` that keeps the base weight under its own name
(``layers.0.attention.wq.weight``: Hugging Face import, checkpoints and init by name are unchanged) and adds two
trainable factors ``lora_A`` (r, in) and ``lora_B`` (out, r); everything else is frozen. ``init_adapters`` draws
them as PEFT does (A kaiming-uniform, B zeros), each from a seed of its name, so the start does not depend on the
layout. loom.parallel.shards.quantize_base stores the frozen base weights as torchao NF4 (QLoRA) once they hold
their values; ``merge_lora`` folds the adapters back into plain linears for export.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from loom.config.errors import ConfigError
from loom.config.sections import LoraConfig
from loom.kernels.lora import lora_linear
from loom.models.common.init import canonical_name, copy_full, param_seed

# lora.targets names -> the module path inside a block (Hugging Face names: q_proj, ..., down_proj); multi-head
# latent attention's (loom.models.common.mla; DeepSeek's q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, and q_proj
# where the query is not compressed, o_proj) are not in "all", which names grouped-query attention's and the SwiGLU's
TARGETS = {
    "q": "attention.wq",
    "k": "attention.wk",
    "v": "attention.wv",
    "o": "attention.wo",
    "gate": "feed_forward.w1",
    "up": "feed_forward.w3",
    "down": "feed_forward.w2",
    "q_a": "attention.wq_a",
    "q_b": "attention.wq_b",
    "kv_a": "attention.wkv_a",
    "kv_b": "attention.wkv_b",
    "shared_gate": "feed_forward.shared_experts.w1",
    "shared_up": "feed_forward.shared_experts.w3",
    "shared_down": "feed_forward.shared_experts.w2",
}
ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # lora.targets = all
MLA_TARGETS = ("q", "q_a", "q_b", "kv_a", "kv_b", "o")  # those of multi-head latent attention
# a mixture-of-experts block's shared experts (DeepSeekMoE's; Hugging Face's mlp.shared_experts.gate_proj, ...): in
# the blocks that have them, none in dense blocks. Routed experts take no adapters (their weights are stacked)
SHARED_TARGETS = ("shared_gate", "shared_up", "shared_down")
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # QLoRA's: 64 weights per scale, 256 scales per double-quantized block


def parse_targets(text: str) -> list[str]:
    """``lora.targets`` ("q,v", "all") -> target names in TARGETS' order; a ConfigError names an unknown one."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(ALL_TARGETS)
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise ConfigError("lora.targets", text, f"a comma list of {', '.join(TARGETS)} (or all)")
    return [t for t in TARGETS if t in names]


def lora_scaling(alpha: float, rank: int, rslora: bool) -> float:
    """The update's factor: alpha / r, or alpha / sqrt(r) for rank-stabilized LoRA (PEFT's ``use_rslora``)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


class LoRALinear(nn.Linear):
    """y = x W^T (+ b) + B(scaling * A(dropout(x))): a frozen base linear (its own ``weight``/``bias``, names
    unchanged) plus the trainable ``lora_A`` (in -> r) and ``lora_B`` (r -> out). The factors are ``nn.Linear``
    children so tensor parallelism shards them like their base (loom.parallel.tensor_parallel). ``weight`` may be
    an NF4 tensor (QLoRA): ``F.linear`` then dequantizes it to the input's dtype (torchao's ``linear_nf4``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        scaling: float,
        dropout: float = 0.0,
        bias: bool = False,
        device=None,
        dtype=None,
        fused: bool = True,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.scaling = rank, scaling
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.dropout = dropout
        self.disabled = False  # adapters_disabled: the base linear alone
        self.host_weight = False  # QLoRA: the base weight materialized in host memory until quantize_base
        self.fused = fused  # loom::lora_linear where the base is plain (lora.fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.disabled:
            return F.linear(x, self.weight, self.bias)
        # dropout only where gradients are taken: loom never switches modules to eval mode, and validation runs
        # under no_grad
        if self.fusable(x):
            return lora_linear(x, [self.weight], [self.lora_A.weight], [self.lora_B.weight], self.scaling)[0]
        a_in = (
            F.dropout(x, self.dropout, training=self.training and torch.is_grad_enabled())
            if self.dropout
            else x
        )
        # the scaling multiplies the (.., r) tensor, not the (.., out) one PEFT scales: the same product, one
        # activation-sized pass fewer in forward and in backward
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(a_in) * self.scaling)

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether ``loom::lora_linear`` computes this linear: fused, adapters on, no dropout or bias, a frozen
        plain base (not a DTensor or NF4)."""
        return (
            self.fused
            and not self.disabled
            and not self.dropout
            and self.bias is None
            and not self.weight.requires_grad
            and all(type(t) in _PLAIN for t in (x, self.weight, self.lora_A.weight, self.lora_B.weight))
        )

    @staticmethod
    def project_together(x: torch.Tensor, linears) -> list[torch.Tensor] | None:
        """Linears of one input (q, k, v; gate, up) in one ``loom::lora_linear`` call: one GEMM for their adapters'
        down-projections and one summed input gradient (``loom.models.common.layers.project``); None where one of
        them is not fusable or the scalings differ."""
        if not all(
            m.fusable(x) and m.scaling == linears[0].scaling and m.rank == linears[0].rank for m in linears
        ):
            return None
        return lora_linear(
            x,
            [m.weight for m in linears],
            [m.lora_A.weight for m in linears],
            [m.lora_B.weight for m in linears],
            linears[0].scaling,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}, dropout={self.dropout:g}"

    # an NF4 base is saved dequantized (exactly the values training used: an export merges from the checkpoint
    # alone) and is not loaded back: it is rebuilt from its source (model.init_from / the seed) and quantized the
    # same way at start, which re-quantizing the dequantized copy would not match bit for bit
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if is_nf4(self.weight):
            destination[prefix + "weight"] = dequantized(self.weight)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        if not is_nf4(self.weight):
            return super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
            )
        saved = state_dict.pop(prefix + "weight", None)
        try:
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
            )
        finally:
            if saved is not None:
                state_dict[prefix + "weight"] = saved
        if prefix + "weight" in missing_keys:
            missing_keys.remove(prefix + "weight")


_PLAIN = (
    torch.Tensor,
    nn.Parameter,
)  # not DTensors (tensor parallel) or NF4 (QLoRA): those take F.linear's path


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(canonical name, module) of every adapted linear of ``model``."""
    return [(canonical_name(n), m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA factor (trainable) rather than a frozen base weight."""
    return ".lora_A." in name or ".lora_B." in name


def apply_lora(model: nn.Module, cfg: LoraConfig, frozen_dtype: torch.dtype | None = None) -> int:
    """Put LoRA adapters on ``cfg.targets`` of every block of ``model`` (a Llama on any device, meta included) and
    freeze every other parameter, stored in ``frozen_dtype`` when given (``frozen_dtype()``); returns how many
    linears were adapted (0: ``lora.rank`` 0, nothing changes).
    Call before parallelizing: tensor parallelism and FSDP then treat the adapters with their base."""
    if not cfg.rank:
        return 0
    scaling = lora_scaling(cfg.alpha, cfg.rank, cfg.rslora)
    fused = cfg.fused != "false"
    n = 0
    for block in model.layers.values():
        for target in parse_targets(cfg.targets):
            parent_path, _, leaf = TARGETS[target].rpartition(".")
            parent = _submodule(block, parent_path)
            if parent is None and target in SHARED_TARGETS:
                continue  # a dense block, or one without shared experts
            base = getattr(parent, leaf, None)
            if type(base) is not nn.Linear:
                raise ConfigError(
                    "lora.targets",
                    cfg.targets,
                    f"{target} ({TARGETS[target]}) is not a dense linear in every block of this model "
                    "(a mixture-of-experts feed-forward, or the other attention kind's): adapt the "
                    "attention's linears",
                )
            w = base.weight
            adapted = LoRALinear(
                base.in_features,
                base.out_features,
                cfg.rank,
                scaling,
                cfg.dropout,
                bias=base.bias is not None,
                device=w.device,
                dtype=w.dtype,
                fused=fused,
            )
            adapted.weight = w  # the base's own parameters (their values, if it has any)
            if cfg.base_dtype == "nf4":  # quantized from bfloat16 anyway: half the memory until then
                adapted.weight = nn.Parameter(w.detach().to(torch.bfloat16))
                adapted.host_weight = (
                    True  # materialized in host memory, quantized onto the device (quantize_base)
                )
            if base.bias is not None:
                adapted.bias = base.bias
            setattr(parent, leaf, adapted)
            n += 1
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    if frozen_dtype is not None:
        for p in model.parameters():
            if not p.requires_grad and p.dtype.is_floating_point:
                p.data = p.data.to(frozen_dtype)  # .data: tied weights stay one Parameter
    return n


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    """``module.get_submodule(path)``, or None where a module on the path is absent."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def frozen_dtype(cfg: LoraConfig, compute_dtype: str) -> torch.dtype | None:
    """The storage dtype of the frozen weights (``apply_lora``): bf16 for lora.base_dtype bfloat16, and for nf4 (its
    unquantized frozen weights: embeddings, norms, head) when the run computes in bf16 anyway; None: as built."""
    if cfg.rank and (
        cfg.base_dtype == "bfloat16" or (cfg.base_dtype == "nf4" and compute_dtype == "bfloat16")
    ):
        return torch.bfloat16
    return None


# ---- initial values ------------------------------------------------------------------------------


@torch.no_grad()
def init_adapters(
    model: nn.Module, seed: int, draw_device: torch.device | None = None, keep=copy_full
) -> None:
    """PEFT's initial adapters: A kaiming-uniform (a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B zeros, so the
    adapted model starts equal to its base. Each A is drawn on its full shape from a seed of the run seed and its
    name (loom.models.common.init), then this rank keeps its shard: the start does not depend on the layout."""
    for name, p in model.named_parameters():
        cname = canonical_name(name)
        if not is_adapter(cname):
            continue
        device = draw_device or p.device  # as loom.models.common.init: drawn where compute runs
        full = torch.zeros(p.shape, device=device, dtype=torch.float32)
        if ".lora_A." in cname:
            gen = torch.Generator(device=device).manual_seed(param_seed(seed, cname))
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
        keep(p, full.to(p.dtype))


@contextlib.contextmanager
def adapters_hidden(parts: list[nn.Module]):
    """The parts without their adapters for a while, e.g. to load base weights by the base model's names (a
    Hugging Face folder or an imported checkpoint has no adapters)."""
    hidden = []
    for part in parts:
        for _, m in lora_modules(part):
            hidden.append((m, m._modules.pop("lora_A"), m._modules.pop("lora_B")))
    try:
        yield
    finally:
        for m, a, b in hidden:
            m._modules["lora_A"], m._modules["lora_B"] = a, b


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """``model`` computes as its base for a while: every adapted linear skips its adapters (DPO's reference with
    dpo.reference adapters_off). The adapters stay in place, so FSDP and DDP see the same parameters."""
    adapted = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in adapted:
        m.disabled = True
    try:
        yield
    finally:
        for m in adapted:
            m.disabled = False


# ---- QLoRA: the frozen base in NF4 ---------------------------------------------------------------


def is_nf4(t: torch.Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local shard) is torchao's NF4Tensor; by name, so torchao need not be there."""
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return type(local).__name__ == "NF4Tensor"


def dequantized(w: torch.Tensor) -> torch.Tensor:
    """An NF4 weight (or a DTensor of NF4 shards) as float32 values; each shard dequantizes on its own."""
    from torch.distributed.tensor import DTensor

    if isinstance(w, DTensor):
        local = w.to_local().get_original_weight().float()
        return DTensor.from_local(
            local, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride()
        )
    return w.get_original_weight().float()


def check_nf4_shape(name: str, w: torch.Tensor, shards: int = 1) -> None:
    """NF4 needs whole scaler blocks per tensor (numel a multiple of 64 x 256) and, sharded over ``shards`` ranks by
    rows, in each shard (numel a multiple of 64 x 256 x n, rows a multiple of n)."""
    unit = NF4_BLOCK * NF4_SCALER_BLOCK * shards
    if w.numel() % unit or w.shape[0] % shards:
        where = f" on each of {shards} shards" if shards > 1 else ""
        raise ConfigError(
            "lora.base_dtype",
            "nf4",
            f"{name} {list(w.shape)} does not split into NF4 blocks of "
            f"{NF4_BLOCK} x {NF4_SCALER_BLOCK} weights{where}: allowed float32 for this model (or fewer "
            "shards)",
        )


# ---- export ----------------------------------------------------------------------------------------


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base, W + scaling * B A (an NF4 base dequantized first), leaving plain
    ``nn.Linear`` modules with the base model's names; returns how many. For an unsharded model (export)."""
    adapted = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, m in adapted:
        parent_name, _, leaf = name.rpartition(".")
        w = dequantized(m.weight) if is_nf4(m.weight) else m.weight.float()
        delta = m.lora_B.weight.float() @ m.lora_A.weight.float() * m.scaling  # (out, r) @ (r, in)
        dtype = m.lora_A.weight.dtype
        plain = nn.Linear(
            m.in_features, m.out_features, bias=m.bias is not None, device=w.device, dtype=dtype
        )
        plain.weight.copy_(w + delta)
        if m.bias is not None:
            plain.bias.copy_(m.bias)
        setattr(model.get_submodule(parent_name), leaf, plain)
    return len(adapted)
