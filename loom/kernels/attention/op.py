"""FlashAttention as ``torch.library`` custom ops (``loom::flash_attn`` and its backward), and the public
``flash_attention`` function. Each call runs on the kernels ``loom.kernels.dispatch`` names: the reference,
the Triton kernels (CUDA, or the CPU interpreter with TRITON_INTERPRET=1) or the Gluon Hopper kernels. Fake
implementations let ``torch.compile`` trace the op."""

from __future__ import annotations

import torch

from loom.kernels import dispatch
from loom.kernels.attention import reference


def attention_forward(q, k, v, causal: bool, bounds, window: int, scale: float, key_bounds=None):
    """(out like q, lse (B, Hq, S) float32) on the kernels ``dispatch.forward_kernel`` picks."""
    kernel = dispatch.forward_kernel(q, k, v, key_bounds, window)
    if kernel == "reference":
        out, lse = reference.attention_forward(q, k, v, causal, bounds, window, scale, key_bounds)
        return reference.as_promised(out, q), lse.contiguous()
    from loom.kernels.attention import triton as T

    if kernel == "triton":
        return T.attention_forward(q, k, v, causal, bounds, window, scale, key_bounds)
    from loom.kernels.attention.hopper import launch as H

    T.check_inputs(q, k, v, bounds, window, key_bounds)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    H.forward(q, k, v, out, lse, causal, bounds, scale, T.seq_key(q.shape[2]))
    return out, lse


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    causal: bool,
    bounds,
    window: int,
    scale: float,
    key_bounds=None,
    lse_normalizes: bool = False,
):
    """(dq, dk, dv) on the kernels ``dispatch.backward_kernels`` picks; ``dlse``: the gradient flowing into the
    log-sum-exp, or None. ``lse_normalizes``: the reference too normalizes by the given ``lse`` (the kernels
    always do), for k, v a block of the keys whose out and lse are the whole row's."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dkdv, dq_kernel = dispatch.backward_kernels(q, k, v, dout, bounds, key_bounds, window)
    if dkdv == "reference":
        dq, dk, dv = reference.attention_backward(
            dout, q, k, v, out, lse, dlse, causal, bounds, window, scale, key_bounds, lse_normalizes
        )
        return reference.as_promised(dq, q), reference.as_promised(dk, k), reference.as_promised(dv, v)
    from loom.kernels.attention import triton as T

    if dkdv == "triton":
        return T.attention_backward(dout, q, k, v, out, lse, dlse, causal, bounds, window, scale, key_bounds)
    from loom.kernels.attention.hopper import launch as H

    T.check_inputs(q, k, v, bounds, window, key_bounds)
    delta, lse2 = T.backward_preprocess(dout, out, lse, dlse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    key = T.seq_key(q.shape[2])
    H.dkdv(
        q, k, v, dout, lse2, delta, dk, dv, causal, bounds, scale, key, persistent=dkdv == "hopper_persistent"
    )
    if dq_kernel == "hopper":
        H.dq(q, k, v, dout, lse2, delta, dq, causal, bounds, scale, key)
    else:
        T.triton_dq(dout, q, k, v, lse2, delta, dq, causal, bounds, window, scale)
    return dq, dk, dv


@torch.library.custom_op("loom::flash_attn", mutates_args=())
def flash_attn_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | None,
    key_bounds: torch.Tensor | None,
    causal: bool,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, causal, bounds, window, scale, key_bounds)


@flash_attn_op.register_fake
def _(q, k, v, bounds, key_bounds, causal, window, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("loom::flash_attn_backward", mutates_args=())
def flash_attn_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    bounds: torch.Tensor | None,
    key_bounds: torch.Tensor | None,
    causal: bool,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_backward(dout, q, k, v, out, lse, dlse, causal, bounds, window, scale, key_bounds)


@flash_attn_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, bounds, key_bounds, causal, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, bounds, key_bounds, causal, window, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bounds, key_bounds)
    ctx.causal, ctx.window, ctx.scale = causal, window, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, bounds, key_bounds = ctx.saved_tensors
    dq, dk, dv = flash_attn_backward_op(
        dout, q, k, v, out, lse, dlse, bounds, key_bounds, ctx.causal, ctx.window, ctx.scale
    )
    return dq, dk, dv, None, None, None, None, None


flash_attn_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    doc_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    bounds: torch.Tensor | None = None,
    key_bounds: torch.Tensor | None = None,
    window: int = 0,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Attention over q (B, Hq, S, D) and k, v (B, Hkv, S, D); Hq a multiple of Hkv (GQA without copies).

    Packed documents, one of: ``doc_ids`` (B, S) (runs of equal ids are documents, negative = padding),
    ``cu_seqlens`` (n_docs + 1,) for B = 1 (varlen layout), or precomputed ``bounds`` (2, B, S) from
    ``reference.document_bounds`` (compute once per batch, reuse in every layer); with ``bounds``,
    ``key_bounds`` (2, B, S) when queries and keys are different pieces of one sequence (context parallelism:
    see ``reference``'s docstring). ``window`` > 0: sliding
    window |i - j| < window. Returns out (B, Hq, S, D), and with ``return_lse`` also the log-sum-exp
    (B, Hq, S) float32 (natural log; -inf for a query that sees no key)."""
    if sum(x is not None for x in (doc_ids, cu_seqlens, bounds)) > 1:
        raise ValueError("give at most one of doc_ids, cu_seqlens, bounds")
    if key_bounds is not None and bounds is None:
        raise ValueError("key_bounds needs bounds (the queries' side of the same document mask)")
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch 1 (documents concatenated), got batch {q.shape[0]}")
        doc_ids = reference.doc_ids_from_cu_seqlens(cu_seqlens, q.shape[2])
    if doc_ids is not None:
        bounds = reference.document_bounds(doc_ids)
    scale = reference.default_scale(q.shape[-1]) if scale is None else scale
    out, lse = flash_attn_op(q, k, v, bounds, key_bounds, causal, window, scale)
    return (out, lse) if return_lse else out
