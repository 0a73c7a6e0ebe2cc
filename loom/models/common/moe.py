"""Mixture of experts as plain single-device PyTorch: a router sends each token to ``top_k`` of ``n_experts``
SwiGLU experts, dropless; parallel layouts plug in through one object per block, ``MoE.parallel``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels.swiglu import reference as swiglu_reference
from loom.kernels.swiglu.op import swiglu

LocalWeight = Callable[[torch.Tensor], torch.Tensor]  # a parameter -> the tensor this rank computes with


class Router(nn.Module):
    """Top-k routing over the gate's scores (fp32): a softmax over the experts (Mixtral, Qwen3-MoE, DeepSeek-V2) or a
    sigmoid per expert (DeepSeek-V3). ``groups`` > 1: the experts form that many groups and each token picks among
    the ``topk_groups`` best groups only (a group's score: its best two sigmoid scores summed, or its best softmax
    score; DeepSeek's group-limited routing). ``bias``: a per-expert bias added to the scores for the choice only,
    never to the weights (DeepSeek-V3's aux-loss-free balancing; ``expert_bias``, a persistent buffer updated by
    ``update_expert_bias``). The k weights are renormalized to sum to 1 (``norm_topk``), then scaled by ``scale``."""

    def __init__(
        self,
        dim: int,
        n_experts: int,
        top_k: int,
        score: str = "softmax",
        norm_topk: bool = True,
        scale: float = 1.0,
        groups: int = 1,
        topk_groups: int = 1,
        bias: bool = False,
    ):
        super().__init__()
        assert score in ("softmax", "sigmoid") and n_experts % groups == 0 and topk_groups <= groups, (
            score,
            n_experts,
            groups,
            topk_groups,
        )
        self.top_k, self.score, self.norm_topk, self.scale = top_k, score, norm_topk, scale
        self.groups, self.topk_groups = groups, topk_groups
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(n_experts) if bias else None)

    @torch.no_grad()
    def reset_state(self) -> None:
        """The selection bias at zero (a model materialized from the meta device: loom.models.common.init)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(
        self, x: torch.Tensor, local: LocalWeight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, E) -> weights (T, k) fp32, experts (T, k) int64, probs (T, n) fp32 (each token's distribution over
        the experts, for the balance loss: the softmax, or the sigmoid scores normalized). ``local``: the gate's
        weight as this rank computes with it (``MoE.parallel.local``); None: the weight itself."""
        weight = self.gate.weight if local is None else local(self.gate.weight)
        logits = F.linear(x, weight).float()  # (T, n)
        scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if self.groups > 1:
            grouped = choice.view(choice.shape[0], self.groups, -1)  # (T, G, n / G)
            # (T, G)
            best = grouped.topk(2, dim=-1)[0].sum(-1) if self.score == "sigmoid" else grouped.amax(-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_groups, dim=-1)[1], 1.0)  # (T, G)
            choice = choice.masked_fill(keep.repeat_interleave(grouped.shape[-1], dim=1) == 0, float("-inf"))
        experts = choice.topk(self.top_k, dim=-1)[1]  # (T, k)
        weights = scores.gather(1, experts)  # (T, k)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.score == "sigmoid" else scores
        return weights * self.scale if self.scale != 1.0 else weights, experts, probs


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
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, local: LocalWeight | None = None
    ) -> torch.Tensor:
        """x (T', E): tokens grouped by expert, ``counts[i]`` (int64, (n,)) of them for expert i -> (T', E). Rows
        past ``counts.sum()`` (expert parallelism's padding) belong to no expert: their outputs are unspecified
        (the grouped GEMM leaves them as it finds them, the loop gives zeros) and give the weights no gradient.
        ``local``: each weight as this rank computes with it (``MoE.parallel.local``: under expert parallelism
        its experts' share); None: the weights themselves. Applied here, inside the call: a data-parallel
        wrapper gathers the weights in the call's pre-hook."""
        dtype = compute_dtype(x)
        grouped = grouped_mm_supported(x, dtype) if self.grouped is None else self.grouped
        return self._grouped(x, counts, dtype, local) if grouped else self._loop(x, counts, local)

    def _weights(self, local: LocalWeight | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ws = (self.w1, self.w3, self.w2)
        return ws if local is None else tuple(local(w) for w in ws)

    def _gate(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return swiglu(a, b) if self.fused else swiglu_reference.swiglu(a, b)

    def _grouped(
        self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype, local: LocalWeight | None
    ) -> torch.Tensor:
        offsets = counts.cumsum(0).to(torch.int32)  # (n,) end of each expert's rows
        x = x.to(dtype)
        w1, w3, w2 = (w.to(dtype) for w in self._weights(local))
        with torch.autocast(x.device.type, enabled=False):
            h = self._gate(
                torch._grouped_mm(x, w1, offs=offsets), torch._grouped_mm(x, w3, offs=offsets)
            )  # (T', H)
            return torch._grouped_mm(h, w2, offs=offsets)  # (T', E)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor, local: LocalWeight | None) -> torch.Tensor:
        # every expert runs, with no rows if no token picked it: the autograd graph is then the same on every
        # rank, so collectives issued from backward hooks (FSDP2, expert parallelism) come in the same order
        # the counts are read on the host (a device sync; the grouped path reads none)
        w1, w3, w2 = self._weights(local)
        sizes = counts.tolist()
        # padding rows after every expert's (expert parallelism's padded exchange)
        rest = x.shape[0] - sum(sizes)
        outs = [
            self._gate(xi @ w1[i], xi @ w3[i]) @ w2[i] for i, xi in enumerate(x.split([*sizes, rest])[:-1])
        ]
        return torch.cat([*outs, outs[0].new_zeros(rest, outs[0].shape[-1])])  # (T', E)


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


def sequence_balance_loss(
    probs: torch.Tensor,
    experts: torch.Tensor,
    n_experts: int,
    whole_sequence: Callable | None = None,
    counted: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, summed over sequences (so micro-batching and data parallelism
    leave it unchanged): per sequence ``sum_i f_i P_i``, ``f_i = n_experts / (top_k S) x (tokens routed to i)``
    and ``P_i`` the mean router probability of expert i. probs (B, S, n) fp32, experts (B, S, k) -> fp32 scalar.

    ``counted`` (B, S) bool: the tokens it counts (S per sequence then their number); None: all. Rows padded to a
    common width count only their own tokens, so the padding (which may depend on the layout) leaves it unchanged.
    ``whole_sequence`` (``MoE.parallel.whole_sequence``): (counts (B, n), S) of this rank's tokens -> those of
    the whole sequences, where ranks split every sequence (context, sequence parallelism); the result is then
    this rank's tokens' share of the sum, and the ranks' shares add up to it."""
    bsz, seq, k = experts.shape
    weight = torch.ones(bsz, seq, device=probs.device) if counted is None else counted.float()  # (B, S)
    counts = torch.zeros(bsz, n_experts + 1, device=probs.device).scatter_add_(
        1, experts.reshape(bsz, -1), weight.repeat_interleave(k, dim=1)
    )  # (B, n + 1), column n: unused
    counts[:, n_experts] = weight.sum(dim=1)  # the counted tokens of each sequence, summed with the counts
    if whole_sequence is not None:
        counts, _ = whole_sequence(counts, seq)
    tokens = counts[:, n_experts:].clamp(min=1)  # (B, 1) S of each whole sequence
    f = counts[:, :n_experts] * n_experts / (k * tokens)  # (B, n), 1 everywhere when balanced
    return (
        f * (probs * weight.unsqueeze(-1)).sum(dim=1) / tokens
    ).sum()  # P: (B, n), this rank's tokens' share


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``order`` (int64, (N,)): ``x[order][inverse] == x``."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


class _Dispatch(torch.autograd.Function):
    """Tokens (T, E) -> their k slots each (T k, E) in ``order`` (grouped by expert), cast to the experts' dtype
    first (T rows rather than T k). The backward gathers each token's k slot gradients by ``inverse`` and sums them
    in fp32 at least; autograd's own backward of the indexing would scatter-add them (atomics, in no fixed order)."""

    @staticmethod
    def forward(ctx, flat, order, inverse, k: int, dtype: torch.dtype):
        ctx.save_for_backward(inverse)
        ctx.k, ctx.in_dtype = k, flat.dtype
        return flat.to(dtype)[order // k]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        acc = torch.promote_types(grad.dtype, torch.float32)
        summed = grad[inverse].view(-1, ctx.k, grad.shape[-1]).sum(1, dtype=acc)
        return summed.to(ctx.in_dtype), None, None, None, None


class _Permute(torch.autograd.Function):
    """Rows ``x[index]`` for a permutation ``index``; the backward is the gather ``grad[inverse]`` (autograd's own
    would scatter-add)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x[index]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


def dispatch(flat: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
    """flat (T, E) -> (T k, E): ``flat[order // k]`` in the experts' compute dtype, its gradient gathered, not
    scattered (``_Dispatch``)."""
    return _Dispatch.apply(flat, order, inverse, k, compute_dtype(flat))


def permute(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a permutation ``index`` with ``inverse`` its inverse, its gradient gathered (``_Permute``)."""
    return _Permute.apply(x, index, inverse)


class LocalExperts:
    """``MoE.parallel`` on one device and under plain data parallelism: every expert on this rank, whole
    sequences, the parameters as they are. loom.parallel installs its own (``loom.parallel.expert_parallel.
    MoEParallel``) under tensor, context and expert parallelism."""

    def local(self, w: torch.Tensor) -> torch.Tensor:
        """A parameter as the tensor this rank computes with."""
        return w

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Rows (T, ...) of this rank's tokens -> those of every rank that runs this block's experts with it."""
        return x

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' output for ``gather``'s rows -> this rank's rows (T, E), summed over those ranks."""
        return x

    def run(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``experts`` on token-slots x (T k, E) grouped by expert, ``counts`` (n,) per expert -> (T k, E)."""
        return experts(x, counts)

    def whole_sequence(self, counts: torch.Tensor, seq: int) -> tuple[torch.Tensor, int]:
        """Expert counts (B, n) of this rank's S tokens of each sequence -> the whole sequences' (see
        ``sequence_balance_loss``)."""
        return counts, seq

    def local_tokens(self, mask: torch.Tensor) -> torch.Tensor:
        """A per-token tensor (B, S, ...) of the model's input sequences -> this rank's tokens of them."""
        return mask


LOCAL_EXPERTS = LocalExperts()  # stateless: shared by every block until loom.parallel replaces it


class MoE(nn.Module):
    """Routed SwiGLU experts in place of a block's feed-forward: (B, S, E) -> (B, S, E).

    Dropless: every token reaches every expert it picks (no capacity factor), so a token's output depends
    only on that token, whatever the batch, micro-batch split or layout. The balance loss
    (``sequence_balance_loss``) enters through the backward only (``_AuxLossGrad``, as Megatron's
    MoEAuxLossAutoScaler): the output, and so the logged loss, is unchanged, and ``set_aux_scale`` (the trainer,
    every step) makes the per-sequence sum that step's share of ``aux_loss x mean over the global batch``.

    ``shared`` > 0: that many experts' width of a SwiGLU every token goes through besides its routed ones
    (DeepSeekMoE's shared experts, ``shared_experts``: one feed-forward ``shared`` x ``hidden`` wide, as DeepSeek
    stores it). ``routing``: the ``Router``'s keyword arguments (scores, groups, the selection bias). With the
    selection bias, a training forward adds the tokens each expert received to ``load`` (the bias update's input:
    ``update_expert_bias``).

    ``parallel``, the block's one extension point: where its experts' weights, tokens and sequences are
    (``LocalExperts``; loom.parallel installs ``loom.parallel.expert_parallel.MoEParallel``)."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        n_experts: int,
        top_k: int,
        aux_loss: float = 0.0,
        fused: bool = False,
        shared: int = 0,
        **routing,
    ):
        super().__init__()
        self.n_experts, self.top_k, self.aux_loss = n_experts, top_k, aux_loss
        self.router = Router(dim, n_experts, top_k, **routing)
        self.experts = Experts(n_experts, dim, hidden, fused=fused)
        self.shared_experts = None
        if shared:
            from loom.models.common.layers import FeedForward

            self.shared_experts = FeedForward(dim, shared * hidden, fused=fused)
        self.load = (
            None  # (n,) fp32 tokens per expert since the last bias update (with the selection bias only)
        )
        self.aux_scale = 1.0  # set_aux_scale: turns the per-sequence sum into this step's share of the loss
        self.balance_sum = (
            None  # the balance loss summed over the sequences seen since take_balance (logging)
        )
        self.counted = None  # count_tokens: (B, S) bool, the tokens the balance loss counts (None: all)
        # with the selection bias, training forwards add to ``load`` (compiled blocks: loom.parallel.compile decides)
        self.count_loads = True
        # ... or, in a block compiled whole around its checkpoint, to ``graph_load`` inside the graph (an in-place
        # add the compiled recomputation does not repeat; int64, which no dtype cast of the model touches)
        self.count_in_graph = False
        self.register_buffer(
            "graph_load",
            torch.zeros(n_experts, dtype=torch.long) if routing.get("bias") else None,
            persistent=False,
        )
        self.parallel = LOCAL_EXPERTS

    @torch.no_grad()
    def reset_state(self) -> None:
        """No tokens counted in the graph yet (a model materialized from the meta device: loom.models.common.init)."""
        if self.graph_load is not None:
            self.graph_load.zero_()

    def take_load(self) -> torch.Tensor | None:
        """The tokens each expert received since the last call (then reset): ``load``, or ``graph_load`` where the
        compiled block counts; None where nothing was counted eagerly."""
        load, self.load = self.load, None
        if self.count_in_graph and self.graph_load is not None:
            load = self.graph_load.float()
            self.graph_load.zero_()
        return load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        par = self.parallel
        flat = x.reshape(-1, dim)  # (T, E)
        weights, experts, probs = self.router(flat, par.local)  # (T, k), (T, k), (T, n)
        out = par.reduce_scatter(self._routed(par.gather(flat), par.gather(weights), par.gather(experts)))
        out = out.view(bsz, seq, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        record = _records_balance()
        if self.router.expert_bias is not None and self.training and self.count_loads:
            if self.count_in_graph:
                with torch.no_grad():
                    flat_experts = experts.flatten()
                    self.graph_load.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
            else:
                _count_load(self, experts)
        if self.training and torch.is_grad_enabled() and (self.aux_loss > 0 or record):
            counted = None if self.counted is None else par.local_tokens(self.counted)  # (B, S)
            assert counted is None or counted.shape == (bsz, seq), "count_tokens: set the mask of each batch"
            # only logged (aux_loss 0): out of autograd, so activation checkpointing's recomputation (which does
            # not record) saves the same tensors as the forward did
            with contextlib.nullcontext() if self.aux_loss > 0 else torch.no_grad():
                aux = sequence_balance_loss(
                    probs.view(bsz, seq, -1),
                    experts.view(bsz, seq, -1),
                    self.n_experts,
                    par.whole_sequence,
                    counted,
                )
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
        inverse = inverse_permutation(order)
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, experts.flatten(), torch.ones_like(experts.flatten())
        )  # (n,) tokens per expert; static shape
        slots_in = dispatch(flat, order, inverse, self.top_k)  # (T k, E) grouped by expert
        routed = self.parallel.run(self.experts, slots_in, counts)
        slots = permute(routed, inverse, order)  # (T k, E) back in token order
        return (slots.view(-1, self.top_k, flat.shape[1]) * weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1)


@torch.compiler.disable  # module state, counted eagerly: a compiled block breaks its graph here (apply_compile)
def _count_load(moe: MoE, experts: torch.Tensor) -> None:
    """Add the tokens each expert received, experts (T, k), to ``moe.load`` (the bias update's input); not when
    activation checkpointing reruns the forward inside the backward (it would count twice)."""
    if torch._C._current_graph_task_id() != -1:
        return
    counts = torch.zeros(moe.n_experts, device=experts.device).scatter_add_(
        0, experts.flatten(), torch.ones(experts.numel(), device=experts.device)
    )  # (n,) this rank's tokens
    moe.load = counts if moe.load is None else moe.load + counts


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


def count_tokens(model: nn.Module, mask: torch.Tensor | None) -> None:
    """From now on ``model``'s MoE blocks count only the tokens ``mask`` (B, S) bool marks (of the model's input)
    in their balance loss: rows right-padded to a common width, whose padding is no token of theirs
    (``sequence_balance_loss``); None: every token. Set before each forward it applies to; it stays set through
    the backward, where activation checkpointing reruns the forward."""
    for m in moe_modules(model):
        m.counted = mask


def forget_routing(model: nn.Module) -> None:
    """Drop what ``model``'s MoE blocks counted since the last bias update and read (loads, balance): a forward
    that was no training step's (a pipeline's shape inference on placeholder inputs)."""
    for m in moe_modules(model):
        m.take_load()
        m.balance_sum = None


def take_balance(model: nn.Module) -> torch.Tensor | None:
    """The balance loss summed over every MoE block of ``model`` and the sequences since the last call (then
    reset); None without MoE blocks or before a training forward. 1 per block and sequence = balanced."""
    sums = [m.balance_sum for m in moe_modules(model) if m.balance_sum is not None]
    for m in moe_modules(model):
        m.balance_sum = None
    return torch.stack(sums).sum() if sums else None


@torch.no_grad()
def update_expert_bias(
    blocks: dict[str, MoE],
    names: list[str],
    n_experts: int,
    speed: float,
    device,
    applies: torch.Tensor | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing, after an optimizer step: each expert's selection bias moves by
    ``speed`` towards balance, up where the expert received fewer tokens than its block's mean, down where more
    (the sign of the load error only). ``names``: every MoE block of the whole model, in one order on every rank
    (a pipeline stage holds some of them, maybe none: ``blocks``, by name); ``reduce`` sums the (blocks, n) loads
    over every rank, so the bias moves alike everywhere, whatever the layout (a token counted on several ranks
    counts alike for every expert of its block: the sign is unchanged). ``applies``: the step's verdict (a 0-dim
    bool tensor; a skipped step moves nothing). Returns the loads (blocks, n) and resets the blocks' counts."""
    load = torch.zeros(len(names), n_experts, device=device)
    for i, name in enumerate(names):
        block = blocks.get(name)
        taken = None if block is None else block.take_load()
        if taken is not None:
            load[i] = taken.to(device)
    if reduce is not None:
        load = reduce(load)
    step = speed * torch.sign(load.mean(dim=1, keepdim=True) - load)  # (blocks, n)
    if applies is not None:
        step = step * applies.to(device=device, dtype=step.dtype)
    for i, name in enumerate(names):
        block = blocks.get(name)
        if block is not None and block.router.expert_bias is not None:
            block.router.expert_bias.add_(step[i].to(block.router.expert_bias.device))
    return load
