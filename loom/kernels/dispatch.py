"""Which kernels a model uses: ``model.attention`` and ``model.fused_*`` from the config, ``auto`` resolved
per device, compile mode and data layout from what bench/kernels.py and bench/train_1b.py measured
(bench/results/, bench/NOTES.md):

- attention: plain causal attention -> PyTorch SDPA (its cuDNN / flash backends beat ours on H100: see
  bench/results/kernels_h100.md); packed documents -> ours (``flash``: skips the blocks a document mask
  removes, where SDPA needs an explicit dense mask); CPU -> SDPA (the reference is for tests);
- fused RMSNorm / RoPE / SwiGLU: CUDA without torch.compile -> ours; with compile Inductor generates
  fused kernels of its own for them; CPU -> plain PyTorch; the fused RMSNorm is off under tensor
  parallelism (sequence-parallel norms see DTensors, which the custom op has no sharding rule for);
- fused linear + cross-entropy: CUDA -> on (never materializes the logits); not with tensor or pipeline
  parallelism (vocab-sharded or stage-split output); CPU -> off;
- pipeline schedules that split input and weight gradients (interleaved_zb, zbv, dualpipev) keep
  gradient edges to nodes inside the stage and read their metadata in the weight pass, after the stage's
  output may be freed; an edge to a Python autograd node (our custom ops' autograd is one) holds it only
  weakly in torch 2.11, so the node is gone by then ("Attribute '_input_metadata' is invalid", found on
  2xH200 with the 125M flavor; torch 2.13 keeps it). Where the probe below finds that, ``auto`` turns our
  custom ops off for those schedules and asking for them is a config error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from loom.kernels.triton_support import has_triton


@dataclass(frozen=True)
class KernelChoice:
    attention: str  # "sdpa" | "flash"
    fused_norm: bool
    fused_rope: bool
    fused_swiglu: bool
    fused_loss: bool

    def as_args(self) -> dict:
        return dict(attention=self.attention, fused_norm=self.fused_norm, fused_rope=self.fused_rope,
                    fused_swiglu=self.fused_swiglu, fused_loss=self.fused_loss)

    def describe(self) -> str:
        fused = [n for n in ("norm", "rope", "swiglu", "loss") if getattr(self, f"fused_{n}")]
        return f"attention={self.attention}, fused={'+'.join(fused) or 'none'}"


def _flag(value: str, auto: bool) -> bool:
    return auto if value == "auto" else value == "true"


@functools.cache
def custom_ops_split_backward_ok() -> bool:
    """Whether a gradient edge to a Python autograd node (our custom ops' autograd is one) still describes
    the node after every tensor of its graph is freed, as torch.distributed.pipelining's weight-gradient
    pass needs: the edge must keep the node alive."""
    import gc

    from torch.autograd.graph import get_gradient_edge

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    y = _Probe.apply(torch.zeros(1, requires_grad=True))
    edge = get_gradient_edge(y)
    del y
    gc.collect()
    try:
        edge.node._input_metadata
    except (RuntimeError, AttributeError):
        return False
    return True


def resolve_kernels(model_cfg, device_type: str, *, compile: bool, documents: bool, tp: bool = False,
                    pp: bool = False, split_backward: bool = False) -> KernelChoice:
    """``model_cfg``: the ``model`` config section; ``tp`` / ``pp``: tensor / pipeline parallelism on;
    ``split_backward``: a pipeline schedule that computes input and weight gradients apart."""
    triton_gpu = device_type == "cuda" and has_triton()
    custom_ok = not split_backward or custom_ops_split_backward_ok()
    attention = model_cfg.attention
    if attention == "auto":
        attention = "flash" if triton_gpu and documents and custom_ok else "sdpa"
    eager_gpu = triton_gpu and not compile and custom_ok
    return KernelChoice(
        attention=attention,
        fused_norm=_flag(model_cfg.fused_norm, eager_gpu and not tp),
        fused_rope=_flag(model_cfg.fused_rope, eager_gpu),
        fused_swiglu=_flag(model_cfg.fused_swiglu, eager_gpu),
        fused_loss=_flag(model_cfg.fused_loss, triton_gpu and custom_ok and not (tp or pp)),
    )
