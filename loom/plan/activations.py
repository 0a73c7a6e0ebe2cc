"""Activation memory of one micro-batch, measured by running loom's own model code on fake tensors.

No formula to keep in step with the model: the forward and backward of a 1- and 2-layer Llama of the real
shape run under ``FakeTensorMode`` (shapes and dtypes only: no memory, no compute, a fraction of a second
even for 405B shapes), with the run's precision (bf16 parameters as FSDP2 gathers them, or fp32 weights
under autocast), activation checkpointing and kernels. A dispatch mode records every tensor an op creates
and, through weak references, when it dies; so what autograd, checkpointing and autocast keep alive is
counted exactly as PyTorch keeps it. Four traces (1 or 2 layers x batch 1 or 2) separate the bytes per
layer from those of the embedding / head / loss, and the bytes per sequence from fixed ones (autocast's
bf16 weight copies). Eager kernels are traced; torch.compile's partitioner saves the same or less.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loom.models.common.moe import moe_modules
from loom.models.registry import build_model
from loom.parallel.activation_checkpoint import apply_activation_checkpointing


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes, for sequences of the traced length, on one device without tensor parallelism."""

    layer_per_seq: float  # held from forward to backward, per layer and per sequence
    layer_fixed: float  # held per layer whatever the batch (bf16 weight copies under autocast)
    head_per_seq: float  # embedding, final norm, output head and loss, per sequence
    head_fixed: float
    backward_peak: (
        float  # above what forward holds, at the peak of a 1-layer model's backward, per micro-batch
    )
    # a MoE model's blocks without experts (DeepSeek-V3's first_k_dense, Qwen3-MoE's mlp_only_layers); the layer_*
    # figures are then a block with experts'
    dense_per_seq: float = 0.0
    dense_fixed: float = 0.0

    def held(self, layers: float, micro_batch: int, head: bool = True, dense: float = 0) -> float:
        """Bytes one micro-batch holds between its forward and its backward over ``layers`` layers, ``dense`` of
        them a MoE model's blocks without experts."""
        out = (layers - dense) * (self.layer_fixed + micro_batch * self.layer_per_seq)
        out += dense * (self.dense_fixed + micro_batch * self.dense_per_seq)
        return out + ((self.head_fixed + micro_batch * self.head_per_seq) if head else 0.0)


def _is_fp32_grouped_mm(func, args) -> bool:
    return func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float32


def _grouped_mm_fp32(args, kwargs) -> torch.Tensor:
    """A float32 grouped GEMM's output on fake tensors: PyTorch's meta kernel takes bf16 only. An fp32 model runs its
    experts as a loop of one matmul each (loom.models.common.moe.Experts), which needs real token counts; its
    per-expert outputs add up to the rows and bytes of the grouped GEMM's, so the planner traces the grouped form
    with the output shape the bf16 kernel gives, in float32 (a test compares it with a real fp32 forward)."""
    bf16 = [
        a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    ]
    out = torch.ops.aten._grouped_mm.default(*bf16, **(kwargs or {}))
    return torch.empty(out.shape, dtype=torch.float32, device=out.device)


class _Tracker(TorchDispatchMode):
    """Bytes of live tensor storages created by ops inside the mode, and their peak."""

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor]):
        from torch.multiprocessing.reductions import StorageWeakRef

        super().__init__()
        self.live: dict = {}
        self.params = params
        # views of weights (a linear's transpose) share the weight's storage: never count those
        self.owned = {StorageWeakRef(t.untyped_storage()).cdata for t in params + buffers}
        self.backward = False
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = (
            _grouped_mm_fp32(args, kwargs)
            if _is_fp32_grouped_mm(func, args)
            else func(*args, **(kwargs or {}))
        )
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.owned:
                    self.live.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        if self.backward:  # parameter gradients are counted elsewhere (the planner's static memory)
            self.peak = max(self.peak, self.bytes() - self._grad_bytes())
        return out

    def bytes(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(n for _, n in self.live.values())

    def _grad_bytes(self) -> int:
        from torch.multiprocessing.reductions import StorageWeakRef

        seen = {
            StorageWeakRef(p.grad.untyped_storage()).cdata: p.grad.untyped_storage().nbytes()
            for p in self.params
            if p.grad is not None
        }
        return sum(n for key, n in seen.items() if key in self.live)


@contextlib.contextmanager
def _one_head_dim_sdpa():
    """SDPA traced with the tensors a GPU kernel keeps where the values' head dim differs from the queries' (MLA:
    DeepSeek's 192 and 128). On the CPU SDPA then takes its math path, which keeps the S x S probabilities for the
    backward (23 GiB a block at DeepSeek-V3's 128 heads and seq 4096), and no GPU kernel does: the values are
    traced zero-padded to the query dim, so the CPU's flash kernel runs (its tensors: a little more than cuDNN's,
    which takes the two dims as they are)."""
    sdpa = F.scaled_dot_product_attention

    def one_dim(q, k, v, *args, **kwargs):
        if v.shape[-1] >= q.shape[-1]:
            return sdpa(q, k, v, *args, **kwargs)
        out = sdpa(q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])), *args, **kwargs)
        return out[..., : v.shape[-1]]

    F.scaled_dot_product_attention = one_dim
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


def _trace(
    args, micro_batch: int, seq: int, precision: str, ac: str, ac_every: int, lora=None
) -> tuple[int, int]:
    """(bytes held after forward, peak extra bytes during backward) of one micro-batch; ``lora``: with adapters
    on a frozen base (which saves no input for a weight gradient; each adapter saves its input and its rank-r
    product)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    param_dtype = (
        torch.bfloat16
        if precision == "bf16_params"
        else torch.float16
        if precision == "fp16_params"
        else torch.float32
    )
    autocast = {"autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}.get(precision)
    previous = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(param_dtype)
        try:
            model = build_model(args)  # the family's model (DeepSeek-V3's MTP modules included)
        finally:
            torch.set_default_dtype(previous)
        if lora is not None:
            from loom.models.common.lora import apply_lora, frozen_dtype

            compute = "bfloat16" if torch.bfloat16 in (param_dtype, autocast) else "float32"
            apply_lora(model, lora, frozen_dtype(lora, compute))
        for moe in moe_modules(
            model
        ):  # the loop over experts needs real token counts: trace the grouped GEMM
            moe.experts.grouped = True  # (in fp32 the same tensors as the loop's: ``_Tracker``)
        apply_activation_checkpointing(model.layers, ac, ac_every)
        tokens = torch.zeros(micro_batch, seq, dtype=torch.long)
        tracker = _Tracker(list(model.parameters()), list(model.buffers()))
        cast = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
        with tracker, _one_head_dim_sdpa():
            with cast:
                loss = model(tokens, labels=tokens)
            held = tracker.bytes()
            tracker.backward = True
            tracker.peak = held
            loss.backward()
    return held, tracker.peak - held


def forward_peak(args, batch: int, seq: int, dtype: str) -> int:
    """Peak bytes of tensors one block's forward creates on (batch, seq) tokens without autograd (a prefill), its
    input included: loom's block code run on fake tensors with ``dtype`` weights, as for training (a MoE model's
    first block with experts: the MoE families keep their first blocks dense)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from loom.models.llama.model import Block, model_rope_table
    from loom.numerics import DTYPES

    previous = torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(DTYPES[dtype])
        try:
            index = next((i for i in range(args.n_layers) if args.moe_layer(i)), 0) if args.moe else 0
            block = Block(args, index)
        finally:
            torch.set_default_dtype(previous)
        for moe in moe_modules(block):
            moe.experts.grouped = True  # as in ``_trace``: the grouped GEMM's shapes
        rope = model_rope_table(args, seq)
        tracker = _Tracker(list(block.parameters()), [rope])
        tracker.backward = True  # record the peak at every op (no gradients exist to subtract)
        with torch.no_grad(), tracker, _one_head_dim_sdpa():
            x = torch.zeros(batch, seq, args.dim, dtype=DTYPES[dtype])  # (B, S, E)
            block(x, rope, None)
    return tracker.peak


# bytes a token one compiled block keeps fewer under float8 than in bf16, as (coefficient of the model width, of the
# MLP width): the RMSNorm outputs kept in float8 (tensorwise) or recomputed (rowwise), the SwiGLU gate's output
# recomputed; measured at two shapes (docs/planner.md, bench/results/float8_saved_h200.json)
FLOAT8_COMPILED_DROP = {"tensorwise": (2, 2), "rowwise": (4, 2)}


def float8_compiled_drop(args, recipe: str) -> float:
    """Bytes per token one dense block of a compiled float8 run keeps fewer than the bf16 trace counts (its layers
    checkpointed nowhere; ``FLOAT8_COMPILED_DROP``); 0 for other recipes."""
    width, mlp = FLOAT8_COMPILED_DROP.get(recipe, (0, 0))
    return float(width * args.dim + mlp * args.ffn_dim)


def trace_precision(dtype: str, fsdp: bool) -> str:
    """How the forward runs: FSDP2 gathers parameters in the compute dtype; otherwise fp32 weights run
    under autocast (loom.train.precision)."""
    if dtype == "float32":
        return "fp32"
    short = "bf16" if dtype == "bfloat16" else "fp16"
    return f"{short}_params" if fsdp else f"autocast_{short}"


def profile_activations(
    args, seq: int, micro_batch: int, dtype: str, fsdp: bool, ac: str, ac_every: int = 2, lora=None
) -> ActivationProfile:
    """Activation bytes of ``args`` (a resolved LlamaArgs: vocabulary and kernels set) at ``seq`` tokens per
    sequence; ``backward_peak`` is traced at ``micro_batch`` sequences. ``lora``: a LoraConfig with a rank (the
    model traced with its adapters on a frozen base, as ``apply_lora`` makes it)."""
    precision = trace_precision(dtype, fsdp)
    if ac == "every_k":  # blocks 0, k, 2k, ... are checkpointed: a 1-layer model is the checkpointed kind
        full = profile_activations(args, seq, micro_batch, dtype, fsdp, "full", lora=lora)
        none = profile_activations(args, seq, micro_batch, dtype, fsdp, "none", lora=lora)
        share = -(-args.n_layers // ac_every) / args.n_layers  # fraction of checkpointed blocks

        def mix(a: float, b: float) -> float:
            return share * a + (1 - share) * b

        return ActivationProfile(
            mix(full.layer_per_seq, none.layer_per_seq),
            mix(full.layer_fixed, none.layer_fixed),
            none.head_per_seq,
            none.head_fixed,
            max(full.backward_peak, none.backward_peak),
            mix(full.dense_per_seq, none.dense_per_seq),
            mix(full.dense_fixed, none.dense_fixed),
        )
    # models of n and n + 1 blocks differ by block n: one with experts where the model has any (a MoE family keeps
    # some blocks dense: DeepSeek-V3's first ones, Qwen3-MoE's mlp_only_layers), whose dense blocks are then traced
    # apart (every block dense); the embedding, head, loss and MTP modules are what n blocks leave over
    n = next((i for i in range(1, args.n_layers + 1) if args.moe_layer(i)), 1) if args.moe else 1
    kinds = [args.moe_layer(i) for i in range(n)] if args.moe else [True] * n
    held, dense = {}, {}
    for batch in (1, 2):
        for layers in (n, n + 1):
            held[layers, batch] = _trace(
                args.with_(n_layers=layers), batch, seq, precision, ac, ac_every, lora
            )[0]
        if not all(kinds):
            plain = args.with_(moe_experts=0)
            one, two = (
                _trace(plain.with_(n_layers=k), batch, seq, precision, ac, ac_every, lora)[0] for k in (1, 2)
            )
            dense[batch] = two - one
    layer = {b: held[n + 1, b] - held[n, b] for b in (1, 2)}
    dense = dense or layer
    head = {b: held[n, b] - sum(layer[b] if moe else dense[b] for moe in kinds) for b in (1, 2)}
    _, backward_peak = _trace(args.with_(n_layers=n + 1), micro_batch, seq, precision, ac, ac_every, lora)
    return ActivationProfile(
        layer_per_seq=layer[2] - layer[1],
        layer_fixed=2 * layer[1] - layer[2],
        head_per_seq=head[2] - head[1],
        head_fixed=2 * head[1] - head[2],
        backward_peak=backward_peak,
        dense_per_seq=dense[2] - dense[1],
        dense_fixed=2 * dense[1] - dense[2],
    )
