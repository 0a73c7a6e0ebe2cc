"""The token embedding split by vocabulary rows over FSDP2's shard ranks (``parallel.fsdp_embedding vocab``).

As an FSDP2 unit the embedding all-gathers its whole table at the start of each step and reduce-scatters its whole
gradient at the end of the backward, where nothing is left to hide either behind (vocab x dim each way: 1 GiB in
bf16 and 2 GiB in fp32 for Llama 3's 128k x 4096). Here each rank keeps its rows (the same ``Shard(0)`` DTensor
FSDP2 keeps, so checkpoints, the optimizer and the gradient norm see no difference): the ranks' token ids are
all-gathered, each rank looks up the rows it holds for all of them, and a reduce-scatter hands each rank its own
tokens' embeddings (one rank holds each row, so the sum is exact); in backward the output gradients are
all-gathered and each rank sums its rows' gradients in fp32. tokens x dim move each way instead of vocab x dim."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# PyTorch 2.13 renames these two (the same arguments); 2.11 has only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class VocabShardedEmbedding(nn.Module):
    """``nn.Embedding``'s parameter and call, its rows split over a 1-D ``mesh`` (torch.chunk's split, as FSDP2's);
    lookups return ``compute_dtype`` (the dtype FSDP2 would have gathered the table in), and the gradient is the mean
    over the mesh's ranks, as FSDP2 reduces every other one."""

    def __init__(self, embedding: nn.Embedding, mesh, compute_dtype: torch.dtype):
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        assert mesh.ndim == 1, "loom.parallel.vocab_embedding_rules keeps vocab to a 1-D shard mesh"
        assert embedding.padding_idx is None and embedding.max_norm is None, "a plain lookup table"
        assert not embedding.sparse and not embedding.scale_grad_by_freq, "a plain lookup table"
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        weight = distribute_tensor(embedding.weight.detach(), mesh, [Shard(0)], src_data_rank=None)
        self.weight = nn.Parameter(weight, requires_grad=embedding.weight.requires_grad)
        self.group, self.compute_dtype = mesh.get_group(), compute_dtype
        rows = torch.arange(self.num_embeddings).chunk(mesh.size())
        rank = mesh.get_local_rank()
        self.first_row = int(rows[rank][0]) if rank < len(rows) else self.num_embeddings

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = _VocabLookup.apply(
            tokens,
            self.weight.to_local(),
            self.first_row,
            self.group,
            self.compute_dtype,
            self.num_embeddings,
        )
        return out.view(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows split over {self.group.size()} ranks"


class _VocabLookup(torch.autograd.Function):
    """tokens (any shape, int) and this rank's rows (V_local, D) -> this rank's tokens' embeddings (N, D)."""

    @staticmethod
    def forward(ctx, tokens, rows, first_row, group, dtype, vocab):
        world = group.size()
        ids = tokens.reshape(-1).contiguous()
        every = ids.new_empty(world * ids.numel())
        _all_gather(every, ids, group=group)
        # an id no rank holds would look up zeros silently: every rank fails on it, as one table's lookup would
        # (asynchronously on the GPU: no host sync)
        torch._assert_async(((every >= 0) & (every < vocab)).all(), "token id outside the embedding's rows")
        local = every - first_row
        held = (local >= 0) & (local < rows.shape[0])
        if rows.shape[0]:
            mine = (
                F.embedding(torch.where(held, local, 0), rows).to(dtype).masked_fill_(~held.unsqueeze(1), 0)
            )
        else:  # fewer rows than ranks: this one holds none
            mine = rows.new_zeros(every.numel(), rows.shape[1], dtype=dtype)
        out = mine.new_empty(ids.numel(), rows.shape[1])
        _reduce_scatter(out, mine, op=dist.ReduceOp.SUM, group=group)
        # backward sends the rows this rank does not hold to an extra row (padding: it takes nothing): no
        # data-dependent shapes, no host sync
        ctx.save_for_backward(torch.where(held, local, rows.shape[0]))
        ctx.n_rows, ctx.group, ctx.rows_dtype = rows.shape[0], group, rows.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None, None
        (local,) = ctx.saved_tensors
        group, n = ctx.group, ctx.n_rows
        grad = grad.contiguous()
        every = grad.new_empty(group.size() * grad.shape[0], grad.shape[1])
        _all_gather(every, grad, group=group)
        # summed in the master dtype, scaled to the mean over the ranks
        every = every.to(ctx.rows_dtype).mul_(1.0 / group.size())
        full = torch.ops.aten.embedding_dense_backward(every, local, n + 1, n, False)
        return None, full[:n], None, None, None, None
