"""Context parallelism: every sequence split over the ``cp`` mesh axis, load-balanced for causal attention;
``ContextParallel`` is the ``Attention.context`` that attends across the cp ranks' shards."""

from __future__ import annotations

import torch
from torch import nn

from loom.kernels.attention.op import flash_attention
from loom.kernels.attention.reference import doc_ids_from_positions, document_bounds, shift_bounds
from loom.models.common.layers import Attention
from loom.parallel.collectives import gather_along
from loom.parallel.expert_parallel import moe_parallel


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two global chunks (of 2·cp) that cp rank ``rank`` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(t: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's shard of ``t`` along ``dim`` (length divisible by 2·cp): (B, S, ...) -> (B, S/cp, ...).

    The layout, load-balanced for causal attention: the sequence is cut into 2·cp equal chunks and cp rank r holds
    chunks r and 2·cp-1-r, so every rank has the same causal work. Token ids and labels (the trainer) and RoPE
    positions (``local_positions``) are sharded this way; everything but attention is per token."""
    chunk = t.shape[dim] // (2 * cp)
    a, b = chunk_ids(rank, cp)
    return torch.cat([t.narrow(dim, a * chunk, chunk), t.narrow(dim, b * chunk, chunk)], dim)


def local_positions(seq_local: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions (S_local,) int64 of this cp rank's tokens."""
    return shard_sequence(torch.arange(seq_local * cp, device=device), rank, cp, dim=0)


def pair_bounds(bounds: torch.Tensor, g: int, j: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document bounds (2, B, S) of the whole sequence -> (query side, key side), each (2, B, chunk) int32, for
    query chunk ``g`` attending to key chunk ``j``: each query's keys in chunk j's coordinates, each key's
    queries in chunk g's (``flash_attention``'s ``bounds`` and ``key_bounds``)."""
    rows = lambda i: bounds[:, :, i * chunk:(i + 1) * chunk]  # noqa: E731
    queries = shift_bounds(rows(g), j * chunk, chunk)
    return queries, queries if j == g else shift_bounds(rows(j), g * chunk, chunk)  # one table on the diagonal


def merge_blocks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Combine attention over disjoint key blocks: outs (B, H, S, D), lses (B, H, S) fp32 -> (B, H, S, D)."""
    if len(outs) == 1:  # the first chunk sees only itself
        return outs[0]
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # (B, H, S)
    out = sum(o.float() * torch.exp(l - lse)[..., None] for o, l in zip(outs, lses))
    return out.to(outs[0].dtype)


class ContextParallel:
    """``Attention.context`` under context parallelism: x is this rank's two chunks of each sequence.

    RoPE positions: where those tokens sit in the sequence (or their per-document positions, sharded with them).
    Attention all-gathers K and V over the cp axis (Llama 3's all-gather context parallelism: under GQA K/V are a
    fraction of Q; one collective per layer) and attends each local query chunk to every key chunk at or before
    it, one block at a time through ``flash_attention`` (loom's Triton kernel on CUDA, its PyTorch reference on
    CPU; whatever the model's attention backend) with the log-sum-exp, merging the blocks' outputs by their
    log-sum-exps. The gather's backward is a reduce-scatter of dK/dV (``loom.parallel.collectives``), so gradients
    need nothing else. Packed documents: their per-document positions are all-gathered too (B x S integers per
    layer), turned into the whole sequence's document bounds, and each (query chunk, key chunk) pair gets them in
    its own coordinates (``pair_bounds``); documents are contiguous, so each range stays one interval in a chunk."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def positions(self, seq_local: int, device) -> torch.Tensor:
        return local_positions(seq_local, self.rank, self.size, device)

    def rope_positions(self, positions: torch.Tensor | None, bsz: int, seq_local: int, device) -> torch.Tensor:
        """RoPE positions (B, S_local) of this rank's tokens: the per-document ``positions`` of packed documents
        (sharded with the tokens), else their places in the whole sequence."""
        return positions if positions is not None else self.positions(seq_local, device).expand(bsz, seq_local)

    def _gather(self, t: torch.Tensor, dim: int = 2, autograd: bool = True) -> list[torch.Tensor]:
        """``t`` with this rank's S_local tokens along ``dim`` from every cp rank -> the 2·cp chunks in global
        order. ``autograd``: the backward reduce-scatters the gradients (K/V); not for integer tensors."""
        full = gather_along(t if autograd else t.detach(), dim, self.group, self.size)  # (..., cp·S_l, ...)
        pieces = full.chunk(2 * self.size, dim=dim)  # rank r's shard = pieces 2r (chunk r), 2r+1 (chunk 2cp-1-r)
        ordered: list[torch.Tensor] = [None] * (2 * self.size)  # type: ignore[list-item]
        for r in range(self.size):
            a, b = chunk_ids(r, self.size)
            ordered[a], ordered[b] = pieces[2 * r], pieces[2 * r + 1]
        return ordered

    def document_bounds(self, positions: torch.Tensor) -> torch.Tensor:
        """Per-document positions (B, S_local) of this rank's tokens -> the whole sequence's document bounds
        (2, B, S)."""
        whole = torch.cat(self._gather(positions, dim=1, autograd=False), dim=1)  # (B, S) in global order
        return document_bounds(doc_ids_from_positions(whole))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
               backend: str | None = None, window: int = 0) -> torch.Tensor:
        """q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D) of this rank's chunks -> causal attention output
        (B, Hq, S_local, D) over the whole sequence; with per-document ``positions`` (B, S_local), packed
        documents do not attend to each other. ``backend`` (the model's) is not used: always ``flash_attention``;
        ``window``: none (a sliding window is not supported here yet)."""
        assert window == 0, "loom.resolve refuses a sliding window with context parallelism"
        ks, vs = self._gather(k), self._gather(v)
        bounds = None if positions is None else self.document_bounds(positions)
        chunk = q.shape[2] // 2
        outs = []
        for qc, g in zip(q.chunk(2, dim=2), chunk_ids(self.rank, self.size)):
            blocks = []
            for j in range(g + 1):
                docs = {} if bounds is None else dict(zip(("bounds", "key_bounds"), pair_bounds(bounds, g, j, chunk)))
                blocks.append(flash_attention(qc, ks[j], vs[j], causal=j == g, return_lse=True, **docs))
            outs.append(merge_blocks([o for o, _ in blocks], [lse for _, lse in blocks]))
        return torch.cat(outs, dim=2)


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Install one ``ContextParallel`` over the cp group of ``cp_mesh`` as the ``Attention.context`` of every
    attention module of ``model`` (a model or a pipeline stage), and add the cp group to the sequence shards of
    its MoE blocks' ``MoE.parallel`` (the sequence-wise balance loss counts over whole sequences)."""
    cp = ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
    for module in model.modules():
        if isinstance(module, Attention):
            module.context = cp
    par = moe_parallel(model)
    if par is not None:
        par.sequence_shards += ((cp.group, cp.size),)
