"""Plain single-device building blocks: RMSNorm, grouped-query attention, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from loom.kernels.attention.fa4 import fa4_attention
from loom.kernels.attention.flex import flex_attend
from loom.kernels.attention.op import flash_attention
from loom.kernels.attention.reference import doc_ids_from_positions, document_bounds, document_starts, visible
from loom.kernels.dispatch import PINNED_SDPA
from loom.kernels.rmsnorm.op import rms_norm
from loom.kernels.rmsnorm.reference import rms_norm as rms_norm_reference
from loom.kernels.rope.op import apply_rope as fused_apply_rope
from loom.kernels.rope.reference import apply_rope
from loom.kernels.swiglu.op import swiglu
from loom.kernels.swiglu.reference import swiglu as swiglu_reference


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics (``loom.kernels.rmsnorm.reference``); ``fused``: the same math as one
    ``loom::rms_norm`` op (Triton on CUDA)."""

    def __init__(self, dim: int, eps: float, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm if self.fused else rms_norm_reference)(x, self.weight, self.eps)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str,
    positions: torch.Tensor | None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention over q (B, Hq, S, D), k/v (B, Hkv, S, D). With per-document ``positions`` (B, S),
    packed documents never attend to each other (a document starts where its position is 0). ``window`` > 0:
    query i sees only keys i - window < j <= i (Mistral's sliding window; transformers' convention)."""
    window = window if window < q.shape[2] else 0  # a window as long as the sequence changes nothing
    if backend == "flex":
        starts = None if positions is None else document_starts(doc_ids_from_positions(positions))
        return flex_attend(q, k, v, starts, window)
    bounds = None if positions is None else document_bounds(doc_ids_from_positions(positions))  # (2, B, S)
    if backend == "flash":
        return flash_attention(q, k, v, causal=True, bounds=bounds, window=window)
    if backend == "fa4":  # plain causal attention only: the resolver refuses documents and windows for it
        if bounds is not None or window:
            raise ValueError(
                "attention backend fa4 runs plain causal attention: no packed documents, no window"
            )
        return fa4_attention(q, k, v)
    # a branch, not bool(): under compile with dynamic head counts the comparison is a SymBool, which SDPA's
    # enable_gqa refuses; branching on it specializes the graph to a plain bool (a guard)
    gqa = True if q.shape[1] != k.shape[1] else False
    masked = bounds is not None or window > 0
    # (B or 1, 1, S, S), slower
    mask = visible(q.shape[2], True, bounds, window, q.device) if masked else None
    if backend in PINNED_SDPA and q.is_cuda:
        # SDPA on one of PyTorch's backends ("sdpa_cudnn", "sdpa_flash"): the context enables only that one and
        # restores the previous set on exit; it leaves the process-wide priority order alone (docs/kernels.md).
        # The backward runs the backend's own backward op, whatever context it runs in. Off CUDA (the planner's
        # fake tensors) plain SDPA: the same math.
        with sdpa_kernel(getattr(SDPBackend, PINNED_SDPA[backend])):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa
            )
    # "sdpa": PyTorch picks its own backend; no sdpa_kernel(..., set_priority=True) context: it changes other SDPA
    # calls' choice in the process (docs/kernels.md)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


def project(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """Each of ``linears`` applied to ``x``; linears of one type that can compute together (``project_together``,
    e.g. LoRA's: one call for q, k, v) do, else one by one."""
    together = getattr(type(linears[0]), "project_together", None)
    if together is not None and all(type(m) is type(linears[0]) for m in linears):
        out = together(x, linears)
        if out is not None:
            return out
    return [m(x) for m in linears]


class LocalContext:
    """``Attention.context`` by default: this rank holds whole sequences. Context parallelism installs its own
    (``loom.parallel.context_parallel.ContextParallel``): this rank's share of each sequence, attended across ranks."""

    def rope_positions(
        self, positions: torch.Tensor | None, bsz: int, seq: int, device
    ) -> torch.Tensor | None:
        """RoPE positions of this rank's (B, S) tokens: the per-document ``positions`` of packed documents, or None
        for 0..S-1."""
        return positions

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None,
        backend: str,
        window: int = 0,
    ) -> torch.Tensor:
        """Causal attention of q (B, Hq, S, D) over k/v (B, Hkv, S, D) (``attend``)."""
        return attend(q, k, v, backend, positions, window)


LOCAL_CONTEXT = LocalContext()  # stateless: shared by every attention module until loom.parallel replaces it


class Attention(nn.Module):
    """Causal grouped-query attention; head counts are read from weight shapes so TP can shard them.
    ``bias``: q/k/v projections with biases (Qwen2; never the output projection); ``qk_norm``: an RMSNorm over
    each q and k head before RoPE (Qwen3); ``window`` > 0: sliding-window attention (Mistral).

    ``context``, the module's one extension point: the sequences x's tokens belong to, which give their RoPE
    positions and what they attend to (``LocalContext``; context parallelism installs its own)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        fused_rope: bool = False,
        backend: str = "sdpa",
        bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        fused_norm: bool = False,
        window: int = 0,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.backend = (
            backend  # "sdpa" (PyTorch's choice), "sdpa_cudnn" / "sdpa_flash" (SDPA on that backend), "fa4"
            # (FlashAttention-4's kernels), "flash" (loom's Triton FlashAttention-2), "flex" (FlexAttention)
        )
        self.window = window
        self.apply_rope = fused_apply_rope if fused_rope else apply_rope  # fused: one loom::apply_rope op
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = self.k_norm = None
        if qk_norm:  # one weight over head_dim shared by every head: replicated, whatever splits the heads
            self.q_norm = RMSNorm(head_dim, norm_eps, fused=fused_norm)
            self.k_norm = RMSNorm(head_dim, norm_eps, fused=fused_norm)
        self.context = LOCAL_CONTEXT

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """x (B, S, E): this rank's tokens; ``positions`` (B, S): their per-document positions (packed
        documents), or None."""
        bsz, seq, _ = x.shape
        rope_at = self.context.rope_positions(positions, bsz, seq, x.device)  # (B, S), or None: 0..S-1
        q, k, v = project(x, (self.wq, self.wk, self.wv))
        q = q.view(bsz, seq, -1, self.head_dim)  # (B, S, Hq, D)
        k = k.view(bsz, seq, -1, self.head_dim)  # (B, S, Hkv, D)
        v = v.view(bsz, seq, -1, self.head_dim)  # (B, S, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.apply_rope(q, rope, rope_at), self.apply_rope(k, rope, rope_at)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        out = self.context.attend(q, k, v, positions, self.backend, self.window)  # (B, Hq, S, D)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))  # (B, S, E)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), the gate from ``loom.kernels.swiglu.reference``; ``fused``: the gate as one
    ``loom::swiglu`` op (Triton on CUDA)."""

    def __init__(self, dim: int, hidden: int, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, (self.w1, self.w3))
        return self.w2((swiglu if self.fused else swiglu_reference)(gate, up))
