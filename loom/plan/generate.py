"""Generation (``loom plan --generate``): memory per GPU and time per token of sampling ``batch`` sequences of
``prompt_len`` + ``output_len`` tokens from a model with a KV cache, tensor-parallel over the GPUs.

- memory: the weights (one tp rank's share, from the shape), the KV cache preallocated for every token of every
  sequence (``kv_cache_bytes``: only what the attention kind caches), a prefill's activations (one block's
  forward traced on fake tensors, as for training) and the allocator's workspace (loom.plan.memory);
- time to first token: the prefill, compute-bound (forward FLOPs at the planner's matmul and attention
  efficiencies) unless reading the weights once takes longer;
- a decode step (one token per sequence): the bytes it reads (the weights a token goes through, the cache of every
  sequence up to its position) at the measured share of the HBM bandwidth (``decode_hbm_share``), or its FLOPs
  where a large batch makes those longer, plus the tensor-parallel collectives (exposed: a step has nothing to hide them behind).

Not modelled: speculative decoding, a paged cache (its fragmentation and block tables), continuous batching
(every sequence starts together and runs to ``output_len``), sampling's own time, kernel launch gaps (decode is
assumed captured as a CUDA graph), CUDA graphs' memory pools, chunked prefill. docs/planner.md, "Generation".
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

from loom.config.errors import ConfigError
from loom.config.sections import Config, ParallelConfig
from loom.plan.hardware import GPU, gpu_named
from loom.plan.memory import BYTES, FRAGMENTATION, GIB, MARGIN, WORKSPACE_BYTES, ByteParts
from loom.plan.shapes import attention_params, expert_params, ffn_params, layer_params, rank_shares
from loom.plan.timing import (
    COLLECTIVE_LATENCY_S,
    DECODE_HBM_SHARE_BATCHED,
    attention_efficiency,
    attention_flops,
    collective_s,
    decode_hbm_share,
    efficiency,
)


# ---------------------------------------------------------------------------------------------- the KV cache
@dataclass(frozen=True)
class CacheShape:
    """What one attention layer caches per token of a sequence, for the whole model's heads."""

    kind: str
    elements: int  # cached elements per token and layer
    tp_sharded: (
        bool  # tensor parallelism splits them (whole heads per rank), else every tp rank holds them all
    )
    flops_per_key: int  # a decode step's attention FLOPs per query token, cached key and layer (all heads)


def gqa_cache(args) -> CacheShape:
    """Grouped-query (and multi-head, multi-query) attention: K and V of each KV head; tp ranks own whole KV heads
    (loom.parallel.tensor_parallel); a query head scores and sums head_dim elements per key."""
    return CacheShape("gqa", 2 * args.n_kv_heads * args.head_dim, True, 4 * args.n_heads * args.head_dim)


def mla_cache(args) -> CacheShape:
    """Multi-head latent attention (DeepSeek-V2/V3): the compressed latent and the decoupled RoPE key, shared by
    every head (so each tp rank holds all of it); decode with absorbed projections scores each head against
    latent + RoPE key and sums the latent."""
    r, rope = args.kv_lora_rank, args.qk_rope_head_dim
    return CacheShape("mla", r + rope, False, 2 * args.n_heads * (2 * r + rope))


CACHE_SHAPES: dict[str, Callable] = {"gqa": gqa_cache, "mla": mla_cache}


def attention_kind(args) -> str:
    """Which ``CACHE_SHAPES`` entry a model uses: ``LlamaArgs.attention_kind`` ("gqa" or "mla"); for args without
    that field, MLA where they give a latent rank (DeepSeek's config names)."""
    return getattr(args, "attention_kind", "mla" if getattr(args, "kv_lora_rank", 0) else "gqa")


def cache_shape(args) -> CacheShape:
    return CACHE_SHAPES[attention_kind(args)](args)


def kv_cache_bytes(args, batch: int, tokens: int, kv_dtype: str = "bfloat16", tp: int = 1) -> float:
    """Bytes of the KV cache one tp rank holds for ``batch`` sequences of ``tokens`` positions."""
    shape = cache_shape(args)
    per_token = args.n_layers * shape.elements * BYTES[kv_dtype]
    return batch * tokens * per_token / (tp if shape.tp_sharded else 1)


# ---------------------------------------------------------------------------------------------- one decode step
def weight_bytes(args, tp: int, dtype: str) -> float:
    """The weights one tp rank holds (MoE experts replicated over tp, as loom's TP plan does)."""
    return rank_shares(args, 1, ParallelConfig(), args.max_seq_len)[0].params(tp) * BYTES[dtype]


def decode_params_read(args, batch: int, tp: int) -> float:
    """Parameters one tp rank reads in a decode step of ``batch`` tokens: every block weight (a MoE block: the
    router and the experts its tokens are routed to, expected under uniform routing), the final norm, the head, and
    the looked-up embedding rows only (an untied table is not streamed; a tied one is, as the head)."""
    sharded, replicated = layer_params(args)
    if args.moe:
        e, k = args.moe_experts, args.moe_top_k
        touched = e * (1 - (1 - k / e) ** batch)  # experts at least one of the batch's tokens goes to
        replicated += touched * expert_params(args) - e * expert_params(args)
    rows = 0 if args.tie_embeddings else batch * args.dim
    return args.n_layers * (sharded / tp + replicated) + args.dim + args.vocab_size * args.dim / tp + rows


def matmul_params_per_token(args, tp: int) -> float:
    """Matmul weights one token goes through on one tp rank (a MoE block: the router and its top_k experts)."""
    block = attention_params(args) + ffn_params(args, active=True)
    return (args.n_layers * block + args.vocab_size * args.dim) / tp


def all_reduce_s(nbytes: float, ranks: int, gbps: float) -> float:
    """A small ring all-reduce (a reduce-scatter then an all-gather) with its fixed latency."""
    return 0.0 if ranks <= 1 else COLLECTIVE_LATENCY_S + 2 * collective_s(nbytes, ranks, gbps)


def all_gather_s(nbytes: float, ranks: int, gbps: float) -> float:
    return 0.0 if ranks <= 1 else COLLECTIVE_LATENCY_S + collective_s(nbytes, ranks, gbps)


def tp_bandwidth(gpu: GPU, tp: int) -> float:
    return gpu.link_gbps if tp <= gpu.gpus_per_node else gpu.network_gbps


@dataclass(frozen=True)
class DecodeStep:
    """One decode step (a token for each of ``batch`` sequences whose cache holds ``context`` positions)."""

    context: int
    weight_bytes: float  # weights read
    kv_bytes: float  # cache read (every sequence's ``context`` positions, or its sliding window) and written
    flops: float
    memory_s: float  # the bytes at the achievable HBM rate
    compute_s: float
    tp_s: float  # the step's tensor-parallel all-reduces and the logits' all-gather
    roofline_s: float  # the bytes at the raw datasheet bandwidth

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.tp_s


def _gpu(gpu: GPU | str) -> GPU:
    return gpu_named(gpu) if isinstance(gpu, str) else gpu


def decode_step(
    args,
    batch: int,
    context_len: int,
    gpu: GPU | str,
    tp: int = 1,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    hbm_share: float | None = None,
) -> DecodeStep:
    """A decode step of ``batch`` sequences, each with ``context_len`` cached positions (the new token's included),
    on one of ``tp`` GPUs of kind ``gpu`` (a ``loom.plan.hardware.GPUS`` entry or its name); ``hbm_share`` None: the
    measured share at that batch (``loom.plan.timing.decode_hbm_share``)."""
    gpu = _gpu(gpu)
    hbm_share = decode_hbm_share(batch) if hbm_share is None else hbm_share
    kv_dtype = kv_dtype or dtype
    shape = cache_shape(args)
    keys = min(context_len, args.sliding_window) if args.sliding_window else context_len
    weights = decode_params_read(args, batch, tp) * BYTES[dtype]
    kv = kv_cache_bytes(args, batch, keys + 1, kv_dtype, tp)  # read every key, write the new token's
    heads = shape.flops_per_key * args.n_layers * keys / tp  # per sequence
    flops = batch * (2 * matmul_params_per_token(args, tp) + heads)
    compute = flops / (gpu.peak(dtype) * efficiency(args.dim, compiled=True))
    hbm = gpu.hbm_tbps * 1e12
    comm = 0.0
    # per block: attention's and the MLP's row-parallel outputs; the embedding's; the logits gathered
    if tp > 1:
        bw, act = tp_bandwidth(gpu, tp), batch * args.dim * BYTES[dtype]
        comm = (2 * args.n_layers + 1) * all_reduce_s(act, tp, bw) + all_gather_s(
            batch * args.vocab_size * BYTES[dtype], tp, bw
        )
    return DecodeStep(
        context_len,
        weights,
        kv,
        flops,
        (weights + kv) / (hbm_share * hbm),
        compute,
        comm,
        (weights + kv) / hbm,
    )


def decode_time_per_token(
    args,
    batch: int,
    context_len: int,
    gpu: GPU | str,
    tp: int = 1,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    hbm_share: float | None = None,
) -> float:
    """Planned seconds of one decode step at ``context_len`` cached positions: each of the ``batch`` sequences gets
    a token (``decode_step``; ``hbm_share=1`` gives the HBM roofline). For a benchmark's planned-vs-measured line."""
    return decode_step(args, batch, context_len, gpu, tp, dtype, kv_dtype, hbm_share).seconds


def decode_seconds(step: Callable[[int], DecodeStep], first: int, last: int) -> float:
    """Sum of ``step(c).seconds`` for c = first..last. Bytes and FLOPs grow linearly with the context, so the time is
    the larger of two affine functions: summed exactly per side of where they cross (found by bisection)."""
    if last < first:
        return 0.0

    def run(a: int, b: int) -> float:
        return (b - a + 1) * (step(a).seconds + step(b).seconds) / 2

    if step(first).bound == step(last).bound:
        return run(first, last)
    lo, hi = first, last  # step(lo) has the first bound, step(hi) the other
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if step(mid).bound == step(first).bound else (lo, mid)
    return run(first, lo) + run(hi, last)


# ---------------------------------------------------------------------------------------------- prefill
@dataclass(frozen=True)
class Prefill:
    flops: float
    compute_s: float
    memory_s: float  # reading the weights once and writing the cache
    tp_s: float

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.tp_s


def prefill(
    args, batch: int, prompt_len: int, gpu: GPU, tp: int, dtype: str, kv_dtype: str, compiled: bool
) -> Prefill:
    """The prompts' forward (the head on each sequence's last position only), all ``batch`` at once: matmuls at
    ``efficiency(dim)`` and causal attention's forward at the attention kernel's rate (loom.plan.timing)."""
    tokens = batch * prompt_len
    block = attention_params(args) + ffn_params(args, active=True)
    matmul = 2 * tokens * args.n_layers * block / tp + 2 * batch * args.vocab_size * args.dim / tp
    width = (
        args.head_dim + getattr(args, "value_head_dim", args.head_dim)
    ) / 2  # MLA: values narrower than keys
    attention = (
        attention_flops(args.n_layers, args.n_heads, width, prompt_len, tokens, args.sliding_window)
        / 3.5
        / tp
    )  # the forward's share of forward + backward
    peak = gpu.peak(dtype)
    compute = matmul / (peak * efficiency(args.dim, compiled)) + attention / (
        peak * attention_efficiency(args.head_dim, prompt_len)
    )
    read = weight_bytes(args, tp, dtype) + kv_cache_bytes(args, batch, prompt_len, kv_dtype, tp)
    comm = 0.0
    # per block two all-reduces of the activations (or sequence parallelism's gathers and scatters)
    if tp > 1:
        comm = 2 * args.n_layers * all_reduce_s(tokens * args.dim * BYTES[dtype], tp, tp_bandwidth(gpu, tp))
    return Prefill(matmul + attention, compute, read / (DECODE_HBM_SHARE_BATCHED * gpu.hbm_tbps * 1e12), comm)


def prefill_activations(args, batch: int, prompt_len: int, tp: int, dtype: str) -> float:
    """Peak bytes of the prefill's transient tensors on one tp rank: one block's forward (traced), split over tp but
    for its all-gathered input, and the last positions' logits (all-gathered; plus an fp32 copy for sampling)."""
    from loom.plan.activations import forward_peak

    # no Flex on fake CPU tensors
    traced = args.with_(attention="flash") if args.attention == "flex" else args
    block = forward_peak(traced, batch, prompt_len, dtype)
    gathered = batch * prompt_len * args.dim * BYTES[dtype] * (1 - 1 / tp)
    return block / tp + gathered + batch * args.vocab_size * (BYTES[dtype] + 4)


# ---------------------------------------------------------------------------------------------- the plan
@dataclass
class GenerationMemory(ByteParts):
    """Bytes on each tp rank at the prefill's peak (the decode steps' own tensors are a few per sequence)."""

    weights: float = 0.0
    kv_cache: float = 0.0
    activations: float = 0.0
    workspace: float = 0.0


@dataclass
class GenerationPlan:
    batch: int
    prompt_len: int
    output_len: int
    tp: int
    dtype: str
    kv_dtype: str
    attention: str  # the CACHE_SHAPES kind
    kv_bytes_per_token: float  # per sequence, whole model (before tp)
    memory: GenerationMemory
    capacity_gib: float
    margin_gib: float
    max_batch: int  # the largest batch that fits at this length
    prefill: Prefill
    first: DecodeStep  # the step that makes the second output token
    last: DecodeStep  # the step that makes the last
    decode_s: float  # every decode step (output_len - 1 of them)
    notes: list[str] = field(default_factory=list)

    @property
    def limit_gib(self) -> float:
        return self.capacity_gib - self.margin_gib

    @property
    def fits(self) -> bool:
        return self.memory.total / GIB <= self.limit_gib

    @property
    def steps(self) -> int:
        return self.output_len - 1

    @property
    def mean_step_s(self) -> float:
        """Mean seconds per decode step (the first's where there is none)."""
        return self.decode_s / self.steps if self.steps else self.first.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second over the batch while decoding."""
        return self.batch / self.mean_step_s

    @property
    def total_s(self) -> float:
        """The whole request: prefill, then every decode step."""
        return self.prefill.seconds + self.decode_s


def plan_generation(
    args,
    batch: int,
    prompt_len: int,
    output_len: int,
    gpu: GPU | str,
    tp: int = 1,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    compiled: bool = False,
    margin_gib: float | None = None,
) -> GenerationPlan:
    """Memory and time of generating ``output_len`` tokens after ``prompt_len`` for each of ``batch`` sequences on
    ``tp`` GPUs (tensor-parallel) of kind ``gpu``. ``args``: a resolved LlamaArgs (vocabulary set; ``generation_args``
    resolves a config's); ``compiled``: the prefill's matmul efficiency (compiled or eager); ``margin_gib``: memory a
    fitting plan leaves free (default loom.plan.memory.MARGIN of the GPU's)."""

    gpu = _gpu(gpu)
    kv_dtype = kv_dtype or dtype
    tokens = prompt_len + output_len
    memory = GenerationMemory(
        weights=weight_bytes(args, tp, dtype),
        kv_cache=kv_cache_bytes(args, batch, tokens, kv_dtype, tp),
        activations=prefill_activations(args, batch, prompt_len, tp, dtype),
    )
    memory.workspace = WORKSPACE_BYTES + FRAGMENTATION * memory.total
    margin = MARGIN * gpu.memory_gib if margin_gib is None else margin_gib
    per_seq = (memory.kv_cache + memory.activations) / batch  # both grow in proportion to the batch
    room = ((gpu.memory_gib - margin) * GIB - WORKSPACE_BYTES) / (1 + FRAGMENTATION) - memory.weights
    max_batch = max(0, int(room // per_seq))

    def step(context: int) -> DecodeStep:
        return decode_step(args, batch, context, gpu, tp, dtype, kv_dtype)

    # the prefill makes the first output token; step j (1 .. output_len - 1) reads prompt_len + j positions
    first, last = step(prompt_len + 1), step(prompt_len + max(1, output_len - 1))
    notes = []
    if args.sliding_window:
        notes.append(
            f"sliding window {args.sliding_window}: a step reads at most that many cached positions; the "
            "cache is still preallocated for every position"
        )
    return GenerationPlan(
        batch,
        prompt_len,
        output_len,
        tp,
        dtype,
        kv_dtype,
        attention_kind(args),
        kv_cache_bytes(args, 1, 1, kv_dtype),
        memory,
        gpu.memory_gib,
        margin,
        max_batch,
        prefill(args, batch, prompt_len, gpu, tp, dtype, kv_dtype, compiled),
        first,
        last,
        decode_seconds(step, prompt_len + 1, prompt_len + output_len - 1),
        notes,
    )


def generation_args(cfg: Config, tp: int, dtype: str, tokens: int):
    """The config's model as a CUDA run would build it for sequences of ``tokens`` positions, checked against tensor
    parallelism over ``tp`` GPUs (the trainer's rules: tp divides the heads, KV heads, feed-forward width and
    vocabulary). Generation uses every GPU for one tensor-parallel replica: the config's parallel section and
    training.seq_len are not used."""
    from loom.data import build_tokenizer
    from loom.parallel.dims import ParallelDims
    from loom.resolve import check_model, model_kernels, resolve_model_args

    cfg = copy.deepcopy(cfg)
    cfg.parallel = ParallelConfig(tp=tp, dp_shard=1)
    cfg.training.seq_len = tokens  # the model's max_seq_len (its RoPE table)
    args = resolve_model_args(
        cfg, build_tokenizer(cfg.data.tokenizer), model_kernels(cfg, "cuda", triton=True)
    )
    try:
        check_model(ParallelDims.from_config(cfg.parallel, tp), args, cfg.parallel)
    except ConfigError as err:
        if err.field == "parallel.tp":  # the user said --gpus, not parallel.tp
            raise ConfigError("--gpus", tp, err.allowed) from None
        raise
    return args
