"""Mixture of experts, plain single-device PyTorch: a router sends each token to ``top_k`` of ``n_experts``
SwiGLU experts and sums their outputs weighted by the router's (renormalized) probabilities.

Dropless: every token reaches every expert it picks (no capacity factor, no token dropping), so the output
of a token depends only on that token, whatever the batch, the micro-batch split or the data-parallel
layout.

Load balancing: the sequence-wise auxiliary loss of DeepSeek-V3, per sequence
``sum_i f_i P_i`` with ``f_i = n_experts / (top_k S) x (tokens of the sequence routed to i)`` and ``P_i`` the mean
router probability of expert i over the sequence, summed over sequences. It is a sum over sequences, so
micro-batching and data parallelism do not change it. Its gradient enters through the backward
(``_AuxLossGrad``, as Megatron's MoEAuxLossAutoScaler does): the forward returns the block's output unchanged
and the logged language-model loss stays the language-model loss. ``set_aux_scale`` (called by the trainer
each step) sets the factor that makes the per-sequence sum that step's share of ``aux_loss x mean over the
global batch``.

Under context and sequence (tensor) parallelism each rank holds part of every sequence: the expert counts
``f`` are summed over those ranks (``sequence_shards``: one small all-reduce each, no gradient), and each rank
adds its own tokens' share of ``P``, so the ranks' terms add up to the whole sequence's loss and each rank's
router gets exactly its tokens' gradient. Under tensor parallelism the router and the experts are replicated
over the tp ranks, each running its own sequence shard's tokens (no all-gather; torchtitan's ``etp = 1``):
their gradients are Partial over tp and summed by DTensor (``local_weight``), as for sequence-parallel
norms. With expert tensor parallelism (``etp = tp``, ``expert_tp``) each tp rank holds a 1/tp slice of every
expert's hidden width instead: the block gathers the tp ranks' tokens and routing (rows in tp-rank order)
before the experts, every rank runs all of them through its slice, and the partial outputs are summed and
scattered back to each rank's rows (one all-gather and one reduce-scatter, whose backwards are each other;
``loom.parallel.expert_parallel.ExpertTensorParallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels.swiglu.op import swiglu


def local_weight(w: torch.Tensor, tokens_split: bool = False) -> torch.Tensor:
    """A parameter as a plain tensor for this rank's compute: a DTensor's local shard (experts under expert
    parallelism: this rank's experts). ``tokens_split``: the weight is replicated over ranks that each run
    different tokens (tensor parallelism's sequence slices), so its gradient is Partial there and DTensor sums
    it over those ranks."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(w, DTensor):  # (not hasattr: under torch.compile that missed DTensor parameters)
        return w
    if not tokens_split:
        return w.to_local()
    return w.to_local(grad_placements=[Partial() if isinstance(p, Replicate) else p for p in w.placements])


class Router(nn.Module):
    """Top-k over a softmax of the gate's scores (fp32), the k weights renormalized to sum to 1."""

    def __init__(self, dim: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.tokens_split = False  # set under tensor parallelism (see the module docstring)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, E) -> weights (T, k) fp32, experts (T, k) int64, probs (T, n) fp32."""
        probs = F.linear(x, local_weight(self.gate.weight, self.tokens_split)).float().softmax(dim=-1)  # (T, n)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (T, k)
        return weights / weights.sum(dim=-1, keepdim=True), experts, probs


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on ``x`` run in: autocast's when it is on, else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def grouped_mm_supported(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """PyTorch's grouped GEMM (``torch._grouped_mm``): bf16, on Hopper or newer GPUs or on the CPU."""
    if dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return x.device.type == "cpu" or (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0))


class Experts(nn.Module):
    """``n`` SwiGLU experts as stacked weights: w1, w3 (n, E, H) and w2 (n, H, E).

    Two ways to run them, the same math: one grouped GEMM per weight over all experts' tokens
    (``torch._grouped_mm``, bf16; no host sync, the group offsets stay on the device), or a loop over the
    experts with one matmul each (every dtype; the reference the grouped path is tested against).
    ``grouped``: None = grouped where supported."""

    def __init__(self, n: int, dim: int, hidden: int, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.grouped: bool | None = None
        self.tokens_split = False  # set under tensor parallelism (see the module docstring)
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (T', E): tokens grouped by expert, ``counts[i]`` (int64, (n,)) of them for expert i -> (T', E)."""
        dtype = compute_dtype(x)
        grouped = grouped_mm_supported(x, dtype) if self.grouped is None else self.grouped
        return self._grouped(x, counts, dtype) if grouped else self._loop(x, counts)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w1, w3, w2 of the experts this rank runs (all of them, or its share under expert parallelism)."""
        return tuple(local_weight(w, self.tokens_split) for w in (self.w1, self.w3, self.w2))

    def _gate(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return swiglu(a, b) if self.fused else F.silu(a) * b

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        offsets = counts.cumsum(0).to(torch.int32)  # (n,) end of each expert's rows
        x = x.to(dtype)
        w1, w3, w2 = (w.to(dtype) for w in self.local_weights())
        with torch.autocast(x.device.type, enabled=False):
            h = self._gate(torch._grouped_mm(x, w1, offs=offsets), torch._grouped_mm(x, w3, offs=offsets))  # (T', H)
            return torch._grouped_mm(h, w2, offs=offsets)  # (T', E)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # every expert runs, with no rows if no token picked it: the autograd graph is then the same on every
        # rank, so collectives issued from backward hooks (FSDP2, expert parallelism) come in the same order
        w1, w3, w2 = self.local_weights()
        outs = [self._gate(xi @ w1[i], xi @ w3[i]) @ w2[i] for i, xi in enumerate(x.split(counts.tolist()))]
        return torch.cat(outs)  # (T', E)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, ``aux`` receives gradient ``scale`` (so its graph, the router, gets
    scale x d aux / d params) without the loss value carrying it."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_dtype, ctx.aux_device = aux.dtype, aux.device
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device), None


def sequence_balance_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int,
                          sequence_shards: tuple = ()) -> torch.Tensor:
    """Sum over sequences of sum_i f_i P_i: probs (B, S, n) fp32, experts (B, S, k) -> fp32 scalar. With
    ``sequence_shards`` ((group, size) pairs: context, sequence parallelism), S is this rank's share of each
    sequence: the counts are the whole sequence's and the result this rank's share of the sum (see the module
    docstring)."""
    bsz, seq, k = experts.shape
    counts = torch.zeros(bsz, n_experts, device=probs.device).scatter_add_(
        1, experts.reshape(bsz, -1), torch.ones(bsz, seq * k, device=probs.device))  # (B, n)
    for group, size in sequence_shards:
        from torch.distributed import _functional_collectives as fc

        counts = fc.all_reduce(counts, "sum", group)
        seq = seq * size  # the whole sequence
    f = counts * (n_experts / (k * seq))  # (B, n), 1 everywhere when balanced
    return (f * probs.sum(dim=1) / seq).sum()  # P: (B, n), this rank's tokens' share


class MoE(nn.Module):
    """Routed SwiGLU experts in place of a block's feed-forward: (B, S, E) -> (B, S, E)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, aux_loss: float = 0.0,
                 fused: bool = False):
        super().__init__()
        self.n_experts, self.top_k, self.aux_loss = n_experts, top_k, aux_loss
        self.router = Router(dim, n_experts, top_k)
        self.experts = Experts(n_experts, dim, hidden, fused=fused)
        self.aux_scale = 1.0  # set_aux_scale: turns the per-sequence sum into this step's share of the loss
        self.balance_sum = None  # the balance loss summed over the sequences seen since take_balance (logging)
        # set by loom.parallel.expert_parallel.apply_expert_parallel: the experts then live on several ranks
        self.expert_parallel = None
        # (group, size) of the ranks splitting each sequence with this one: set by apply_context_parallel (cp)
        # and apply_tp (tp's sequence parallelism)
        self.sequence_shards: tuple = ()
        # set by loom.parallel.tensor_parallel.apply_tp when the experts are sharded over the tp ranks by hidden
        # width (parallel.etp): the tp group's gather / reduce-scatter (loom.parallel.expert_parallel)
        self.expert_tp = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.reshape(-1, dim)  # (T, E)
        weights, experts, probs = self.router(flat)  # (T, k), (T, k), (T, n)
        out = self._routed(flat, weights, experts) if self.expert_tp is None else self._routed_expert_tp(
            flat, weights, experts)
        out = out.view(bsz, seq, dim)
        record = _records_balance()
        if self.training and torch.is_grad_enabled() and (self.aux_loss > 0 or record):
            aux = sequence_balance_loss(probs.view(bsz, seq, -1), experts.view(bsz, seq, -1), self.n_experts,
                                        self.sequence_shards)
            if record:
                seen = aux.detach()
                self.balance_sum = seen if self.balance_sum is None else self.balance_sum + seen
            if self.aux_loss > 0:
                out = _AuxLossGrad.apply(out, aux, self.aux_loss * self.aux_scale)
        return out


    def _routed(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """flat (T, E), the router's weights and experts (T, k) -> (T, E): the weighted sum of each token's
        experts' outputs."""
        order = experts.flatten().argsort(stable=True)  # (T k,) token-slots grouped by expert
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, experts.flatten(), torch.ones_like(experts.flatten()))  # (n,) tokens per expert; static shape
        slots_in = flat[order // self.top_k]  # (T k, E) grouped by expert
        ep = self.expert_parallel
        routed = ep.run(self.experts, slots_in, counts) if ep is not None else self.experts(slots_in, counts)
        slots = torch.empty_like(routed).index_copy_(0, order, routed)  # (T k, E) back in token order
        return (slots.view(-1, self.top_k, flat.shape[1]) * weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1)

    def _routed_expert_tp(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``_routed`` with the experts sharded over the tp ranks by hidden width: the tp group's rows gathered
        (tp T, ...), each rank's output a partial sum over its width slice, summed and scattered back to (T, E)."""
        etp = self.expert_tp
        flat_all = etp.gather(flat)  # (tp T, E); backward: reduce-scatter
        weights_all = etp.gather(weights)  # (tp T, k)
        experts_all = etp.gather(experts)  # (tp T, k), integer: no gradient
        partial = self._routed(flat_all, weights_all, experts_all)  # (tp T, E), this rank's width slice
        return etp.reduce_scatter(partial)  # (T, E); backward: all-gather


def _records_balance() -> bool:
    """Record the balance for logging in a first eager forward only: not when activation checkpointing reruns
    the forward inside the backward (it would count twice), not under torch.compile (a traced forward must not
    change module state; compiled runs do not report it)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() == -1


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """Every MoE block of ``model`` weighs its per-sequence balance loss by ``aux_loss x scale`` this step."""
    for m in moe_modules(model):
        m.aux_scale = scale


def take_balance(model: nn.Module) -> torch.Tensor | None:
    """The balance loss summed over every MoE block of ``model`` and the sequences since the last call (then
    reset); None without MoE blocks or before a training forward. 1 per block and sequence = balanced."""
    sums = [m.balance_sum for m in moe_modules(model) if m.balance_sum is not None]
    for m in moe_modules(model):
        m.balance_sum = None
    return torch.stack(sums).sum() if sums else None
