"""RoPE Triton kernel and its checking launchers (imported only when Triton runs).

One program per (token, block of heads): it reads the token's position once, the cos/sin halves once,
and rotates BLOCK_H heads of x (B, S, H, D) in fp32. The same kernel computes the backward (the
transposed rotation, ``BACKWARD``). Plain pointer arithmetic and masks only: Triton 3.6 and newer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels.triton_support import check_tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POSITION_DTYPES = (torch.int64, torch.int32)
_TILE = 2048  # elements of one half-rotation per program


@triton.jit
def _rope_kernel(
    x_ptr,
    table_ptr,
    pos_ptr,
    out_ptr,
    seq_len,
    n_heads,
    table_len,
    HEAD_DIM: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # HEAD_DIM a compile-time constant (one per model): the half offset and the masks fold away
    token = tl.program_id(0).to(tl.int64)  # b * S + s
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    half = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_HALF)  # (BLOCK_HALF,)
    d_ok = d < half
    if HAS_POSITIONS:
        pos = tl.load(pos_ptr + token).to(tl.int64)
    else:
        pos = token % seq_len
    cos_row = table_ptr + pos * HEAD_DIM  # table (2, L, D): cos at [0, pos], sin at [1, pos]
    sin_row = table_ptr + (table_len + pos) * HEAD_DIM
    c1 = tl.load(cos_row + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + half + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + half + d, mask=d_ok, other=0.0).to(tl.float32)

    mask = (heads < n_heads)[:, None] & d_ok[None, :]
    offs = token * n_heads * HEAD_DIM + heads[:, None].to(tl.int64) * HEAD_DIM + d[None, :]  # first halves
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # dx = [g1 c1 + g2 s2, g2 c2 - g1 s1]
        o1 = x1 * c1[None, :] + x2 * s2[None, :]
        o2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:  # out = [x1 c1 - x2 s1, x2 c2 + x1 s2]
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(out_ptr + offs, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + offs + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None, name: str) -> None:
    check_tensor(name, x, dtypes=DTYPES, ndim=4)
    check_tensor("table", table, dtypes=DTYPES, ndim=3, device=x.device)
    bsz, seq, _, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"{name}: head dim {head_dim} must be even (rotate-half)")
    if table.shape[0] != 2 or table.shape[2] != head_dim:
        raise ValueError(f"table: shape {tuple(table.shape)}, expected (2, L, {head_dim})")
    named = [(name, x), ("table", table)]
    if positions is None:
        if seq > table.shape[1]:
            raise ValueError(f"{name}: sequence length {seq} exceeds the table's {table.shape[1]} positions")
    else:
        check_tensor("positions", positions, dtypes=POSITION_DTYPES, ndim=2, device=x.device)
        if tuple(positions.shape) != (bsz, seq):
            raise ValueError(f"positions: shape {tuple(positions.shape)}, expected {(bsz, seq)}")
        named.append(("positions", positions))  # values must lie in [0, L): not checked (a host sync)
    for n, t in named:
        if not t.is_contiguous():
            raise ValueError(f"{n}: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")


def _launch(
    x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None, backward: bool
) -> torch.Tensor:
    out = torch.empty_like(x)
    bsz, seq, n_heads, head_dim = x.shape
    if out.numel() == 0:
        return out
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = max(1, min(triton.next_power_of_2(n_heads), _TILE // block_half))
    num_warps = 4 if block_h * block_half <= 2048 else 8
    grid = (bsz * seq, triton.cdiv(n_heads, block_h))
    _rope_kernel[grid](
        x,
        table,
        positions if positions is not None else x,
        out,
        seq,
        n_heads,
        table.shape[1],
        HEAD_DIM=head_dim,
        HAS_POSITIONS=positions is not None,
        BACKWARD=backward,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=num_warps,
    )
    return out


def apply_rope_forward(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """x: (B, S, H, D) contiguous; table: (2, L, D); positions: (B, S) or None. Returns (B, S, H, D)."""
    _check(x, table, positions, "x")
    return _launch(x, table, positions, backward=False)


def apply_rope_backward(
    grad: torch.Tensor, table: torch.Tensor, positions: torch.Tensor | None
) -> torch.Tensor:
    """grad: (B, S, H, D) contiguous. Returns dx (B, S, H, D) in grad's dtype."""
    _check(grad, table, positions, "grad")
    return _launch(grad, table, positions, backward=True)
