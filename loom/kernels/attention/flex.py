"""PyTorch's FlexAttention as a backend (``model.attention = flex``): causal attention, packed documents and a sliding
window by a block mask. Not a kernel of ours: PyTorch generates it (Triton under ``torch.compile``); ``auto`` times
it against ours for packed documents, where the two are close on some shapes (docs/kernels.md).

The block mask is built from the documents' first keys at block granularity (``block_ranges``: O((S/128)^2) work per
sample, cheap enough to redo in every layer) rather than by evaluating a mask function over all S x S pairs as
``create_block_mask`` does; the mask function only decides the elements of the blocks a document boundary or the
diagonal cuts.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 128  # FlexAttention's default block size (queries and keys)


def block_ranges(start: torch.Tensor, seq: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Which key blocks each query block sees, for causal attention where query i sees keys [start[i], i].

    ``start`` (B, S) int: first key each query may see (its document's start; ``S`` for a query that sees nothing).
    Returns ``(partial, full)``, both (B, nq, nk) bool: ``full`` blocks are visible in every element, ``partial``
    ones in some (not full). A document is a contiguous run, so a block's visible keys are the union of its rows'
    ranges: from the smallest start to the last query; every row sees a key block whole when the block lies
    between the largest start and the first query."""
    bsz = start.shape[0]
    n = -(-seq // block)
    pad = n * block - seq
    start = torch.nn.functional.pad(start.to(torch.int64), (0, pad), value=seq).view(bsz, n, block)
    lo = start.min(dim=2).values  # (B, nq): smallest start of the block's queries
    hi = start.max(dim=2).values  # (B, nq): largest (a padded or padding row makes it seq: never full)
    first = torch.arange(n, device=start.device) * block  # (n,) first index of each block
    last = torch.clamp(first + block - 1, max=seq - 1)  # (n,) last index inside the sequence
    q_first, q_last = first[None, :, None], last[None, :, None]  # (1, nq, 1)
    k_first, k_last = first[None, None, :], last[None, None, :]  # (1, 1, nk)
    any_visible = (k_first <= q_last) & (k_last >= lo[:, :, None]) & (lo[:, :, None] <= q_last)
    whole = first + block <= seq  # (n,) blocks that lie inside the sequence
    full = (k_last <= q_first) & (k_first >= hi[:, :, None]) & whole[None, :, None] & whole[None, None, :]
    return any_visible & ~full, full


def _as_indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, nq, nk) bool -> FlexAttention's (B, 1, nq) counts and (B, 1, nq, nk) key block indices, visible ones
    first in increasing order."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


def document_block_mask(starts: torch.Tensor | None, seq: int, device: torch.device, window: int = 0):
    """Causal BlockMask, with packed documents when ``starts`` (B, S) (``reference.document_starts``: the first
    key each query may see) is given; ``window`` > 0: query i sees keys i - window < j <= i only. The window
    moves each query's first key up, so a query's keys stay one range [start, i] and ``block_ranges`` holds."""
    from torch.nn.attention.flex_attention import BlockMask

    if starts is None and not window:
        start = torch.zeros(
            1, seq, dtype=torch.int32, device=device
        )  # one sequence: every mask row is causal

        def mask_mod(b, h, q, k):
            return k <= q
    elif starts is None:
        start = (torch.arange(seq, device=device) - window + 1).clamp_min(0).to(torch.int32)[None]  # (1, S)

        def mask_mod(b, h, q, k):
            return (k <= q) & (q - k < window)
    else:
        start = starts  # (B, S) first key of each query's document (S for padding)
        if window:
            start = torch.maximum(start, torch.arange(seq, device=device, dtype=start.dtype) - window + 1)

        def mask_mod(b, h, q, k):
            return (k <= q) & (k >= start[b, q])

    partial, full = block_ranges(start, seq)
    kv_num, kv_idx = _as_indices(partial)
    full_num, full_idx = _as_indices(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(seq, seq)
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled function per process; dynamic=False: a shape change recompiles rather than turning it dynamic
    # (dynamic Flex kernels are slower: docs/kernels.md)
    return torch.compile(flex_attention, dynamic=False)


def flex_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor | None, window: int = 0
) -> torch.Tensor:
    """Causal attention over q (B, Hq, S, D), k/v (B, Hkv, S, D) with FlexAttention; packed documents when
    ``starts`` (B, S) is given (``reference.document_starts``); ``window`` > 0: a sliding window. On CUDA outside
    ``torch.compile`` the call is compiled (eager Flex materializes the scores); inside a compiled model Dynamo traces
    Flex itself; on CPU it runs eagerly (tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = document_block_mask(starts, q.shape[2], q.device, window)  # (B or 1) x 1 x blocks
    fn = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
    return fn(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
