"""Context parallelism: every sequence split over the ``cp`` mesh axis, load-balanced for causal attention;
``ContextParallel`` is the ``Attention.context`` that attends across the cp ranks' shards, by all-gathering K/V
(``parallel.cp_method = allgather``) or passing K/V blocks around a ring of point-to-point sends (``ring``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group

from loom.kernels.attention.op import attention_backward, attention_forward, flash_attention
from loom.kernels.attention.reference import (
    as_promised,
    default_scale,
    doc_ids_from_positions,
    document_bounds,
    shift_bounds,
)
from loom.metrics.nvtx import nvtx_range
from loom.models.common.layers import Attention
from loom.models.common.mla import LatentAttention
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
    rows = lambda i: bounds[:, :, i * chunk : (i + 1) * chunk]
    queries = shift_bounds(rows(g), j * chunk, chunk)
    return queries, queries if j == g else shift_bounds(
        rows(j), g * chunk, chunk
    )  # one table on the diagonal


def merge_blocks_lse(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key blocks: outs (B, H, S, D), lses (B, H, S) fp32 -> (out (B, H, S, D) in
    outs[0]'s dtype, the log-sum-exp over all the blocks (B, H, S) fp32). A query no block lets see a key keeps
    out 0 and lse -inf (the kernels' convention), never NaN."""
    if len(outs) == 1:  # the first chunk sees only itself
        return outs[0], lses[0]
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # (B, H, S)
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    out = sum(o.float() * torch.exp(l - safe)[..., None] for o, l in zip(outs, lses))
    return out.to(outs[0].dtype), lse


def merge_blocks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Combine attention over disjoint key blocks: outs (B, H, S, D), lses (B, H, S) fp32 -> (B, H, S, D)."""
    return merge_blocks_lse(outs, lses)[0]


def ring_blocks(rank: int, src: int, cp: int) -> list[tuple[int, int, int, int]]:
    """The attention blocks cp rank ``rank`` computes while it holds cp rank ``src``'s K/V: (local query chunk
    0/1, src's key chunk 0/1, global query chunk g, global key chunk j) for every pair with j <= g (j == g: the
    causal diagonal). Under the 2·cp layout every step costs the same: its own K/V give three blocks (one of them
    two triangles), any other rank's two (src < rank: both query chunks see src's first chunk; src > rank: the
    second query chunk sees both)."""
    return [
        (i, h, g, j)
        for i, g in enumerate(chunk_ids(rank, cp))
        for h, j in enumerate(chunk_ids(src, cp))
        if j <= g
    ]


class _Ring:
    """The cp group as a ring: this rank sends to the next and receives from the previous (group ranks)."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def shift(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post the send of ``t`` to the next rank and the receive of the previous rank's -> (the receive
        buffer, the requests to wait for). ``tag``: distinct for messages in flight together (K/V and dK/dV in
        backward), so gloo never pairs one with the other; every rank posts in the same order (NCCL's rule)."""
        recv = torch.empty_like(t)
        ops = [
            dist.P2POp(dist.isend, t, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


def _pair_docs(bounds: torch.Tensor | None, g: int, j: int, chunk: int) -> dict:
    if bounds is None:
        return {"bounds": None, "key_bounds": None}
    return dict(zip(("bounds", "key_bounds"), pair_bounds(bounds, g, j, chunk)))


def _ring_forward(q, k, v, bounds, ring: _Ring, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention's forward: (out like q, lse (B, Hq, S_local) fp32). See ``ring_attention``."""
    chunk = q.shape[2] // 2
    qs = q.chunk(2, dim=2)
    acc: list = [None, None]  # per query chunk: (out fp32, lse)
    kv = torch.stack([k, v])  # (2, B, Hkv, S_local, D): one message per step
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        nxt, reqs = ring.shift(kv, 0) if step < ring.size - 1 else (None, [])
        with nvtx_range(f"cp.ring.forward.step{step}"):
            for i, h, g, j in ring_blocks(ring.rank, src, ring.size):
                # the block's K/V views inline: a name bound to them would keep this step's block alive
                # into the next step, beside the two the ring holds
                out, lse = attention_forward(
                    qs[i],
                    *kv[:, :, :, h * chunk : (h + 1) * chunk].unbind(0),
                    j == g,
                    scale=scale,
                    window=0,
                    **_pair_docs(bounds, g, j, chunk),
                )
                acc[i] = (
                    (out.float(), lse)
                    if acc[i] is None
                    else merge_blocks_lse([acc[i][0], out], [acc[i][1], lse])
                )
        with nvtx_range("cp.ring.wait"):
            _wait(reqs)
        kv = nxt
    out = as_promised(torch.cat([a[0] for a in acc], dim=2).to(q.dtype), q)  # the fake's layout
    lse = torch.cat([a[1] for a in acc], dim=2)
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, dlse, bounds, ring: _Ring, scale: float):
    """Ring attention's backward: (dq, dk, dv); ``dlse``: the gradient flowing into the lse, or None. See
    ``ring_attention``."""
    chunk = q.shape[2] // 2
    qs, outs, lses, douts = q.chunk(2, 2), out.chunk(2, 2), lse.chunk(2, 2), dout.chunk(2, 2)
    dlses = (None, None) if dlse is None else dlse.chunk(2, 2)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dqs = dq.chunk(2, dim=2)
    kv = torch.stack([k, v])
    dkv_reqs: list = []
    dkv_in = None
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        nxt, reqs = ring.shift(kv, 0) if step < ring.size - 1 else (None, [])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # this step's blocks' dK/dV
        with nvtx_range(f"cp.ring.backward.step{step}"):
            for i, h, g, j in ring_blocks(ring.rank, src, ring.size):
                part = slice(h * chunk, (h + 1) * chunk)
                dqb, dkb, dvb = attention_backward(  # K/V views inline, as in the forward
                    douts[i],
                    qs[i],
                    *kv[:, :, :, part].unbind(0),
                    outs[i],
                    lses[i],
                    dlses[i],
                    j == g,
                    scale=scale,
                    window=0,
                    lse_normalizes=True,
                    **_pair_docs(bounds, g, j, chunk),
                )
                dqs[i].add_(dqb)
                dkv[0, :, :, part] += dkb
                dkv[1, :, :, part] += dvb
        with nvtx_range("cp.ring.wait"):
            _wait(dkv_reqs)  # the accumulator of src's dK/dV the previous rank passed on
        if dkv_in is not None:
            dkv += dkv_in
        # on to the next rank (after the last step: to src's owner, the next rank); a ring of one keeps it
        dkv_in, dkv_reqs = ring.shift(dkv, 1) if ring.size > 1 else (dkv, [])
        with nvtx_range("cp.ring.wait"):
            _wait(reqs)
        kv = nxt
    with nvtx_range("cp.ring.wait"):
        _wait(dkv_reqs)
    dk, dv = dkv_in.unbind(0)
    # in the fake's layouts (copies: a custom op's outputs may not alias each other)
    return (as_promised(dq.to(q.dtype), q), torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv))


def _ring(group_name: str, rank: int, size: int) -> _Ring:
    return _Ring(resolve_process_group(group_name), rank, size)


@torch.library.custom_op("loom::ring_attn", mutates_args=())
def ring_attn_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | None,
    group_name: str,
    rank: int,
    size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, bounds, _ring(group_name, rank, size), scale)


@ring_attn_op.register_fake
def _(q, k, v, bounds, group_name, rank, size, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("loom::ring_attn_backward", mutates_args=())
def ring_attn_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    bounds: torch.Tensor | None,
    group_name: str,
    rank: int,
    size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ring_backward(dout, q, k, v, out, lse, dlse, bounds, _ring(group_name, rank, size), scale)


@ring_attn_backward_op.register_fake
def _(dout, q, k, v, out, lse, dlse, bounds, group_name, rank, size, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _ring_setup_context(ctx, inputs, output):
    q, k, v, bounds, group_name, rank, size, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, bounds)
    ctx.args = group_name, rank, size, scale


def _ring_autograd_backward(ctx, dout, dlse):
    q, k, v, out, lse, bounds = ctx.saved_tensors
    dq, dk, dv = ring_attn_backward_op(dout.contiguous(), q, k, v, out, lse, dlse, bounds, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


ring_attn_op.register_autograd(_ring_autograd_backward, setup_context=_ring_setup_context)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor | None,
    group,
    rank: int,
    size: int,
) -> torch.Tensor:
    """Ring attention: q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D) of cp rank ``rank``'s two chunks (the
    2·cp layout) of group ``group`` (``size`` ranks), ``bounds`` the whole sequence's document bounds (2, B, S) or
    None -> causal attention output (B, Hq, S_local, D) over the whole sequence, differentiable in q, k, v.

    Forward: cp steps; at step s this rank holds the K/V of cp rank (rank - s) mod cp, posts their send to the
    next rank and the receive of the following block (``batch_isend_irecv``), attends its query chunks to the
    blocks ``ring_blocks`` names while they travel, and merges the partial outputs by log-sum-exp as they come
    (running, in fp32). Backward: the K/V go round again, each with its dK/dV accumulator (fp32) travelling with
    it: at every step a rank adds its blocks' dK/dV to the accumulator it received and passes it on, so after cp
    steps each accumulator is back at the rank that owns those K/V; dQ stays local. Each block's backward uses the
    merged output and log-sum-exp (the flash-attention identity: a block's dS needs only the row's final ones).
    Custom ops (``loom::ring_attn`` and its backward), so torch.compile traces around them and op-level
    checkpointing saves their output like any attention's."""
    out, _ = ring_attn_op(q, k, v, bounds, group.group_name, rank, size, default_scale(q.shape[-1]))
    return out


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
    its own coordinates (``pair_bounds``); documents are contiguous, so each range stays one interval in a chunk.
    ``method = "ring"``: K/V are not gathered but go round the cp ranks block by block (``ring_attention``:
    memory for one other rank's K/V at a time instead of all of them); packed documents' positions are still
    all-gathered (integers, a 1/(2·Hkv·D) fraction of K/V's elements)."""

    def __init__(self, group, rank: int, size: int, method: str = "allgather"):
        assert method in ("allgather", "ring"), method
        self.group, self.rank, self.size, self.method = group, rank, size, method

    def positions(self, seq_local: int, device) -> torch.Tensor:
        return local_positions(seq_local, self.rank, self.size, device)

    def rope_positions(
        self, positions: torch.Tensor | None, bsz: int, seq_local: int, device
    ) -> torch.Tensor:
        """RoPE positions (B, S_local) of this rank's tokens: the per-document ``positions`` of packed documents
        (sharded with the tokens), else their places in the whole sequence."""
        return (
            positions if positions is not None else self.positions(seq_local, device).expand(bsz, seq_local)
        )

    def _gather(self, t: torch.Tensor, dim: int = 2, autograd: bool = True) -> list[torch.Tensor]:
        """``t`` with this rank's S_local tokens along ``dim`` from every cp rank -> the 2·cp chunks in global
        order. ``autograd``: the backward reduce-scatters the gradients (K/V); not for integer tensors."""
        full = gather_along(t if autograd else t.detach(), dim, self.group, self.size)  # (..., cp·S_l, ...)
        pieces = full.chunk(
            2 * self.size, dim=dim
        )  # rank r's shard = pieces 2r (chunk r), 2r+1 (chunk 2cp-1-r)
        ordered: list[torch.Tensor] = [None] * (2 * self.size)  # type: ignore[list-item]
        for r in range(self.size):
            a, b = chunk_ids(r, self.size)
            ordered[a], ordered[b] = pieces[2 * r], pieces[2 * r + 1]
        return ordered

    def shifted(self, t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
        """(B, S_local) integers of this rank's tokens -> each one's value k tokens further in the whole sequence
        (``fill`` past its end): the tokens, labels and positions a multi-token prediction module reads
        (loom.models.deepseek_v3.model.DeepSeekV3.ahead), all-gathered (B x S integers) and sharded again."""
        whole = torch.cat(self._gather(t, dim=1, autograd=False), dim=1)  # (B, S) in global order
        ahead = torch.nn.functional.pad(whole[:, k:], (0, k), value=fill)  # (B, S)
        return shard_sequence(ahead, self.rank, self.size)

    def document_bounds(self, positions: torch.Tensor) -> torch.Tensor:
        """Per-document positions (B, S_local) of this rank's tokens -> the whole sequence's document bounds
        (2, B, S)."""
        whole = torch.cat(self._gather(positions, dim=1, autograd=False), dim=1)  # (B, S) in global order
        return document_bounds(doc_ids_from_positions(whole))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        backend: str | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        """q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D) of this rank's chunks -> causal attention output
        (B, Hq, S_local, D) over the whole sequence; with per-document ``positions`` (B, S_local), packed
        documents do not attend to each other. ``backend`` (the model's) is not used: always ``flash_attention``;
        ``window``: none (a sliding window is not supported here yet)."""
        assert window == 0, "loom.resolve refuses a sliding window with context parallelism"
        bounds = None
        if positions is not None:
            with nvtx_range("cp.allgather_positions"):
                bounds = self.document_bounds(positions)
        if self.method == "ring":
            return ring_attention(q, k, v, bounds, self.group, self.rank, self.size)
        with nvtx_range("cp.allgather_kv"):
            ks, vs = self._gather(k), self._gather(v)
        chunk = q.shape[2] // 2
        outs = []
        for qc, g in zip(q.chunk(2, dim=2), chunk_ids(self.rank, self.size)):
            blocks = []
            for j in range(g + 1):
                docs = (
                    {}
                    if bounds is None
                    else dict(zip(("bounds", "key_bounds"), pair_bounds(bounds, g, j, chunk)))
                )
                blocks.append(flash_attention(qc, ks[j], vs[j], causal=j == g, return_lse=True, **docs))
            outs.append(merge_blocks([o for o, _ in blocks], [lse for _, lse in blocks]))
        return torch.cat(outs, dim=2)


def apply_context_parallel(model: nn.Module, cp_mesh, method: str = "allgather") -> None:
    """Install one ``ContextParallel`` over the cp group of ``cp_mesh`` (K/V by ``method``: allgather | ring) as
    the ``Attention.context`` of every attention module of ``model`` (a model or a pipeline stage), and add the cp
    group to the sequence shards of its MoE blocks' ``MoE.parallel`` (the sequence-wise balance loss counts over
    whole sequences); a model that reads tokens ahead (DeepSeek-V3's multi-token prediction: a ``context``
    attribute of its own) gets it too, for the tokens past its chunks."""
    cp = ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size(), method)
    for module in model.modules():
        if isinstance(module, (Attention, LatentAttention)):
            module.context = cp
    if getattr(model, "mtp", None) is not None:
        model.context = cp
    par = moe_parallel(model)
    if par is not None:
        par.sequence_shards += ((cp.group, cp.size),)
