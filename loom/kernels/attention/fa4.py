"""FlashAttention-4 (the ``flash-attn-4`` package: CuTe DSL kernels for Hopper and Blackwell) as ``torch.library``
custom ops, ``loom::fa4`` and its backward, with fake implementations so ``torch.compile`` traces them (FA4's own
``FlashAttnFunc`` is a plain autograd function). Plain causal attention only: no packed documents, no window.

Why: on an H200 at the 8B shape (d128, 32/8 heads, 8k causal) its forward + backward ran 1.12x cuDNN SDPA's
(docs/kernels.md). The package is optional; ``installed`` and ``refusal`` say whether a run can use it."""

from __future__ import annotations

import functools
import importlib.util

import torch

from loom.kernels.attention.reference import as_promised, default_scale

PACKAGE = "flash-attn-4"
# compute capability majors loom runs FA4 on: Hopper (9.x) and data-centre Blackwell (10.x, 11.x); FA4's 12.x path
# lacks features (no deterministic backward, no score mods) and is not measured here
ARCHS = (9, 10, 11)


@functools.cache
def installed() -> bool:
    """Whether ``flash_attn.cute`` (FA4) is importable, without importing it (its import loads the CuTe DSL)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    # ImportError: the parent package ``flash_attn`` failed to import (FlashAttention-2's, an ABI mismatch)
    except ImportError:
        return False


def head_dims_allowed(head_dim: int, major: int) -> bool:
    """FA4's head dims (interface._validate_head_dims, 4.0.0b36): multiples of 8; up to 256 on Hopper, up to 128
    or exactly 256 on Blackwell."""
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return False
    return major == 9 or head_dim <= 128 or head_dim == 256


def refusal(device: torch.device, head_dim: int) -> str | None:
    """Why FA4 cannot run attention of ``head_dim`` on ``device`` (the package, the GPU, its import), or None."""
    if not installed():
        return f"needs the {PACKAGE} package (pip install --pre {PACKAGE})"
    if device.type != "cuda":
        return f"needs a CUDA GPU (device {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in ARCHS:
        return f"runs here on compute capability 9.x-11.x (Hopper, data-centre Blackwell); this GPU is {major}.{minor}"
    if not head_dims_allowed(head_dim, major):
        limit = "256" if major == 9 else "128, or 256"
        return f"takes head dims that are multiples of 8 up to {limit} here; this model's attention has {head_dim}"
    try:  # a broken install (the CuTe DSL runtime missing) fails here in one line, not at the first step
        _interface()
    except Exception as e:
        return f"is installed but does not import ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return None


def _interface():
    from flash_attn.cute import interface

    return interface


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))  # contiguous (B, S, Hq, Dv), what FA4 allocates


@torch.library.custom_op("loom::fa4", mutates_args=())
def fa4_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, S, Hq, D), k/v (B, S, Hkv, D) -> out (B, S, Hq, D), lse (B, Hq, S) float32."""
    out, lse, *_ = _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    return as_promised(out, _out_like(q, v)), lse.contiguous()


@fa4_op.register_fake
def _(q, k, v, causal, scale):
    return _out_like(q, v), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("loom::fa4_backward", mutates_args=())
def fa4_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # FA4 makes dout's last dim contiguous itself
    dq, dk, dv = _interface()._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal)
    return as_promised(dq, q), as_promised(dk, k), as_promised(dv, v)


@fa4_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dout, _dlse):
    # the log-sum-exp is never an output of ``fa4_attention``: no gradient flows into it
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = fa4_backward_op(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


fa4_op.register_autograd(_backward, setup_context=_setup_context)


def fa4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Attention of q (B, Hq, S, D) over k, v (B, Hkv, S, D) (Hq a multiple of Hkv) on FA4's kernels; out (B, Hq,
    S, D). FA4 reads (B, S, H, D): the model's q, k, v are that layout transposed, so no copy is made."""
    out, _ = fa4_op(*(t.transpose(1, 2) for t in (q, k, v)), causal, default_scale(q.shape[-1]))
    return out.transpose(1, 2)
