"""Which kernels a model uses: ``model.attention`` and ``model.fused_*`` from the config, ``auto`` resolved
per device, compile mode and data layout from what bench/kernels.py and bench/train_1b.py measured
(bench/results/, bench/NOTES.md):

- attention on CUDA: whichever backend ran faster when the trainer timed the candidates on the run's shape at
  start-up (``measure_attention``; loom.kernels.select; GPU time, launch overhead not counted): for packed
  documents ours (``flash``) vs FlexAttention (``flex``), both skipping the blocks the document mask removes
  (SDPA needs an explicit dense mask: ours was 1.39x it end to end on H100; Flex beat ours on d128 documents
  before the Gluon kernels, ours is 1.32-1.37x it there now in bench/results/kernels_docs_h100.md, end to end
  within a few %); for
  plain causal attention SDPA (PyTorch's choice: cuDNN on H100 with torch 2.11) vs ours (on H100 cuDNN wins:
  bench/results/kernels_causal_h100.md).
  Untimed (deterministic runs): ours for documents, else SDPA.
  CPU -> SDPA (the reference is for tests; Flex has no backward on CPU);
- fused RMSNorm / RoPE / SwiGLU: CUDA without torch.compile -> ours; with compile Inductor generates
  fused kernels of its own for them; CPU -> plain PyTorch; the fused RMSNorm is off under tensor
  parallelism (sequence-parallel norms see DTensors, which the custom op has no sharding rule for);
- fused linear + cross-entropy: CUDA -> on (never materializes the logits); not with tensor or pipeline
  parallelism (vocab-sharded or stage-split output); CPU -> off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from loom.kernels.triton_support import has_triton


@dataclass(frozen=True)
class KernelChoice:
    attention: str  # "sdpa" | "flash" | "flex"
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


def resolve_kernels(model_cfg, device_type: str, *, compile: bool, documents: bool, tp: bool = False,
                    pp: bool = False, measure_attention: Callable[[], str] | None = None,
                    triton: bool | None = None) -> KernelChoice:
    """``model_cfg``: the ``model`` config section; ``tp`` / ``pp``: tensor / pipeline parallelism on;
    ``measure_attention``: times the backends and names the faster (called only when ``auto`` needs it);
    ``triton``: whether Triton is installed (None = look; the planner assumes a GPU machine that has it)."""
    triton_gpu = device_type == "cuda" and (has_triton() if triton is None else triton)
    attention = model_cfg.attention
    if attention == "auto":
        if triton_gpu and measure_attention is not None:
            attention = measure_attention()  # the trainer times flash vs flex for documents, sdpa vs flash without
        elif triton_gpu and documents:
            attention = "flash"
        else:
            attention = "sdpa"
    eager_gpu = triton_gpu and not compile
    return KernelChoice(
        attention=attention,
        fused_norm=_flag(model_cfg.fused_norm, eager_gpu and not tp),
        fused_rope=_flag(model_cfg.fused_rope, eager_gpu),
        fused_swiglu=_flag(model_cfg.fused_swiglu, eager_gpu),
        fused_loss=_flag(model_cfg.fused_loss, triton_gpu and not (tp or pp)),
    )
