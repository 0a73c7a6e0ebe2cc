"""Activation checkpointing of transformer blocks: full, every k-th block, or op-level selective (``op``: every
other matmul kept; ``matmuls``: every matmul kept)."""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

import loom.kernels.attention.fa4
import loom.kernels.attention.op
import loom.kernels.lora.op
import loom.parallel.context_parallel  # noqa: F401  (registers torch.ops.loom.ring_attn)
from loom.config.sections import SELECTIVE_AC


class _PolicyNoteFilter(logging.Filter):
    """Drops PyTorch's note, once per process, that a compiled checkpoint has a context function (every op-level
    policy's): a caution against in-place ops in the region, which loom's compiled blocks are tested against eager
    for (tests/gpu/test_gpu_train.py, tests/distributed/test_model_parallel.py). It was half of a run's start-up
    output, four lines a rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint under torch.compile" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_PolicyNoteFilter())

# op-level selective AC: keep the outputs of these (expensive to recompute), recompute the rest.
# Like torchtitan, every second matmul is saved so memory stays between none and full; every attention
# backend's forward is saved (its output and log-sum-exp are what its backward reads; ring attention's too, so its
# sends are not repeated in backward), and, as torchtitan, expert parallelism's token all-to-alls (the
# recomputation replays them instead of exchanging the tokens again). Exception: FlexAttention
# in an eager model on CUDA runs as its own compiled function, which the policy does not see: it is recomputed.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.loom.flash_attn.default,
    torch.ops.loom.fa4.default,
    torch.ops.loom.ring_attn.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,
    torch.ops._c10d_functional.all_to_all_single.default,
}


# ``matmuls`` keeps these too: every matmul's output, so a block's recomputation reruns elementwise work only (norms,
# RoPE, SwiGLU, residual sums). On one H200, 3B at seq 8192 compiled under autocast: 529 MiB a block against 945
# without checkpointing and 337 under ``op``, at no-checkpointing's step time (docs/parallelism.md)
# (a linear with a bias runs as addmm; fused LoRA's frozen bases and adapters as one loom::lora_linear; float8's
# matmuls as _scaled_mm where the policy sees them below torchao's tensor subclass)
_MATMUL_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops.loom.lora_linear.default,
}


def _op_policy(every_matmul: bool = False):
    """The contexts of op-level checkpointing: ``every_matmul`` (``matmuls``) keeps every matmul's output, else
    (``op``) every other ``aten.mm`` as torchtitan, the grouped GEMMs rerun. Two factories, not one closure:
    Dynamo does not guard on a checkpoint's context function beyond its code, so blocks of one code compiled under
    one mode would replay that mode's graph under the other in the same process (a test compiles both)."""
    return _every_matmul_contexts if every_matmul else _every_other_matmul_contexts


def _every_other_matmul_contexts():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.mm.default:
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            return CheckpointPolicy.MUST_SAVE if counts[mode] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return tuple(_ignoring_profiler(mode) for mode in create_selective_checkpoint_contexts(policy))


def _every_matmul_contexts():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        keep = op in _MATMUL_OPS or op in _SAVE_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return tuple(_ignoring_profiler(mode) for mode in create_selective_checkpoint_contexts(policy))


_IGNORING: dict[type, type] = {}


def _ignoring_profiler(mode):
    """``mode`` (one of the two dispatch modes selective checkpointing runs the forward and the recomputation
    under) with profiler annotations passed through, neither cached nor counted. SAC replays ops by their
    per-op call index, and FSDP2 hooks inside a checkpointed block (the experts' own fully_shard under expert
    parallelism) annotate the recomputation with more ``record_function`` calls than the forward, which makes
    PyTorch (2.11-2.13) raise a replay mismatch (torchtitan#3427; pytorch#196862 ignores them the same way)."""
    base = type(mode)
    if base not in _IGNORING:

        def dispatch(self, func, types, args=(), kwargs=None):
            if getattr(func, "namespace", None) == "profiler":
                return func(*args, **(kwargs or {}))
            return base.__torch_dispatch__(self, func, types, args, kwargs)

        _IGNORING[base] = type(base.__name__ + "IgnoringProfiler", (base,), {"__torch_dispatch__": dispatch})
    _share_higher_order_rules(base, _IGNORING[base])
    mode.__class__ = _IGNORING[base]
    return mode


_SHARED_AT: dict[type, int] = {}  # subclass -> how many higher-order ops existed when its rules were copied


def _share_higher_order_rules(base: type, sub: type) -> None:
    """Higher-order ops (FlexAttention's among them) find their rule for a dispatch mode by its exact type, and
    PyTorch registers rules for the two checkpointing modes: give ``sub`` the rules of ``base`` (without them
    FlexAttention under op-level checkpointing raised 'no rule registered'). Called for every checkpointed
    forward, so it copies only when higher-order ops were registered since the last copy (a module imported
    later)."""
    from torch._ops import _higher_order_ops

    if _SHARED_AT.get(sub) == len(_higher_order_ops):
        return
    for op in list(_higher_order_ops.values()):
        if base in op.python_key_table and sub not in op.python_key_table:
            op.python_key_table[sub] = op.python_key_table[base]
    _SHARED_AT[sub] = len(_higher_order_ops)


def wrap_block(block: nn.Module, mode: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode in SELECTIVE_AC:
        return checkpoint_wrapper(block, context_fn=_op_policy(mode == "matmuls"), preserve_rng_state=False)
    return checkpoint_wrapper(block, preserve_rng_state=False)  # non-reentrant (the default impl)


def apply_activation_checkpointing(layers: nn.ModuleDict, mode: str, every: int) -> None:
    """Wrap blocks in place (names gain a wrapper segment; ``canonical_name`` strips it)."""
    if mode == "none":
        return
    for i, (name, block) in enumerate(list(layers.items())):
        if mode == "every_k" and i % every != 0:
            continue
        layers[name] = wrap_block(block, mode if mode in SELECTIVE_AC else "full")
