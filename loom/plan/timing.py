"""Step time of one rank under a layout: compute at a fitted fraction of the GPU's peak, the optimizer at
HBM speed, communication at the link's bus bandwidth (hidden behind compute where the implementation
overlaps it), and the pipeline's bubble from the schedule's own replay.

- compute: the blocks' and head's matmul FLOPs plus what activation checkpointing recomputes, at
  ``efficiency(dim)`` x peak (fitted to measured loom runs: docs/planner.md); causal attention (its
  FLOPs, half the non-causal count MFU uses) at the attention kernel's measured rate
  (``attention_efficiency``: cuDNN SDPA's, scaled by the run's backend's measured speed, ``attention_speed``);
- optimizer: loom's AdamW reads and writes 28 bytes per parameter a rank owns, and the gradient norm every step
  reads its gradient once more (``GRAD_NORM_BYTES``), at ``ADAMW_HBM_SHARE`` of the HBM bandwidth (measured:
  docs/planner.md);
- FSDP2 all-gathers (forward, and backward when resharding) and reduce-scatters every micro-batch,
  overlapped with compute: exposed is what exceeds the compute, plus the first gather and the last
  reduction; HSDP adds an all-reduce over the replicas the same way; DDP all-reduces once per step during
  the last backward;
- tensor parallelism: 4 all-gathers / reduce-scatters of the sequence-parallel activations per block in
  forward and 4 in backward (4 more when the block is recomputed), exposed; context parallelism: an
  all-gather of K and V per block in forward, a reduce-scatter of their gradients in backward, exposed (ring:
  loom.plan.planner.ring_exposed_s);
  expert parallelism: each MoE block sends its routed token-slots to the experts' ranks and back, in forward and
  in backward (4 all-to-alls, costed like an all-gather of the slots; 2 more where full checkpointing reruns the
  block: op-level checkpointing saves the exchanges and replays them), exposed; MoE FLOPs count the router and the
  top_k experts a token goes through, assuming balanced routing;
- mixture of experts, beyond the active experts' matmuls: every expert weight is cast to bf16 each forward and
  its gradient cast back (``MOE_WEIGHT_CAST_BYTES`` per parameter of a rank's experts, 6 more when recomputed;
  under FSDP2 its copies instead: ``fsdp_expert_bytes``), and routing moves each token-slot (sort, gather,
  scatter back, casts, the weighting and the gate's elementwise work: ``MOE_SLOT_BYTES`` per slot and model-dim
  element), all at the copy rate ``COPY_HBM_SHARE``; under expert parallelism a rank also permutes the slots it
  receives to its experts and back (``EP_SLOT_ELEMENTS``; older code also rescaled its experts' gradients once a
  step, ``EP_GRAD_SCALE_BYTES``, which their FSDP2 reduction now does); ``op`` checkpointing recomputes the experts' grouped GEMMs (not ``aten.mm``:
  every one of them, as full checkpointing does; ``matmuls`` keeps them), and the grouped GEMMs compute their experts' part-filled row
  tiles (``grouped_padding_flops``). The casts and routing were fitted on one layer's forward + backward and one
  compiled run (docs/planner.md);
- expert parallelism's host waits: each MoE block reads its token counts on the host before its all-to-all, the
  GPU drains its queue there and then idles while the host launches what follows (and the all-to-all waits for the
  peer rank's host): ``EP_HOST_WAIT_S`` per wait, fitted to one run; other host time and uneven routing are not
  modelled; the padded exchange (parallel.ep_exchange) waits for nothing and moves ep times the bytes;
- float8 (dense blocks): the block linears' GEMMs at FLOAT8_GEMM_SPEEDUP x their bf16 time, plus the casts of
  each linear's input and output gradient (``float8_cast_width``) at the copy rate;
- pipeline: the step's compute stretched by 1 / (1 - bubble) (loom.parallel.pipeline.theoretical_bubble).
A collective over n ranks moving a tensor of B bytes takes B (n-1)/n / bandwidth (ring bus bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Fraction of peak FLOP/s reached on the model's FLOPs (recomputation included): larger hidden sizes make larger
# matmuls, so efficiency(dim) = top x dim / (dim + 650) (the fit and its runs: docs/planner.md, Time).
EFFICIENCY_TOP = {"compiled": 0.70, "eager": 0.51}
EFFICIENCY_HALF_DIM = 650.0


def efficiency(dim: int, compiled: bool) -> float:
    return EFFICIENCY_TOP["compiled" if compiled else "eager"] * dim / (dim + EFFICIENCY_HALF_DIM)


# Causal attention forward + backward (cuDNN SDPA, what loom's `auto` picks for plain causal attention without
# FlashAttention-4; the runs it is checked against ran `auto` or `sdpa` with cuDNN first, bench.peers' order; a plain
# `sdpa` elsewhere takes PyTorch's own order, which this does not model), as a
# fraction of the bf16 peak, by head dim at seq 2048 / 8192; log-linear in between, held outside (the run it comes
# from: docs/planner.md, Time).
ATTENTION_EFFICIENCY = {64: (0.30, 0.41), 128: (0.37, 0.53)}
ATTENTION_SEQS = (2048, 8192)


# Each backend's causal forward + backward throughput as a share of cuDNN SDPA's, by head dim (bench.kernels --suite
# quick --with fa4, one H200, seq 8192: kernels_quick_h200.md at d9eb110), held at other lengths and GPU kinds;
# a backend not named here runs at cuDNN's (``sdpa``: the runs the table above comes from)
ATTENTION_SPEED = {
    "fa4": {64: 491 / 423, 128: 579 / 514},
    "flash": {64: 389 / 423, 128: 468 / 514},
    "sdpa_flash": {64: 269 / 423, 128: 302 / 514},
}


def attention_speed(backend: str, head_dim: int) -> float:
    """``backend``'s forward + backward speed against cuDNN SDPA's at ``head_dim`` (the nearest measured)."""
    speeds = ATTENTION_SPEED.get(backend)
    return speeds[min(speeds, key=lambda d: abs(d - head_dim))] if speeds else 1.0


def attention_efficiency(head_dim: int, seq: int, backend: str = "sdpa") -> float:
    import math

    lo, hi = ATTENTION_EFFICIENCY[min(ATTENTION_EFFICIENCY, key=lambda d: abs(d - head_dim))]
    a, b = ATTENTION_SEQS
    f = min(max((math.log2(seq) - math.log2(a)) / (math.log2(b) - math.log2(a)), 0.0), 1.0)
    return (lo + f * (hi - lo)) * attention_speed(backend, head_dim)


def attention_flops(
    layers: float, heads: int, head_dim: int, seq: int, tokens: float, window: int = 0
) -> float:
    """Causal attention forward + backward FLOPs of ``tokens`` query tokens in sequences of ``seq``: forward
    4 S D per token and head, halved by the mask; backward 2.5x the forward. A sliding ``window`` shorter than the
    sequence bounds the keys each query sees (about ``window`` instead of S / 2 on average)."""
    keys = seq if not window or window >= seq else 2 * window * (1 - window / (2 * seq))
    return 3.5 * 2 * layers * heads * head_dim * keys * tokens


ADAMW_HBM_SHARE = 0.86
# the gradient norm (loom.train.grads.global_grad_norm, every step: logged, and clipping's input) reads each fp32
# gradient a rank owns once; 1.8 ms a step at 1B on an H200 in train_1b's profile (docs/benchmarks.md)
GRAD_NORM_BYTES = 4
ADAMW_BYTES_PER_PARAM = 28

# QLoRA (lora.base_dtype nf4): each use of an adapted linear's NF4 weight (its forward, its input gradient, and the
# forward again where checkpointing recomputes it) dequantizes it to a bf16 copy, reading the NF4 bytes and writing
# 2 a weight, at this share of the HBM bandwidth: fitted to the one QLoRA run measured (8B, seq 2048, full
# checkpointing, one H100: qlora_8b_h100.json, docs/planner.md), whose dequantization is several torchao kernels
NF4_DEQUANT_HBM_SHARE = 0.36

# LoRA: the adapters' rank-r products are memory-bound passes over each adapted linear's input and output (the
# down-projection reads the input, the up-projection's product is added onto the base's output, and their
# gradients again), and a step with 4 FLOPs a frozen weight and token carries the elementwise work a full step
# spreads over 6, which the fitted matmul efficiency does not hold: bytes per token and unit of an adapted linear's
# input + output width, forward + backward, at the copy rate (again for a recomputed forward). Fitted to the 8B LoRA
# run on one H200 (dd2346f, 14.5 ms a step beyond the FLOPs); the 8B and 1B runs on one H100 test it
# (docs/planner.md, LoRA and QLoRA)
LORA_BYTES_PER_WIDTH = 4.5

# Generation (loom.plan.generate). A decode step streams every weight and the KV cache once, at the share of HBM
# bandwidth loom's decode reaches: at batch 1, and at larger batches (its projections then cuBLAS matmuls). A small
# collective costs a fixed latency on top of its bytes (the runs and the assumption: docs/planner.md, Measured and
# assumed).
DECODE_HBM_SHARE = 0.746
DECODE_HBM_SHARE_BATCHED = 0.65
COLLECTIVE_LATENCY_S = 10e-6


def decode_hbm_share(batch: int) -> float:
    """The share of HBM bandwidth a decode step of ``batch`` sequences reads at (above)."""
    return DECODE_HBM_SHARE if batch == 1 else DECODE_HBM_SHARE_BATCHED


# Float8 (training.float8 tensorwise / rowwise, torchao's Float8Linear on the dense blocks' linears): their GEMMs
# run FLOAT8_GEMM_SPEEDUP x faster than in bf16 (the 8B profile's block GEMMs, 577 -> 365 ms a step: docs/planner.md),
# and every block linear's input and output gradient, an element per token and feature, is scaled and cast (its
# amax read, the cast, the transposed copy the backward's GEMMs read) at COPY_HBM_SHARE: FLOAT8_CAST_BYTES an
# element, fitted to the 8B pair on 2 H200s (float8 / bf16 1.261x in one call).
FLOAT8_GEMM_SPEEDUP = 1.58
FLOAT8_CAST_BYTES = 11.0
# torchao casts each gathered bf16 weight to float8 at every use (each forward, the input gradient): 2 bytes read, 1
# written a weight element; inside the fit above, which was made with bf16 gathers. training.float8_all_gather
# gathers the float8 cast instead: these casts are gone, and FSDP2's copies move a byte a weight element.
FLOAT8_WEIGHT_CAST_BYTES = 3


def float8_cast_width(args) -> int:
    """The features one token's input and output gradient cast across a dense block's linears (q, k, v, o, and
    the MLP's gate, up and down: each linear's in + out features)."""
    q = args.n_heads * args.head_dim
    kv = args.n_kv_heads * args.head_dim
    attention = (args.dim + q) + 2 * (args.dim + kv) + (q + args.dim)
    return attention + 2 * (args.dim + args.ffn_dim) + (args.ffn_dim + args.dim)


# MoE (see the module docstring): the experts' weight casts at COPY_HBM_SHARE of HBM bandwidth, and per routed
# slot x dim element, forward + backward, the bytes of routing beyond the matmuls (the fits: docs/planner.md).
COPY_HBM_SHARE = 0.69
MOE_WEIGHT_CAST_BYTES = 12
# DDP's reducer copies each gradient into its bucket scaled by 1 / replicas (read and write fp32), once a step
DDP_BUCKET_COPY_BYTES = 8
MOE_SLOT_BYTES = {"eager": 59, "compiled": 80}


def moe_overhead_s(
    expert_params: float,
    slots: float,
    dim: int,
    compiled: bool,
    rerun: float,
    hbm_tbps: float,
    weight_bytes: float | None = None,
) -> float:
    """Seconds per MoE layer and micro-batch beyond the active experts' matmuls: ``expert_params`` on this rank,
    ``slots`` = tokens x top_k routed through it, ``rerun``: the share of layers whose forward is recomputed
    (its casts, 6 B per parameter, and a third of the routing, again). ``weight_bytes``: bytes moved per expert
    parameter in place of the casts (FSDP2's copies: ``fsdp_expert_bytes``)."""
    per_param = MOE_WEIGHT_CAST_BYTES + 6 * rerun if weight_bytes is None else weight_bytes
    casts = per_param * expert_params
    routing = MOE_SLOT_BYTES["compiled" if compiled else "eager"] * slots * dim * (1 + rerun / 3)
    return (casts + routing) / (COPY_HBM_SHARE * hbm_tbps * 1e12)


# Expert parallelism beyond its all-to-alls (loom.parallel.expert_parallel.ExpertParallel.run, left out of the
# compiled graphs): a rank gathers the slots it receives into local-expert order and scatters the experts' outputs
# back into source-rank order, a read and a write of each slot x model-dim element apiece (forward: 4 elements); in
# the backward the scatter's gradient is a gather (2) and the gather's an index_put into zeros (4: the fill, the
# gradient read, the accumulating read and the write); a recomputed block runs the forward's again.
EP_SLOT_ELEMENTS = {"forward": 4, "backward": 6}
# Older code (the runs measured before the experts' FSDP2 reduction took ParallelDims.expert_grad_factor in, as a
# divide factor) multiplied every local expert's fp32 gradient by it after the backward: a read and a write of 4 bytes
# a parameter, once per step. Kept to estimate those runs (tests/data/plan_runs.json: ep_grad_rescale).
EP_GRAD_SCALE_BYTES = 8


def ep_overhead_s(
    slots: float, dim: int, dtype_bytes: int, rerun: float, expert_params: float, hbm_tbps: float
) -> tuple[float, float]:
    """(seconds per MoE layer and micro-batch, seconds per step) of expert parallelism's copies at the copy rate:
    the ``slots`` a rank receives permuted to its experts and back (forward, backward, the forward again for the
    ``rerun`` share of blocks), and older code's expert-gradient rescale of its ``expert_params`` (all its MoE
    layers')."""
    rate = COPY_HBM_SHARE * hbm_tbps * 1e12
    elements = EP_SLOT_ELEMENTS["forward"] * (1 + rerun) + EP_SLOT_ELEMENTS["backward"]
    return elements * slots * dim * dtype_bytes / rate, EP_GRAD_SCALE_BYTES * expert_params / rate


# FSDP2's copies around its collectives (torch.distributed.fsdp's foreach_all_gather / foreach_reduce): of every
# parameter a rank holds (planner.data_parallel_s), the experts' with the MoE overhead, where they take the place of
# the casts above (their own FSDP2 unit over the ranks holding the same experts under expert parallelism, part of
# their block's otherwise). Each all-gather casts the fp32 shard to the compute dtype (4 + c bytes a
# parameter of the shard, c the compute dtype's; no cast in fp32), copies it into the gather buffer (2c) and copies
# the gathered weights out into the parameters (2c a gathered parameter); each reduction copies the gradient into the
# fp32 buffer (c + 4) and, on a mesh of one rank, the buffer to the shard (8) where more ranks reduce-scatter it.
# Once per micro-batch; the gather twice when the blocks reshard after the forward (the backward's gather also
# serves a recomputation).
def fsdp_copy_bytes(
    shard: int, gathers: int, dtype_bytes: int, reduce_bytes: int = 4, fused: bool = False
) -> tuple[float, float]:
    """HBM bytes FSDP2 copies per parameter a rank holds (gathered), per micro-batch, sharded over ``shard`` ranks:
    (its ``gathers`` gathers in ``dtype_bytes``: the shard's copy-in, cast from fp32 where the dtype differs, into a
    temporary then the buffer, or with ``fused`` (parallel.fsdp_gather_copy) straight into the buffer, and the
    copy-out of the gathered parameter; its gradient's copy into the reduce-scatter buffer, in ``reduce_bytes``).
    The copy-out and the gradient's copy run on the compute stream, the copy-in on FSDP2's beside it, competing
    for HBM (what they cost in a profile: docs/planner.md, Time)."""
    c = dtype_bytes
    cast = 4 + c if c != 4 else 0
    copy_in = cast if fused and cast else cast + 2 * c
    return gathers * (copy_in / shard + 2 * c), c + reduce_bytes


def float8_gather_copy_bytes(shard: int, gathers: int) -> tuple[float, float]:
    """``fsdp_copy_bytes`` of a weight FSDP2 gathers in float8 (training.float8_all_gather), per parameter a rank
    holds: (per micro-batch, the ``gathers`` gathers' copy-in and copy-out of a byte an element; once a step, the
    fp32 shard's cast at the unit's first gather, 4 bytes read and 1 written, loom.models.common.float8.cast_shards)."""
    return gathers * (2 / shard + 2), (4 + 1) / shard


def fsdp_expert_bytes(shard: int, gathers: int, dtype_bytes: int, fused: bool = False) -> float:
    """Bytes FSDP2 copies per expert parameter a rank holds, per micro-batch (``fsdp_copy_bytes``), and where the
    experts' mesh is a single rank the gradient's accumulation into the kept one (8 bytes)."""
    gather, reduce = fsdp_copy_bytes(shard, gathers, dtype_bytes, fused=fused)
    return gather + reduce + (8 if shard == 1 else 0)


# torch._grouped_mm on Hopper (aten/src/ATen/native/cuda/GroupMM.cu, dispatch_bf16_grouped_kernel_on_tile_size):
# tiles of 128 rows, 64 where the experts' mean row count (or the width) is 128 or less. Each expert's rows end in a
# part-filled tile, half a tile on average with uneven counts, computed in full by the GEMMs that tile the rows: the
# forward (again where recomputed) and the input gradient; the weight gradient reduces over the rows.
GROUPED_TILE_ROWS = {"small": 64, "large": 128}


def grouped_padding_flops(local_experts: float, slots: float, dim: int, width: float, rerun: float) -> float:
    """FLOPs per MoE layer and micro-batch the grouped GEMMs spend on their part-filled tiles: ``local_experts``
    SwiGLU experts (three weights, dim x ``width``) receiving ``slots`` rows in all."""
    if not local_experts:
        return 0.0
    mean = slots / local_experts
    tile = GROUPED_TILE_ROWS["small" if mean <= 128 or width <= 128 else "large"]
    return local_experts * tile / 2 * 3 * 2 * dim * width * (2 + rerun)


# Expert parallelism's host waits (loom.parallel.expert_parallel.ExpertParallel.host_splits): seconds a step loses
# per wait, the GPU's drained queue idle until the host has launched the block's exchange and experts, and the
# exchange waiting for the other rank's host to get there. Fitted to the Qwen3-MoE EP2 pair on two H200s, whose code
# waited twice per MoE block (tests/data/plan_runs.json, marked fitted; docs/planner.md, Expert parallelism). The
# device-to-host read itself is 0.26 ms of it (bench/results/moe_phases_h200.json): the rest is host time.
EP_HOST_WAIT_S = 5.1e-3


def ep_host_s(waits_per_block: float, moe_layers: int, micro_batches: int) -> float:
    """Seconds per step the GPU idles at expert parallelism's host waits: ``waits_per_block`` per MoE block and
    micro-batch, ``moe_layers`` MoE blocks on the rank, ``micro_batches`` a step."""
    return EP_HOST_WAIT_S * waits_per_block * moe_layers * micro_batches


@dataclass
class StepTime:
    """Seconds per optimizer step on the slowest rank, by kind."""

    compute: float = 0.0
    bubble: float = 0.0
    optimizer: float = 0.0
    fsdp: float = 0.0  # exposed data-parallel communication (FSDP / HSDP / DDP)
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0  # expert parallelism's token all-to-alls
    moe: float = 0.0  # expert weight casts and token routing (memory-bound)
    pp: float = 0.0  # activations sent between stages
    offload: float = 0.0  # training.activation_offload's host copies not hidden behind compute
    host: float = 0.0  # the GPU idle at expert parallelism's host waits for token counts

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def ms(self) -> dict[str, float]:
        out = {f.name: 1e3 * getattr(self, f.name) for f in fields(self)}
        out["total"] = 1e3 * self.total
        return out


def collective_s(nbytes: float, ranks: int, gbps: float) -> float:
    """A ring all-gather / reduce-scatter of a ``nbytes`` tensor over ``ranks`` ranks."""
    return 0.0 if ranks <= 1 else nbytes * (ranks - 1) / ranks / (gbps * 1e9)


# training.activation_checkpointing matmuls: each block's elementwise forward work (norms, RoPE, SwiGLU, the residual
# sums) runs again in its backward, no matmul does; priced as this share of the blocks' matmul time, fitted to the
# 3B one-GPU pair (bench/results/peers_llama3_3b_1gpu_h200.json at ceb40d3: 20,981 tokens/s against 21,270 without
# checkpointing, 1.36% of the step; 1.38% estimated)
MATMULS_RERUN_SHARE = 0.022


def recompute_share(ac: str, ac_every: int, n_layers: int) -> tuple[float, float]:
    """Extra forward work activation checkpointing adds, as a share of a block's (matmul, attention) FLOPs:
    ``full`` reruns the forward (1/3 of forward + backward); ``op`` reruns every other matmul and keeps
    the attention, ``matmuls`` keeps both (loom.parallel.activation_checkpoint)."""
    if ac == "full":
        return 1 / 3, 1 / 3
    if ac == "op":
        return 1 / 6, 0.0
    if ac == "every_k":
        share = -(-n_layers // ac_every) / n_layers
        return share / 3, share / 3
    return 0.0, 0.0
