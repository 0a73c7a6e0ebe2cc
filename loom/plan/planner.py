"""``estimate``: memory and step time of one configuration on N GPUs of a kind, before renting them.
``search``: every layout of N GPUs (tp, pp, cp, replicate x shard, schedule, micro-batch, activation
checkpointing) that loom accepts for the config's model and global batch, estimated and ranked.

The same validation as ``loom train`` runs first (ParallelDims and the config checks), so a plan never
proposes a layout the trainer would reject.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from loom.config.errors import ConfigError
from loom.config.sections import SELECTIVE_AC, Config
from loom.data import build_tokenizer
from loom.methods import method_of, resolve
from loom.models.registry import spec_of
from loom.parallel.dims import AXIS_ORDER, ParallelDims
from loom.parallel.offload_rules import offloaded_blocks
from loom.parallel.pipeline import (
    SPLIT_BACKWARD,
    schedule_actions,
    stage_ids,
    stages_per_rank,
    theoretical_bubble,
)
from loom.parallel.vocab_embedding_rules import fsdp_embedding
from loom.plan.activations import float8_compiled_drop, profile_activations
from loom.plan.hardware import GPU
from loom.plan.memory import (
    BYTES,
    GIB,
    MARGIN,
    WORKSPACE_BYTES,
    Memory,
    MemoryInputs,
    autocast_cache,
    cp_attention_working,
    gathered_memory,
    generation_peak,
    held_experts,
    held_params,
    offloaded_activations,
    pipeline_peak,
    split_tokens,
    stage_activation,
    state_memory,
    step_peak,
    stored_blocks,
    with_workspace,
)
from loom.plan.shapes import expert_params, rank_shares
from loom.plan.timing import (
    ADAMW_BYTES_PER_PARAM,
    ADAMW_HBM_SHARE,
    ATTENTION_SPEED,
    COPY_HBM_SHARE,
    DDP_BUCKET_COPY_BYTES,
    EP_HOST_WAIT_S,
    FLOAT8_CAST_BYTES,
    FLOAT8_GEMM_SPEEDUP,
    FLOAT8_WEIGHT_CAST_BYTES,
    GRAD_NORM_BYTES,
    LORA_BYTES_PER_WIDTH,
    MATMULS_RERUN_SHARE,
    NF4_DEQUANT_HBM_SHARE,
    StepTime,
    attention_efficiency,
    attention_flops,
    attention_speed,
    collective_s,
    efficiency,
    ep_host_s,
    ep_overhead_s,
    float8_cast_width,
    float8_gather_copy_bytes,
    fsdp_copy_bytes,
    fsdp_expert_bytes,
    grouped_padding_flops,
    moe_overhead_s,
    recompute_share,
)
from loom.resolve import accumulation_steps, model_kernels, resolve_model_args


@dataclass
class Estimate:
    layout: dict
    memory: Memory  # the busiest rank's
    time: StepTime  # the slowest rank's
    tokens_per_s_per_gpu: float
    mfu: float
    capacity_gib: float
    notes: list[str] = field(default_factory=list)
    margin_gib: float = 0.0  # left free under capacity_gib
    host_gib: float = 0.0  # parallel.cpu_offload's weights, gradients and AdamW state and activation_offload's tensors, per rank
    host_limit_gib: float = math.inf  # what a rank may keep there (HOST_GIB_PER_GPU)
    disk_gib: float = 0.0  # optimizer.offload nvme: the AdamW moments each rank keeps in files
    params: float = 0.0  # the model's parameters (the MTP modules' included)
    rank_params: float = 0.0  # the busiest rank's before data-parallel sharding (its tp, pp and ep share)

    @property
    def limit_gib(self) -> float:
        """What the busiest rank may use: the GPU's memory less the margin."""
        return self.capacity_gib - self.margin_gib

    @property
    def fits(self) -> bool:
        return self.memory.total / GIB <= self.limit_gib and self.host_gib <= self.host_limit_gib

    def describe(self) -> str:
        return layout_name(self.layout)


def layout_name(layout: dict) -> str:
    parts = [
        f"{a}{layout[a]}"
        for a in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")
        if layout.get(a, 1) > 1
    ]
    if layout["pp"] > 1:
        parts.append(layout["pp_schedule"])
    if layout.get("cpu_offload"):
        parts.append("cpu_offload")
    if layout.get("activation_offload"):
        parts.append(f"act_offload{layout['activation_offload']}")
    if layout.get("optimizer_offload") == "nvme":
        parts.append("nvme")
    if layout.get("zero") in (1, 2):  # 0 and 3 are what the degrees say (DDP, FSDP2)
        parts.append(f"zero{layout['zero']}")
    if layout.get("float8_all_gather"):
        parts.append("float8_gather")
    return (
        " ".join(parts or ["single"])
        + f" mb{layout['micro_batch_size']} ac={layout['activation_checkpointing']}"
    )


def check_modelled(cfg: Config, args=None) -> None:
    """What the planner does not model (``args``: the resolved model, once known)."""
    if cfg.model.attention == "flex":
        raise ConfigError(
            "model.attention",
            "flex",
            "loom plan does not model FlexAttention (its activations are "
            "traced on the CPU, where Flex has no backward): allowed auto | sdpa | flash",
        )


def priced_attention(cfg: Config, args, gpu: GPU) -> str:
    """The attention backend the step is priced at (loom.plan.timing.attention_speed): the run's, and under
    ``auto`` for plain causal attention the fastest of those its start-up timing would try on ``gpu``, by their
    measured speeds: FlashAttention-4 where its package is installed on this machine and the GPU kind runs it, else
    cuDNN SDPA. A named FlashAttention-4 on a GPU kind that does not run it is refused, as the run would refuse it."""
    from loom.kernels.attention import fa4
    from loom.kernels.dispatch import attention_candidates

    head_dim = args.head_dim
    runs_fa4 = gpu.major in fa4.ARCHS and fa4.head_dims_allowed(head_dim, gpu.major)
    if cfg.model.attention == "fa4" and not runs_fa4:
        raise ConfigError(
            "model.attention",
            "fa4",
            f"FlashAttention-4 runs on compute capability 9.x-11.x with head dims it takes ({gpu.name} is "
            f"{gpu.major}.x, this model's head dim {head_dim}): allowed auto | sdpa | sdpa_cudnn | sdpa_flash | flash",
        )
    if cfg.parallel.cp > 1:  # attention under context parallelism runs loom's kernel, whatever is named
        return "flash"
    # what the run's start-up timing picks from (loom.resolve.times_attention): not for deterministic runs or MLA
    # (windows and documents resolved to loom's kernel already), nor in fp32 (untimed)
    timed = args.attention == "sdpa" and not (
        args.mla or cfg.run.deterministic or cfg.training.dtype == "float32"
    )
    if cfg.model.attention != "auto" or not timed:
        return args.attention
    names = attention_candidates(False, "cuda", cfg.training.dtype, head_dim, fa4.installed() and runs_fa4)
    return max(names, key=lambda name: attention_speed(name, head_dim))


def attention_notes(cfg: Config, args, gpu: GPU) -> list[str]:
    """What the plan assumed of the attention kernel, where it is not the cuDNN SDPA its rate was fitted on."""
    from loom.kernels.dispatch import KERNEL_NAMES

    backend = priced_attention(cfg, args, gpu)
    if backend not in ATTENTION_SPEED:
        return []
    timed = cfg.model.attention == "auto" and backend == "fa4"
    auto = " (model.attention auto: what its timing picks where the package is installed, as here)"
    name = KERNEL_NAMES.get(backend, "loom's attention kernel (Triton)")
    return [
        f"attention priced as {name}{auto if timed else ''}: "
        f"{attention_speed(backend, args.head_dim):.2f}x cuDNN SDPA's forward + backward (measured on an H200 at "
        "seq 8192, docs/planner.md)"
    ]


def model_args(cfg: Config):
    """The model's shape and the kernels a CUDA run with Triton picks (the trainer's resolution, without timing
    attention)."""
    check_modelled(cfg)
    args = resolve_model_args(
        cfg, build_tokenizer(cfg.data.tokenizer), model_kernels(cfg, "cuda", triton=True)
    )
    check_modelled(cfg, args)
    return args


def traced_args(args, compile: bool):
    """The model traced for activations: under torch.compile, Inductor fuses norms, RoPE and the SwiGLU gate
    as loom's fused kernels do, so those are traced in their place."""
    return args.with_(fused_norm=True, fused_rope=True, fused_swiglu=True) if compile else args


def spans_nodes(dims: ParallelDims, axes: tuple[str, ...], gpu: GPU) -> bool:
    """Whether a group over ``axes`` (adjacent in the mesh order) has ranks on more than one node."""
    inner = 1
    for a in AXIS_ORDER[AXIS_ORDER.index(axes[-1]) + 1 :]:
        inner *= getattr(dims, a)
    size = math.prod(getattr(dims, a) for a in axes)
    return inner * size > gpu.gpus_per_node


def _bandwidth(dims, axes, gpu) -> float:
    return gpu.network_gbps if spans_nodes(dims, axes, gpu) else gpu.link_gbps


def validate(cfg: Config, world_size: int):
    """The trainer's checks for this world size on CUDA GPUs with Triton; returns (dims, model args, micro-batches
    per step)."""
    check_modelled(cfg)
    run = resolve(cfg, world_size, build_tokenizer(cfg.data.tokenizer), device="cuda", triton=True)
    check_modelled(cfg, run.model_args)
    return run.dims, run.model_args, run.accum


def estimate(
    cfg: Config,
    world_size: int,
    gpu: GPU,
    profiles: dict | None = None,
    margin_gib: float | None = None,
    ep_waits: float | None = None,
    ep_grad_rescale: bool = False,
) -> Estimate:
    """Memory and step time of ``cfg`` on ``world_size`` GPUs of kind ``gpu`` (raises ConfigError when loom
    would reject the layout). ``profiles`` caches activation traces across calls (search); ``margin_gib``: memory
    a fitting layout leaves free (default ``MARGIN`` of the GPU's); ``ep_waits``: expert parallelism's host waits
    per MoE block and micro-batch (default: loom's, ``ep_host_waits``; a run of older code may have waited more);
    ``ep_grad_rescale``: a run of older code (before their reduction divided them) rescaled its expert gradients
    after the backward."""
    dims, args, m = validate(cfg, world_size)
    t, p = cfg.training, cfg.parallel
    x = memory_inputs(cfg, dims, args)
    profile = activation_profile(cfg, dims, args, x, profiles)
    shares = rank_shares(args, dims.pp, p, t.seq_len)
    memories = [rank_memory(share, r, args, dims, x, profile, cfg, m) for r, share in enumerate(shares)]
    per_block = offload_block_bytes(profile, x, args, cfg)
    times = [
        rank_time(share, args, dims, x, cfg, m, gpu, per_block, ep_waits, ep_grad_rescale) for share in shares
    ]
    memory = max(memories, key=lambda mem: mem.total)
    time = max(times, key=lambda st: st.total)
    tokens = t.global_batch_size * t.seq_len / time.total / world_size
    adapters = x.adapters(args.n_layers) * dims.tp if cfg.lora.rank else None  # the whole model's
    mfu = tokens * spec_of(args).flops_per_token(args, t.seq_len, adapters) / gpu.peak(t.dtype)
    layout = {a: getattr(dims, a) for a in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")}
    layout.update(
        pp_schedule=p.pp_schedule,
        micro_batch_size=t.micro_batch_size,
        activation_checkpointing=t.activation_checkpointing,
        accumulation=m,
        cpu_offload=p.cpu_offload,
        zero=dims.zero,
        activation_offload=x.offload_blocks,
        optimizer_offload=cfg.optimizer.offload,
        float8_all_gather=t.float8_all_gather,
    )
    notes = []
    host = max(offloaded_state(held_params(share, x), x) for share in shares)
    if p.cpu_offload:
        notes.append(offload_note(host, shares, args, dims, x, gpu))
    parked = offloaded_activations(per_block, x)[1]
    if x.offload_blocks:
        host += parked
        notes.append(activation_offload_note(parked, per_block, x, gpu))
        if dims.pp > 1:
            notes.append(
                "activation_offload under a pipeline is not modelled: the stages keep their activations"
            )
    disk = max(nvme_state(held_params(share, x), x) for share in shares)
    if x.nvme:
        notes.append(nvme_note(disk))
    if t.float8 != "none" and not float8_modelled(t, args, x):
        notes.append(
            "float8 is modelled for dense attention blocks without LoRA only: this one estimated as bf16"
        )
    extras = method_of(cfg).plan(cfg)
    if extras.frozen is None:
        notes.append(
            f"training.objective {t.objective} holds a model of another shape (its teacher), not in this estimate"
        )
    if extras.note:
        notes.append(f"training.objective {t.objective}: {extras.note}")

    if dims.tp > 1 and not t.compile:
        notes.append(
            "eager TP is host-bound (DTensor dispatch): measured 2.65x slower than compiled on 2xH200, "
            "not in this estimate (docs/benchmarks.md)"
        )
    if dims.ep > 1 and args.moe:
        notes.append(
            "expert parallelism waits on the host for its token counts in every MoE block, and the GPU idles until "
            f"the host launches the rest: {1e3 * EP_HOST_WAIT_S:g} ms a wait (in 'host'; fitted to one EP2 run on "
            "2xH200, docs/planner.md, Expert parallelism); uneven routing is not modelled"
        )
    notes.extend(attention_notes(cfg, args, gpu))
    margin = MARGIN * gpu.memory_gib if margin_gib is None else margin_gib
    return Estimate(
        layout,
        memory,
        time,
        tokens,
        mfu,
        gpu.memory_gib,
        notes,
        margin,
        host / GIB,
        HOST_GIB_PER_GPU if p.cpu_offload or x.offload_blocks else math.inf,
        disk / GIB,
        rank_shares(args, 1, p, t.seq_len)[0].params(1),
        max(held_params(share, x) for share in shares),
    )


def memory_inputs(cfg: Config, dims: ParallelDims, args) -> MemoryInputs:
    t, p = cfg.training, cfg.parallel
    split = dims.pp > 1 and p.pp_schedule in SPLIT_BACKWARD
    extras = method_of(cfg).plan(cfg)  # the method's models beyond the policy
    objective = method_of(cfg).objective_class
    return MemoryInputs(
        dtype=t.dtype,
        tp=dims.tp,
        cp=dims.cp,
        shard=dims.dp_shard * dims.cp if dims.fsdp_enabled else 1,
        fsdp=dims.fsdp_applied or p.cpu_offload,  # offload: FSDP2 on one rank too
        reshard_after_forward=dims.reshard_after_forward and not split,
        micro_batch=t.micro_batch_size,
        seq_len=t.seq_len,
        cpu_offload=p.cpu_offload,
        ep=dims.ep,
        expert_params=args.moe_experts * expert_params(args) if args.moe else 0.0,
        etp=dims.etp,
        optimizer_shard=dims.dp_replicate if dims.shard_optimizer else 1,
        cp_ring=dims.cp > 1 and p.cp_method == "ring",
        weight_versions=1 if p.pp_schedule == "pipedream_2bw" else 0,
        offload_blocks=len(offloaded_blocks(t.activation_offload, args.n_layers)),
        nvme=cfg.optimizer.offload == "nvme",
        reduce_bytes=BYTES[p.reduce_dtype],
        ddp_bucket_bytes=p.ddp_bucket_mb * 2**20,
        ep_padded=p.ep_exchange == "padded",
        gather_fused=p.fsdp_gather_copy == "fused",
        # a rollout method's micro-batches differ in width between ranks (as its objective says: equal_widths)
        vocab_split=fsdp_embedding(p, dims, args, t, objective) == "vocab",
        rows_per_example=objective.rows_per_example,
        **lora_inputs(cfg, args),
        frozen_copies=extras.frozen or 0,
        trained_copies=extras.trained,
        **generation_inputs(cfg, dims, args),
    )


def generation_inputs(cfg: Config, dims: ParallelDims, args) -> dict:
    """MemoryInputs' generation fields for a rollout method: the KV cache of this rank's rows at up to seq_len
    positions (plus the engine's scratch slots, rounded as it allocates), in the engine's weight dtype, and whether
    it stays parked through the training step (grpo.keep_cache; an asynchronous sampler's always is); the weight
    copy it generates with under FSDP2 or asynchronous GRPO (the whole policy, compute dtype) or tensor parallelism
    (a tp shard). An asynchronous sampler on a device of its own (grpo.sampler_device) puts neither here."""
    from loom.infer.engine import ALIGN, SCRATCH
    from loom.plan.generate import kv_cache_bytes

    rows = method_of(cfg).plan(cfg).rollout_rows // dims.dp_size
    g = cfg.grpo
    if not rows or (g.max_staleness and g.sampler_device):  # an asynchronous sampler on a GPU of its own
        return {}
    t = cfg.training
    compute = BYTES[t.dtype]
    # asynchronous GRPO samples on a snapshot (a copy) while the step trains: its cache is held through it too
    sharded = dims.fsdp_enabled or dims.tp > 1 or g.max_staleness > 0
    # the engine's dtype is its weights': a copy's compute dtype, else the policy's (fp32 master weights; a LoRA
    # base's frozen dtype where it has one)
    weight = compute if sharded or (cfg.lora.rank and cfg.lora.base_dtype != "float32") else 4
    positions = -(-(t.seq_len + SCRATCH) // ALIGN) * ALIGN
    full = rank_shares(args, 1, cfg.parallel, t.seq_len)[0].params(dims.tp)
    return dict(
        kv_cache=kv_cache_bytes(args, rows, positions, {4: "float32", 2: "bfloat16"}[weight], dims.tp),
        kv_kept=g.keep_cache or g.max_staleness > 0,
        engine_copy=compute * full if sharded else 0.0,
    )


def lora_inputs(cfg: Config, args) -> dict:
    """MemoryInputs' LoRA fields: the frozen base's bytes a parameter (lora.base_dtype: float32 4, bfloat16 2; nf4
    keeps its unquantized weights in bfloat16 and each adapted base weight in NF4: 4 bits plus an int8 scale per 64
    weights and an fp32 scaler per 256 scales), and one block's adapters and adapted base weights, counted on a
    one-block model built on the meta device as ``apply_lora`` adapts it (every block carries the same targets)."""
    import torch

    from loom.models.common.lora import NF4_BLOCK, NF4_SCALER_BLOCK, apply_lora, lora_modules
    from loom.models.registry import build_model

    lora = cfg.lora
    if not lora.rank:
        return {}
    base = 4 if lora.base_dtype == "float32" else 2
    nf4 = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)
    with torch.device("meta"):
        model = build_model(args.with_(n_layers=1))
        apply_lora(model, lora)
    return dict(
        lora_base_bytes=base,
        adapted_bytes=nf4 if lora.base_dtype == "nf4" else base,
        block_adapters=float(sum(p.numel() for p in model.parameters() if p.requires_grad)),
        block_adapted=float(sum(m.weight.numel() for _, m in lora_modules(model))),
        **adapted_widths(model, lora_modules(model)),
    )


def adapted_widths(model, modules) -> dict:
    """One block's adapted linears' input + output widths: the part tensor parallelism splits over its ranks (a
    column-parallel base's output, a row-parallel one's input) and the part each rank reads or writes whole (the
    other side: an adapter's A or B replicated, ``loom.parallel.tensor_parallel.lora_styles``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from loom.parallel.tensor_parallel import block_plan_for

    plan = block_plan_for(next(iter(model.layers.values())))
    split = whole = 0.0
    for name, module in modules:
        out_width, in_width = module.weight.shape
        style = plan.get(name.split(".", 2)[-1])  # layers.0.attention.wq -> attention.wq
        if isinstance(style, ColwiseParallel):
            split, whole = split + out_width, whole + in_width
        elif isinstance(style, RowwiseParallel):
            split, whole = split + in_width, whole + out_width
        else:
            whole += in_width + out_width
    return dict(block_adapted_split=split, block_adapted_whole=whole)


def activation_profile(cfg: Config, dims: ParallelDims, args, x: MemoryInputs, profiles: dict | None = None):
    """The traced activation bytes of this config (``profiles`` caches them across calls), with what compiled blocks
    keep otherwise than the eager trace (``compiled_under_autocast``, ``float8_compiled``)."""
    t = cfg.training
    traced, seq = traced_args(args, t.compile), t.seq_len // dims.cp
    profiles = {} if profiles is None else profiles

    def trace(fsdp: bool):
        call = (traced, seq, t.micro_batch_size, t.dtype, fsdp, t.activation_checkpointing, t.ac_every)
        key = (*call, lora_key(cfg))
        if key not in profiles:
            profiles[key] = profile_activations(*call, cfg.lora if cfg.lora.rank else None)
        return profiles[key]

    profile = trace(x.fsdp)
    if compiled_autocast(cfg, dims, args, x):
        profile = compiled_under_autocast(profile, trace(True), args, t.float8, seq)
    return float8_compiled(profile, cfg, args, x, seq)


def compiled_autocast(cfg: Config, dims: ParallelDims, args, x: MemoryInputs) -> bool:
    """Whether ``compiled_under_autocast`` models this run: compiled dense attention blocks without recomputation or
    LoRA, fp32 weights under autocast, on one GPU or replicated by DDP (the layouts it was measured or checked in;
    not under tensor, pipeline or context parallelism)."""
    t = cfg.training
    plain = not (args.moe or args.mla or cfg.lora.rank)
    whole = dims.tp == dims.pp == dims.cp == 1 and not x.fsdp
    return whole and t.compile and t.dtype != "float32" and t.activation_checkpointing == "none" and plain


def compiled_under_autocast(autocast, compute, args, float8: str, seq: int):
    """What a compiled block keeps under autocast (measured: docs/planner.md, "How it estimates"): what it keeps with
    compute-dtype weights (``compute``'s trace) plus its fp32 input, and the fp32 sum after attention where loom's
    fused norm takes it; its weights' casts in bf16 (the eager ``autocast`` trace's fixed bytes), none under float8."""
    width = (4 if args.fused_norm else 2) * args.dim * seq
    fixed = autocast.layer_fixed if float8 == "none" else 0.0
    per_seq = compute.layer_per_seq + width
    return dataclasses.replace(
        autocast, layer_per_seq=per_seq, layer_fixed=fixed, dense_per_seq=per_seq, dense_fixed=fixed
    )


def float8_compiled(profile, cfg: Config, args, x: MemoryInputs, seq: int):
    """``profile`` less what compiled float8 blocks do not keep (``float8_compiled_drop``) in the blocks left
    unrecomputed; with op-level or full recomputation float8 keeps what bf16 keeps (docs/planner.md)."""
    t = cfg.training
    if not (t.compile and float8_modelled(t, args, x)):
        return profile
    kept = {"none": 1.0, "every_k": 1 - -(-args.n_layers // t.ac_every) / args.n_layers}
    drop = kept.get(t.activation_checkpointing, 0.0) * float8_compiled_drop(args, t.float8) * seq
    return dataclasses.replace(profile, layer_per_seq=profile.layer_per_seq - drop) if drop else profile


def lora_key(cfg: Config) -> tuple:
    """What of the [lora] section changes the traced activations (nothing without a rank)."""
    lo = cfg.lora
    return (lo.rank, lo.targets, lo.base_dtype, lo.fused, lo.dropout > 0) if lo.rank else ()


@dataclass
class RankNeeds:
    """What the busiest rank of a run needs, for ``loom train``'s check against this machine's memory."""

    params: float  # parameters it holds before data-parallel sharding
    state_bytes: (
        float  # fp32 weights, gradients and AdamW moments after sharding (0 with cpu_offload: on the host)
    )
    peak_bytes: (
        float | None
    )  # a training step's peak (state, activations, gathered weights); None: not modelled
    activation_bytes: float  # of that peak, the activations (and the backward's extra) of one micro-batch
    fixed_bytes: float = (
        0.0  # of that peak, what does not grow with the micro-batch (state, gathered weights,
    )
    # the allocator's fixed workspace); the rest grows about in proportion to it
    host_bytes: float = 0.0  # parallel.cpu_offload: the state it keeps in host memory instead


def rank_needs(cfg: Config, dims: ParallelDims, args, device: str, peak: bool = True) -> RankNeeds:
    """Memory of the busiest rank from the planner's model: parameters from the shape (never a built model, so a
    million layers cost what two do), activations traced on fake tensors (``peak``). On the CPU the GPU's
    allocator workspace is left out."""
    t, p = cfg.training, cfg.parallel
    x = memory_inputs(cfg, dims, args)
    shares = rank_shares(args, dims.pp, p, t.seq_len)
    params = max(held_params(share, x) for share in shares)
    state = state_memory(params, x, max(share.layers for share in shares))
    state_bytes = state.weights + state.gradients + state.optimizer
    host = offloaded_state(params, x)
    if not peak:
        return RankNeeds(params, state_bytes, None, 0.0, host_bytes=host)
    profile = activation_profile(cfg, dims, args, x)
    m = accumulation_steps(t, dims.dp_size)
    gpu = device != "cpu"
    memories = [rank_memory(share, r, args, dims, x, profile, cfg, m, gpu) for r, share in enumerate(shares)]
    busiest = max(memories, key=lambda mem: mem.total)
    total = busiest.total - (0.0 if gpu else busiest.workspace)
    fixed = (
        busiest.weights
        + busiest.gradients
        + busiest.optimizer
        + busiest.gathered
        + busiest.kv_cache  # a rollout engine's: the rows a step generates, whatever the micro-batch
        + (WORKSPACE_BYTES if gpu else 0)
    )
    return RankNeeds(params, state_bytes, total, busiest.activations + busiest.backward, fixed, host)


def memory_check_estimate(cfg: Config, world_size: int, device: str) -> RankNeeds:
    """``rank_needs`` of a config as ``loom train`` would run it on ``device`` (kernels chosen without timing)."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    return rank_needs(cfg, dims, resolve_model_args(cfg, build_tokenizer(cfg.data.tokenizer)), device)


def rank_memory(
    share, rank: int, args, dims, x: MemoryInputs, profile, cfg: Config, m: int, cuda: bool = True
) -> Memory:
    """The busiest moment of one rank's step. ``cuda``: the GPU's caching allocator, which keeps each stream's
    freed blocks for that stream (``reduce_scatter_pool``)."""
    ac = cfg.training.activation_checkpointing
    stored = stored_blocks(ac, cfg.training.ac_every, args.n_layers)
    state = state_memory(held_params(share, x), x, share.layers)
    # each block linear's shard cast to float8 for the step's gathers (not under 2BW: its gathers cast as torchao)
    if cfg.training.float8_all_gather and x.fsdp and cfg.parallel.pp_schedule != "pipedream_2bw":
        state.weights += share.block_sharded / dims.tp / x.shard
    gathered = gathered_memory(share, args, x, 2 if x.reshard_after_forward else share.layers)
    backward = profile.backward_peak / dims.tp + cp_attention_working(args, x, ac)
    if dims.pp > 1:  # several micro-batches in flight in different phases: every term at once
        per_rank = stages_per_rank(cfg.parallel)
        ids = stage_ids(rank, dims.pp, per_rank, cfg.parallel.pp_schedule)
        per_stage = {
            s: stage_activation(profile, len(layers), last, x, args, ac, stored, dense_blocks(args, layers))
            for s, layers, last in zip(ids, share.stages, share.last)
        }
        actions = schedule_actions(cfg.parallel.pp_schedule, dims.pp, m, per_rank)[rank]
        split = cfg.parallel.pp_schedule in SPLIT_BACKWARD
        state.activations = pipeline_peak(actions, per_stage, split)
        state.gathered = gathered + autocast_cache(share, args, x, cfg.training.compile, 0.0)
        state.backward = backward
        return with_workspace(state)
    activations = stage_activation(profile, share.layers, True, x, args, ac, stored, share.dense_layers)
    activations -= offloaded_activations(offload_block_bytes(profile, x, args, cfg), x)[0]
    activations *= 1 + x.trained_copies  # a model trained beside the policy keeps its own (PPO's critic)
    held_fixed = profile.held(share.layers, 0, dense=share.dense_layers) / dims.tp  # batch-independent
    cache = autocast_cache(share, args, x, cfg.training.compile, held_fixed)
    # earlier micro-batches' (accumulated or sharded) gradients, the reduce-scatter stream's pool, or DDP's buckets
    grads_before = state.gradients if m > 1 or reduce_scatter_pool(x, cuda) or ddp_buckets(dims, x) else 0.0
    peak = step_peak(state, gathered, cache, activations, backward, grads_before)
    # a rollout method's engine: its weight copy lives beside the policy, its parked KV cache too (grpo.keep_cache)
    peak.weights += x.engine_copy
    peak.kv_cache = x.kv_cache if x.kv_kept else 0.0
    return max(with_workspace(peak), generation_peak(state, x), key=lambda mem: mem.total)


def reduce_scatter_pool(x: MemoryInputs, cuda: bool) -> bool:
    """Whether the step's gradients are reserved beside the activations' peak with one micro-batch as well: FSDP2
    allocates each unit's reduce-scatter output, which its sharded gradients are views of, on its reduce-scatter
    stream, and the CUDA caching allocator does not hand that stream the blocks the compute stream frees as the
    backward drops the activations (docs/planner.md, "How it estimates")."""
    return cuda and x.fsdp and x.shard > 1


def ddp_buckets(dims: ParallelDims, x: MemoryInputs) -> bool:
    """Whether every gradient is held through the forward as well: DDP (loom's, ``gradient_as_bucket_view``) keeps
    its buckets, which the gradients are views of, from its construction on; ``zero_grad(set_to_none)`` drops the
    views, not the buckets."""
    return dims.ddp_enabled and not dims.replicate_with_fsdp


def float8_gathered(cfg: Config, args, share, dims, x: MemoryInputs) -> float:
    """The block linears' weights this rank gathers in float8 (training.float8_all_gather under FSDP2, where the
    step time models float8; not under 2BW, whose gathers cast as torchao does): 0 otherwise."""
    t = cfg.training
    if not (t.float8_all_gather and x.fsdp and cfg.parallel.pp_schedule != "pipedream_2bw"):
        return 0.0
    return share.block_sharded / dims.tp if float8_modelled(t, args, x) else 0.0


def float8_modelled(t, args, x: MemoryInputs) -> bool:
    """Whether the step time models training.float8: dense blocks with plain attention and no LoRA (the runs it
    was fitted and checked on); MoE experts, MLA projections and adapters are estimated as bf16."""
    return t.float8 != "none" and not args.moe and not args.mla and not x.lora_base_bytes


def dense_blocks(args, layers: list[int]) -> int:
    """Of a MoE model's blocks ``layers``, those without routed experts (0 for a dense model)."""
    return sum(not args.moe_layer(i) for i in layers) if args.moe else 0


def rank_time(
    share,
    args,
    dims,
    x: MemoryInputs,
    cfg: Config,
    m: int,
    gpu: GPU,
    per_block: float = 0.0,
    ep_waits: float | None = None,
    ep_grad_rescale: bool = False,
) -> StepTime:
    """Seconds of one step on the rank of ``share``; ``per_block``: bytes one offloaded block parks on the host
    per micro-batch (training.activation_offload); ``ep_waits``: expert parallelism's host waits per MoE block and
    micro-batch (None: ``ep_host_waits``); ``ep_grad_rescale``: ``estimate``'s."""
    t, p = cfg.training, cfg.parallel
    peak = gpu.peak(t.dtype)
    eff = efficiency(args.dim, t.compile)
    tokens = x.micro_batch * t.seq_len / dims.cp  # per micro-batch on this rank
    rec_mm, rec_attn = recompute_share(t.activation_checkpointing, t.ac_every, args.n_layers)
    # the head's pass, again for each multi-token prediction module
    head = (1 + share.mtp) * args.vocab_size * args.dim if any(share.last) else 0
    blocks = share.layers + share.mtp  # each MTP module runs one more block
    # 2 FLOPs a weight and token for each forward (checkpointing reruns 3 x rec_mm of them: rec_mm is a share of
    # forward + backward), 2 for the input gradient, 2 for the weight gradient of a trained weight: under LoRA the
    # adapters' alone (the base and the head are frozen)
    adapters = x.adapters(share.layers) if x.lora_base_bytes else 0.0
    weights = share.active_matmul_params / dims.tp + adapters
    trained = adapters if x.lora_base_bytes else weights
    forwards = 1 + 3 * rec_mm
    block_mm = (2 * weights * forwards + 2 * weights + 2 * trained) * tokens
    frozen = 4 if x.lora_base_bytes else 6  # the head's FLOPs a weight and token
    head_dim = (
        args.head_dim + args.value_head_dim
    ) / 2  # scores over q/k's width, the sum over v's (MLA: apart)
    attention = (
        attention_flops(blocks, args.n_heads, head_dim, t.seq_len, tokens, args.sliding_window)
        / dims.tp
        * (1 + rec_attn)
    )
    rate = peak * attention_efficiency(args.head_dim, t.seq_len, priced_attention(cfg, args, gpu))
    compute_mb = (block_mm + frozen * head / dims.tp * tokens) / (peak * eff) + attention / rate
    if t.activation_checkpointing == "matmuls":  # the blocks' elementwise forward work again
        compute_mb += MATMULS_RERUN_SHARE * block_mm / (peak * eff)
    float8 = float8_gathered(cfg, args, share, dims, x)
    if float8_modelled(t, args, x):  # the block GEMMs faster, their inputs' and gradients' casts on top
        compute_mb -= block_mm / (peak * eff) * (1 - 1 / FLOAT8_GEMM_SPEEDUP)
        cast = FLOAT8_CAST_BYTES * share.layers * float8_cast_width(args) * tokens
        # gathered in float8: torchao's casts of the gathered weights at each use are gone (the fit holds them)
        cast -= FLOAT8_WEIGHT_CAST_BYTES * (forwards + 1) * float8
        compute_mb += cast / (COPY_HBM_SHARE * gpu.hbm_tbps * 1e12)
    if args.moe:
        moe_mb = moe_time_s(share, args, dims, tokens, t, gpu, x, ep_grad_rescale)
        compute_mb += moe_mb.extra_matmul / (peak * eff)
    # the method's models beyond the policy: one trained beside it does its work again; a frozen copy runs a
    # forward (2 FLOPs a weight and token; attention's forward is 1 of attention_flops' 3.5)
    forward = (2 * share.active_matmul_params + 2 * head) / dims.tp * tokens / (peak * eff) + attention / (
        3.5 * (1 + rec_attn) * rate
    )
    compute_mb = compute_mb * (1 + x.trained_copies) + x.frozen_copies * forward
    if x.lora_base_bytes:  # the adapters' memory-bound passes over each adapted linear's input and output
        width = x.block_adapted_split / dims.tp + x.block_adapted_whole
        passes = LORA_BYTES_PER_WIDTH * (1 + rec_mm) * share.layers * width * tokens
        compute_mb += passes / (COPY_HBM_SHARE * gpu.hbm_tbps * 1e12)
    if x.adapted_bytes != x.lora_base_bytes:  # QLoRA: the NF4 weights dequantized at each use
        adapted = share.layers * x.block_adapted / dims.tp
        dequant = (1 + forwards) * adapted * (x.adapted_bytes + 2)  # each forward and the input gradient
        compute_mb += dequant / (NF4_DEQUANT_HBM_SHARE * gpu.hbm_tbps * 1e12)
    st = StepTime(compute=m * compute_mb)
    if args.moe:
        st.moe = m * moe_mb.overhead + moe_mb.per_step
    if dims.pp > 1:
        bubble = theoretical_bubble(p.pp_schedule, dims.pp, m, stages_per_rank(p), t.steps)
        st.bubble = st.compute * bubble / (1 - bubble)
        act = tokens * args.dim * BYTES[t.dtype]
        st.pp = 2 * m * len(share.stages) * act / (_bandwidth(dims, ("pp",), gpu) * 1e9)
    # the parameters AdamW steps (a model trained beside the policy: as many again)
    own = (adapters if x.lora_base_bytes else held_params(share, x)) / x.shard * (1 + x.trained_copies)
    st.optimizer = (ADAMW_BYTES_PER_PARAM + GRAD_NORM_BYTES) * own / (ADAMW_HBM_SHARE * gpu.hbm_tbps * 1e12)
    st.fsdp = data_parallel_s(share, args, dims, x, compute_mb, m, gpu, float8)
    # the step on the host, and the copies over PCIe (counted as FSDP2's: they are its gathers)
    if x.cpu_offload:
        st.optimizer = host_step_s(own, m)
        st.fsdp += offload_copies_s(own, root_share(share, args, x), x, compute_mb, m, dims.world_size, gpu)
    if x.nvme:  # the moments read and written back, behind the chunks' compute
        st.optimizer = max(st.optimizer, nvme_step_s(own))
    st.offload = activation_copies_s(per_block * x.offload_blocks, compute_mb, m, gpu)
    c = BYTES[t.dtype]
    recomputed = t.activation_checkpointing == "full"
    if dims.tp > 1:
        per_block = (8 + (4 if recomputed else 0)) * collective_s(
            tokens * args.dim * c, dims.tp, _bandwidth(dims, ("tp",), gpu)
        )
        st.tp = m * blocks * per_block
    if dims.ep > 1:  # every routed token-slot to its expert's rank and back, forward and backward, exposed
        # each tp rank sends its sequence slice; with tensor-parallel experts, the tp group's gathered slots
        slots = tokens * args.moe_top_k * args.dim * c / (dims.tp // dims.etp)
        # an ep group: ep ranks of dp_shard x cp, with the tp ranks inside it (etp = 1) or tp apart (etp = tp)
        span = dims.ep * dims.etp
        bandwidth = gpu.network_gbps if span > gpu.gpus_per_node else gpu.link_gbps
        # a block recomputed in full exchanges its slots again (op-level checkpointing replays the saved exchange)
        rerun = exchange_rerun(t.activation_checkpointing, t.ac_every, args.n_layers)
        # the padded exchange: every slot of the rank to each ep rank, ep times the bytes and no host wait
        padded = p.ep_exchange == "padded"
        per_block = (4 + 2 * rerun) * collective_s(slots * (dims.ep if padded else 1), dims.ep, bandwidth)
        st.ep = m * share.moe_layers * per_block
        if ep_waits is None:
            ep_waits = 0.0 if padded else ep_host_waits(t.activation_checkpointing, t.ac_every, args.n_layers)
        st.host = ep_host_s(ep_waits, share.moe_layers, m)
    # tensor-parallel experts: the tp group's tokens gathered and the outputs reduce-scattered
    if dims.etp > 1:
        rerun = moe_rerun(
            t.activation_checkpointing, t.ac_every, args.n_layers
        )  # per block, forward and backward
        per_block = (4 + 2 * rerun) * collective_s(
            tokens * args.dim * c, dims.tp, _bandwidth(dims, ("tp",), gpu)
        )
        st.tp += m * share.moe_layers * per_block
    if dims.cp > 1:
        kv = x.micro_batch * t.seq_len * 2 * args.n_kv_heads * args.head_dim * c / dims.tp
        bandwidth = _bandwidth(dims, ("cp",), gpu)
        if x.cp_ring:
            block_attention = attention / rate / blocks
            per_block = ring_exposed_s(kv, c, dims.cp, bandwidth, block_attention, recomputed)
        else:
            per_block = (2 + (1 if recomputed else 0)) * collective_s(kv, dims.cp, bandwidth)
        st.cp = m * blocks * per_block
    return st


def ring_exposed_s(
    kv: float, dtype_bytes: int, cp: int, gbps: float, attention_s: float, recomputed: bool
) -> float:
    """Exposed seconds of one block's ring attention (parallel.cp_method = ring): forward sends cp - 1 K/V blocks
    of ``kv`` / cp bytes (``kv``: the whole sequence's K and V), backward cp - 1 again plus cp fp32 dK/dV
    accumulators, each hidden behind the block's attention (``attention_s``, forward + backward, split 1 : 2.5
    as ``attention_flops`` counts); a recomputed block runs its forward ring twice."""
    block = kv / cp / (gbps * 1e9)
    forward = (cp - 1) * block
    backward = (cp - 1) * block + cp * block * 4 / dtype_bytes
    fwd_s, bwd_s = attention_s / 3.5, attention_s * 2.5 / 3.5
    return (2 if recomputed else 1) * max(0.0, forward - fwd_s) + max(0.0, backward - bwd_s)


@dataclass
class MoETime:
    # FLOPs: the grouped GEMMs op-level checkpointing recomputes beyond rec_mm, and their part-filled tiles
    extra_matmul: float
    # seconds per micro-batch: weight casts (or FSDP2's copies), routing, expert parallelism's permutation
    overhead: float
    # seconds once per step: the expert-gradient rescale of older code under expert parallelism
    per_step: float = 0.0


def moe_rerun(ac: str, every: int, n_layers: int) -> float:
    """Share of MoE blocks whose forward reruns in the backward (op-level checkpointing reruns the MoE part of
    every block: under ``matmuls`` all but its grouped GEMMs)."""
    return 1.0 if ac in SELECTIVE_AC else 3 * recompute_share(ac, every, n_layers)[1]


def exchange_rerun(ac: str, every: int, n_layers: int) -> float:
    """Share of MoE blocks whose recomputation sends the slots through expert parallelism's all-to-alls again: those
    recomputed in full (full, every-k); op-level checkpointing saves the exchanges' outputs and replays them
    (loom.parallel.activation_checkpoint)."""
    return 0.0 if ac in SELECTIVE_AC else moe_rerun(ac, every, n_layers)


def ep_host_waits(ac: str, every: int, n_layers: int) -> float:
    """Expert parallelism's host waits per MoE block and micro-batch in loom's code: one in the forward, one more in a
    recomputation in full (op-level checkpointing's reads the forward's split lists: ExpertParallel.host_splits)."""
    return 1 + exchange_rerun(ac, every, n_layers)


def moe_time_s(
    share,
    args,
    dims,
    tokens: float,
    t,
    gpu: GPU,
    x: MemoryInputs | None = None,
    ep_grad_rescale: bool = False,
) -> MoETime:
    """One micro-batch's MoE terms on this rank (see loom.plan.timing's docstring). With tensor-parallel experts
    (etp = tp) a rank routes the tp group's gathered slots through a 1/tp slice of each of its experts. ``x``: the
    layout's memory inputs (FSDP2 on the experts: their copies replace the casts); ``ep_grad_rescale``: the
    expert-gradient rescale of older code, once a step."""
    ac, layers = t.activation_checkpointing, share.moe_layers
    rerun = moe_rerun(ac, t.ac_every, args.n_layers)
    slots = tokens * args.moe_top_k / (dims.tp // dims.etp)  # its sequence slice's slots, or the tp group's
    width = expert_params(args) / dims.etp  # of one expert, on this rank
    local = args.moe_experts * width / dims.ep
    c = BYTES[t.dtype]
    weight_bytes = None
    # FSDP2 shards the experts wherever it wraps the model, and on their own mesh under ep whatever the data-parallel
    # degrees (loom.parallel.parallelize: apply_fsdp_experts)
    if x is not None and (x.fsdp or dims.ep > 1) and not x.cpu_offload:
        # the experts' FSDP2 mesh: the ranks holding the same experts (edp) under ep, the block's otherwise
        shard = dims.edp if dims.ep > 1 else x.shard
        weight_bytes = fsdp_expert_bytes(shard, 2 if x.reshard_after_forward else 1, c, x.gather_fused)
    overhead = layers * moe_overhead_s(
        local, slots, args.dim, t.compile, rerun, gpu.hbm_tbps, weight_bytes=weight_bytes
    )
    per_step = 0.0
    if dims.ep > 1:
        # the slots a rank receives, permuted to its experts and back (older code: its experts' gradients rescaled)
        permute, rescale = ep_overhead_s(slots, args.dim, c, rerun, layers * local, gpu.hbm_tbps)
        overhead += layers * permute
        per_step = rescale if ep_grad_rescale else 0.0
    # op-level checkpointing keeps every other aten.mm (rec_mm = 1/6) but no grouped GEMM: they rerun in full;
    # ``matmuls`` keeps them all
    extra = 6 * width * slots * (1 / 3 - 1 / 6) * layers if ac == "op" else 0.0
    hidden = args.expert_ffn_dim / dims.etp
    grouped_rerun = 0.0 if ac == "matmuls" else rerun
    extra += layers * grouped_padding_flops(
        args.moe_experts / dims.ep, slots, args.dim, hidden, grouped_rerun
    )
    return MoETime(extra_matmul=extra, overhead=overhead, per_step=per_step)


# ---------------------------------------------------------------------------------------------- CPU offload
# parallel.cpu_offload (FSDP2's CPUOffloadPolicy): every rank's fp32 shards, their gradients and the AdamW moments
# live in host memory; each micro-batch copies the fp32 shards to the GPU (cast there to the compute dtype; twice
# per block with reshard_after_forward: forward and backward) and the fp32 gradient shards back. Assumptions, printed
# with each offload plan and measured by bench/offload.py:
# - host <-> GPU copies from pinned memory at PCIE_GBPS per direction: PCIe 5.0 x16 (H100, H200, B200 boards) moves
#   64 GB/s per direction at most, PCIe 4.0 x16 (A100) 32; a pinned copy reaches about 80% of that;
# - AdamW on the host (PyTorch's fused CPU kernel, 28 bytes a parameter like loom's GPU kernel) and, with
#   accumulation, each later micro-batch's gradient added on the host (12 bytes: two reads, a write) at HOST_GBPS;
#   the global norm (4 bytes a parameter, which also waits for the last gradients to reach the host) at
#   HOST_NORM_GBPS. Both fitted to one bench/offload.py run (docs/planner.md, CPU offload).
# - host memory: HOST_GIB_PER_GPU for each GPU's rank (a DGX H100's 2 TiB over its 8 GPUs); an offloaded layout
#   whose state needs more does not fit.
HOST_GIB_PER_GPU = 256.0
PCIE_GBPS = {"A100 SXM": 25.0}
PCIE_GBPS_DEFAULT = 50.0
HOST_GBPS = 150.0
HOST_NORM_GBPS = 12.0
HOST_ACCUMULATE_BYTES = 12


def pcie_gbps(gpu: GPU) -> float:
    return PCIE_GBPS.get(gpu.name, PCIE_GBPS_DEFAULT)


def offloaded_state(params: float, x: MemoryInputs) -> float:
    """Host bytes of one rank under cpu_offload: fp32 weights, gradients and AdamW moments of its shard (0 without;
    the moments not with optimizer.offload nvme: in files)."""
    return (8 if x.nvme else 16) * params / x.shard if x.cpu_offload else 0.0


def host_step_s(own: float, m: int) -> float:
    """Seconds of the optimizer step on the host for ``own`` parameters, with ``m`` micro-batches' gradients."""
    return (
        (ADAMW_BYTES_PER_PARAM + HOST_ACCUMULATE_BYTES * (m - 1)) / (HOST_GBPS * 1e9)
        + 4 / (HOST_NORM_GBPS * 1e9)
    ) * own


def offload_bytes(own: float, root: float, x: MemoryInputs) -> tuple[float, float]:
    """(host-to-GPU, GPU-to-host) bytes of one micro-batch on one rank of ``own`` parameters, ``root`` of them the
    root's (embeddings, final norm, head): fp32 shards in, the blocks' twice with reshard_after_forward (forward and
    backward; the root's stay gathered in between), fp32 gradients out."""
    gathers = 2 if x.reshard_after_forward else 1
    return 4 * ((own - root) * gathers + root), 4 * own


def root_share(share, args, x: MemoryInputs) -> float:
    """The root's parameters (embeddings, final norm, head) in one rank's shard."""
    return (share.params(x.tp) - share.blocks_params(x.tp)) / x.shard


def offload_copies_s(
    own: float, root: float, x: MemoryInputs, compute_mb: float, m: int, world: int, gpu: GPU
) -> float:
    """Exposed seconds of the host <-> GPU copies per step. On one rank FSDP2 copies the shards in on the compute
    stream (its 1-rank path gathers nothing, so the copy is not prefetched): exposed in full; the gradients go out
    on its reduction stream, behind the backward (two thirds of the compute). On more ranks the copies run on
    FSDP2's gather and reduction streams, behind compute like the collectives."""
    h2d, d2h = (b / (pcie_gbps(gpu) * 1e9) for b in offload_bytes(own, root, x))
    if world == 1:
        return m * (h2d + max(0.0, d2h - compute_mb * 2 / 3))
    return m * max(0.0, h2d + d2h - compute_mb)


def offload_note(host: float, shares, args, dims, x: MemoryInputs, gpu: GPU) -> str:
    """What an offloaded plan keeps on the host and moves over PCIe, with the assumptions it costs them at."""
    share = max(shares, key=lambda sh: held_params(sh, x))
    h2d, d2h = offload_bytes(held_params(share, x) / x.shard, root_share(share, args, x), x)
    per_node = min(gpu.gpus_per_node, dims.world_size)
    node = f" ({host * per_node / GIB:,.1f} GiB for {per_node} ranks on a node)" if per_node > 1 else ""
    kept = "weights and gradients (the moments in files)" if x.nvme else "weights, gradients and AdamW state"
    return (
        f"cpu_offload: {kept} in host memory, {host / GIB:,.1f} GiB per rank{node} "
        f"(assumed available: {HOST_GIB_PER_GPU:g} GiB per GPU); per micro-batch {h2d / 1e9:,.2f} GB to the GPU "
        f"and {d2h / 1e9:,.2f} GB back, at an assumed {pcie_gbps(gpu):g} GB/s per direction (PCIe; in 'fsdp'); "
        f"the step on the host at {HOST_GBPS:g} GB/s and its gradient norm at {HOST_NORM_GBPS:g} GB/s (fitted to "
        "one H100 host; in 'optimizer')"
    )


# --------------------------------------------------------------------------- activation offload, NVMe offload
# training.activation_offload: each offloaded block's saved tensors go to pinned host memory during its forward (a
# side stream, behind the next blocks' compute) and come back during the backward (prefetched one block ahead,
# behind the backward's compute), at the same PCIe rate as CPU offload's copies; the forward is a third of a
# micro-batch's compute, the backward two thirds. optimizer.offload nvme: the two AdamW moments (8 bytes a parameter)
# read from and written back to local NVMe each step at NVME_READ_GBPS / NVME_WRITE_GBPS (a PCIe 4.0 data-center
# drive's sequential rates), the chunks' compute and the host <-> GPU copies hidden behind the file IO.
NVME_READ_GBPS = 6.0
NVME_WRITE_GBPS = 3.0


def offload_block_bytes(profile, x: MemoryInputs, args, cfg: Config) -> float:
    """Bytes one offloaded block parks on the host per micro-batch: what it keeps for backward (with activation
    checkpointing, as traced: a recomputed block's input)."""
    if not x.offload_blocks:
        return 0.0
    t = cfg.training
    if t.activation_checkpointing in SELECTIVE_AC:
        # its input alone: what the op-level policy keeps stays on the device (loom.parallel.activation_offload);
        # the residual stream in the compute dtype under FSDP2 or from a LoRA base frozen in it (its embedding
        # too), fp32 under autocast
        tokens = x.micro_batch * x.seq_len / x.cp
        compute = x.fsdp or x.lora_base_bytes == 2
        return tokens * args.dim * (BYTES[x.dtype] if compute else 4) / x.tp
    stored = stored_blocks(t.activation_checkpointing, t.ac_every, args.n_layers)
    return stage_activation(profile, 1, False, x, args, t.activation_checkpointing, stored)


def activation_copies_s(nbytes: float, compute_mb: float, m: int, gpu: GPU) -> float:
    """Exposed seconds per step of ``nbytes`` per micro-batch copied out in the forward and back in the backward."""
    if not nbytes:
        return 0.0
    copy = nbytes / (pcie_gbps(gpu) * 1e9)
    return m * (max(0.0, copy - compute_mb / 3) + max(0.0, copy - compute_mb * 2 / 3))


def nvme_state(params: float, x: MemoryInputs) -> float:
    """Disk bytes of one rank under optimizer.offload nvme: the AdamW moments of its shard (0 without)."""
    return 8 * params / x.shard / x.optimizer_shard if x.nvme else 0.0


def nvme_step_s(own: float) -> float:
    """Seconds of reading and writing back ``own`` parameters' moments (the IO thread does one after the other)."""
    return 8 * own * (1 / (NVME_READ_GBPS * 1e9) + 1 / (NVME_WRITE_GBPS * 1e9))


def activation_offload_note(host: float, per_block: float, x: MemoryInputs, gpu: GPU) -> str:
    return (
        f"activation_offload: {x.offload_blocks} blocks' saved tensors on the host, {host / GIB:,.2f} GiB per "
        f"micro-batch ({per_block / GIB:,.2f} GiB a block; two blocks' worth stay on the GPU in flight), copied at "
        f"an assumed {pcie_gbps(gpu):g} GB/s per direction (PCIe; exposed part in 'offload')"
    )


def nvme_note(disk: float) -> str:
    return (
        f"optimizer.offload nvme: the AdamW moments in files, {disk / GIB:,.1f} GiB per rank on its disk, read at "
        f"an assumed {NVME_READ_GBPS:g} GB/s and written at {NVME_WRITE_GBPS:g} GB/s each step (in 'optimizer')"
    )


def data_parallel_s(
    share, args, dims, x: MemoryInputs, compute_mb: float, m: int, gpu: GPU, float8: float = 0.0
) -> float:
    """Exposed seconds of gradient / parameter communication per step; ``float8``: the parameters of those this
    rank holds that FSDP2 gathers in float8 (``float8_gathered``)."""
    params = held_params(share, x)
    # the parameters with gradients to reduce: LoRA's adapters alone; a model trained beside the policy's too
    trained = (x.adapters(share.layers) if x.lora_base_bytes else params) * (1 + x.trained_copies)
    params *= 1 + x.trained_copies
    c = BYTES[x.dtype]
    block = share.largest_block(dims.tp)
    if dims.fsdp_enabled:
        bw = _bandwidth(dims, ("dp_shard", "cp"), gpu)
        gathers = 2 if x.reshard_after_forward else 1
        r = x.reduce_bytes  # parallel.reduce_dtype
        # the embedding split by rows (parallel.fsdp_embedding vocab): no FSDP2 gather, reduction or copies of its
        # table; each micro-batch's token embeddings reduce-scattered at its forward's start and, where the table
        # trains (not under LoRA), their gradients all-gathered at its backward's end, where nothing hides them
        table = args.vocab_size * args.dim if x.vocab_split and any(share.first) else 0.0
        params -= table
        trained -= 0.0 if x.lora_base_bytes else table
        split = (1 if x.lora_base_bytes else 2) * collective_s(c * split_tokens(x) * args.dim, x.shard, bw)
        split = split if table else 0.0
        per_mb = collective_s(gathers * (c * (params - float8) + float8) + r * trained, x.shard, bw)
        if dims.dp_replicate > 1:  # HSDP: the shard's gradients all-reduced across replicas
            per_mb += 2 * collective_s(
                r * trained / x.shard, dims.dp_replicate, _bandwidth(dims, ("dp_replicate",), gpu)
            )
        # the first gather and the last reduction
        edges = collective_s((c + (r if not x.lora_base_bytes else 0)) * block, x.shard, bw)
        # FSDP2's copies around the collectives (the experts': with the MoE overhead, moe_time_s)
        experts = held_experts(share, x)
        gather, reduce = fsdp_copy_bytes(x.shard, gathers, c, r, x.gather_fused)
        gather8, cast8 = float8_gather_copy_bytes(x.shard, gathers)
        rate = COPY_HBM_SHARE * gpu.hbm_tbps * 1e12
        copies = (
            gather * (params - experts - float8) + gather8 * float8 + reduce * (trained - experts)
        ) / rate
        return m * (max(0.0, per_mb - compute_mb) + edges + copies + split) + cast8 * float8 / rate
    if dims.dp_replicate > 1:  # DDP or replicating FSDP2: all-reduce during the last backward
        bw = _bandwidth(dims, ("dp_replicate",), gpu)
        reduce = 2 * collective_s(4 * trained, dims.dp_replicate, bw)
        # ZeRO-1: each replica's updated fp32 parameters go to the others after the step (an all-gather's bytes)
        gather = collective_s(4 * trained, dims.dp_replicate, bw) if dims.shard_optimizer else 0.0
        hidden = compute_mb * 2 / 3
        if not dims.ddp_enabled or dims.replicate_with_fsdp:  # FSDP2 replicating (DiLoCo: its groups' own)
            return max(0.0, reduce - hidden) + 2 * collective_s(25 * 2**20, dims.dp_replicate, bw) + gather
        # DDP: the bucket reduced after the backward is the embedding's gradient, computed last (a bucket of its
        # own when larger than the cap) where this rank holds and trains it; each gradient is copied into its
        # bucket scaled by 1 / replicas (the reducer's mul_out)
        embedding = args.vocab_size * args.dim / dims.tp if any(share.first) and not x.lora_base_bytes else 0
        last = 2 * collective_s(max(4 * embedding, x.ddp_bucket_bytes), dims.dp_replicate, bw)
        copy = DDP_BUCKET_COPY_BYTES * trained / (COPY_HBM_SHARE * gpu.hbm_tbps * 1e12)
        return max(reduce - hidden, last) + copy + gather
    return 0.0


# ------------------------------------------------------------------------------------------------- search
def candidates(
    cfg: Config, world_size: int, max_tp: int, moe: bool = False, offload: bool = False
) -> list[Config]:
    """Every layout of ``world_size`` ranks with the config's global batch: degrees, pipeline schedule,
    micro-batch size, activation checkpointing, the ZeRO stage, under float8 tensorwise the float8 or bf16 gather
    and, for a MoE model (``moe``) under tp, replicated or tensor-parallel experts; with ``offload``, those that
    parallel.cpu_offload takes (tp = pp = 1), offloaded. Invalid ones are dropped later by ``estimate``."""
    out = []
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    for tp in (d for d in divisors if d <= (1 if offload else max_tp)):
        for pp in divisors if not offload else [1]:
            for cp in divisors:
                for rep in divisors:
                    rest = world_size // (tp * pp * cp * rep) if world_size % (tp * pp * cp * rep) == 0 else 0
                    if not rest:
                        continue
                    dp = rep * rest
                    if cfg.training.global_batch_size % dp:
                        continue
                    local = cfg.training.global_batch_size // dp
                    schedules = (
                        sorted({cfg.parallel.pp_schedule, "1f1b", "interleaved_1f1b"})
                        if pp > 1
                        else [cfg.parallel.pp_schedule]
                    )
                    for mb in (d for d in range(1, local + 1) if local % d == 0):
                        for ac in ("none", "matmuls", "op", "full"):
                            for schedule in schedules:
                                c = copy.deepcopy(cfg)
                                c.parallel.tp, c.parallel.pp, c.parallel.cp = tp, pp, cp
                                c.parallel.dp_replicate, c.parallel.dp_shard = rep, rest
                                c.parallel.pp_schedule = schedule
                                c.parallel.pp_virtual_stages = 0
                                c.parallel.etp = 1
                                c.parallel.cpu_offload = offload
                                # the degrees above decide; the stages are variants below
                                c.parallel.zero = -1
                                c.training.micro_batch_size = mb
                                c.training.activation_checkpointing = ac
                                out.append(c)
                                if moe and tp > 1:  # tensor-parallel experts
                                    e = copy.deepcopy(c)
                                    e.parallel.etp = tp
                                    out.append(e)
                                out.extend(zero_variants(c))
    return [v for c in out for v in float8_gather_variants(c)]


def float8_gather_variants(c: Config) -> list[Config]:
    """Under float8 tensorwise, a layout FSDP2 shards both ways: gathering its weights in float8 and in bf16
    (training.float8_all_gather); one that shards nothing gathers none in float8."""
    t, p = c.training, c.parallel
    if t.float8 != "tensorwise":
        return [c]
    off = copy.deepcopy(c)
    off.training.float8_all_gather = False
    if p.dp_shard * p.cp == 1 or p.cpu_offload or p.pp_schedule == "pipedream_2bw":
        return [off]
    on = copy.deepcopy(c)
    on.training.float8_all_gather = True
    return [off, on]


def zero_variants(c: Config) -> list[Config]:
    """The other ZeRO stage of a data-parallel layout without tp / pp / cp / offload: ZeRO-1 beside DDP (zero 0),
    the other of ZeRO-2 / ZeRO-3 beside FSDP2."""
    p = c.parallel
    if p.tp > 1 or p.pp > 1 or p.cp > 1 or p.cpu_offload or p.dp_replicate * p.dp_shard == 1:
        return []
    z = copy.deepcopy(c)
    if p.dp_shard == 1:
        z.parallel.zero = 1
    else:
        z.parallel.reshard_after_forward = not p.reshard_after_forward
    return [z]


def search(
    cfg: Config,
    world_size: int,
    gpu: GPU,
    top: int = 10,
    margin_gib: float | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> tuple[list[Estimate], int]:
    """The ``top`` fastest layouts that fit in memory less ``margin_gib`` (``estimate``'s default), fastest first,
    and how many layouts were valid. Where none fits with the state on the GPUs, the layouts of parallel.cpu_offload
    are searched next (weights, gradients and AdamW state in host memory: slower, but the GPU holds only the working
    blocks). ``progress(done, total, valid)`` is called after every candidate."""
    profiles: dict = {}
    fitting, valid = [], 0
    try:
        moe = model_args(cfg).moe
    except ConfigError:  # the model itself is refused: every candidate will be too
        moe = False
    layouts = candidates(cfg, world_size, max_tp=gpu.gpus_per_node, moe=moe)
    done = 0
    for offload in (False, True):
        if offload:
            if fitting:
                break
            layouts += candidates(cfg, world_size, max_tp=1, moe=moe, offload=True)
        for c in layouts[done:]:
            done += 1
            try:
                est = estimate(c, world_size, gpu, profiles, margin_gib)
            except ConfigError:
                est = None
            if est is not None:
                valid += 1
                if est.fits:
                    fitting.append(est)
            if progress is not None:
                progress(done, len(layouts), valid)
    fitting.sort(key=lambda e: -e.tokens_per_s_per_gpu)
    return fitting[:top], valid
