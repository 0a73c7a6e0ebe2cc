"""Apply parallelism to a plain Llama, in loom's one composition order:

1. build on the meta device (caller); LoRA adapters put on it (caller: loom.models.common.lora.apply_lora), so every
   step below treats them with their base linear
2. pipeline split: one pruned copy of the model per local stage      (parallel.pp)
   (parameter names unchanged)
3. tensor + sequence parallel on each part                           (parallel.tp)
   context parallel: attention across the cp ranks' sequence shards  (parallel.cp)
   expert parallel: MoE experts split over the ep ranks               (parallel.ep)
   (experts sharded over tp by their hidden width                    (parallel.etp = tp))
   float8 linears (torchao)                                          (training.float8)
4. activation checkpointing; activation offload around the chosen blocks      (training.activation_offload)
5. torch.compile per block
6. FSDP2 / HSDP (on meta; the shard axis is dp_shard x cp; under ep the experts first, over edp); with
   parallel.cpu_offload the shards, their gradients and the optimizer state live on the host, and FSDP2 wraps a
   single rank too (a 1-rank mesh: only the working blocks' parameters come to the device)
7. materialize + layout-independent init (each parameter drawn on its full shape from a seed of its name,
   then sharded; LoRA adapters as PEFT draws them)
8. DDP (needs real storage: it broadcasts from rank 0 at construction); under TP or PP, replication goes
   through FSDP2 on a (dp_replicate, 1) mesh instead (step 6): see ``ParallelDims.replicate_with_fsdp``.
   Under DiLoCo (parallel.diloco_inner_steps) neither: each dp_replicate group keeps its own weights and
   loom.train.diloco averages them every H steps

Every step takes the parts and the mesh it needs from ``ParallelDims``. The model's code stays single-device:
steps 3 swap parameters for DTensors and add input/output hooks (``parallelize_module``), and fill the two
extension points the model leaves, each module's ``Attention.context`` (context parallel:
``loom.parallel.context_parallel.ContextParallel``) and each MoE block's ``MoE.parallel`` (tp, cp, ep, etp:
``loom.parallel.expert_parallel.MoEParallel``); steps 4-8 wrap modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loom.config.sections import ParallelConfig, TrainingConfig
from loom.models.common.float8 import apply_float8
from loom.models.common.init import materialize
from loom.models.common.lora import init_adapters
from loom.models.llama.model import Llama
from loom.numerics import DTYPES
from loom.parallel.activation_checkpoint import apply_activation_checkpointing
from loom.parallel.activation_offload import apply_activation_offload
from loom.parallel.compile import apply_compile
from loom.parallel.context_parallel import apply_context_parallel
from loom.parallel.data_parallel import apply_ddp, apply_fsdp, apply_fsdp_experts
from loom.parallel.dims import ParallelDims
from loom.parallel.expert_parallel import apply_expert_parallel
from loom.parallel.pipeline import (
    SPLIT_BACKWARD,
    PipelinePlan,
    build_stage,
    split_layers,
    stage_ids,
    stages_per_rank,
)
from loom.parallel.shards import keep_shard
from loom.parallel.tensor_parallel import apply_tp


@dataclass
class ParallelModel:
    """``parts``: this rank's model pieces (the whole model, or its pipeline stages), sharded in place;
    ``modules``: what runs forward (a DDP wrapper around a part, or the part); ``plan``: the pipeline."""

    parts: list[nn.Module]
    modules: list[nn.Module]
    plan: PipelinePlan | None = None


def pipeline_plan(model: Llama, dims: ParallelDims, parallel: ParallelConfig, seq_len: int) -> PipelinePlan:
    per_rank = stages_per_rank(parallel)
    layers = split_layers(model.args, dims.pp * per_rank, seq_len, parallel.pp_layers_per_stage or None)
    local = stage_ids(dims.pp_rank(), dims.pp, per_rank, parallel.pp_schedule)
    return PipelinePlan(parallel.pp_schedule, dims.pp, per_rank, layers, local)


def split_pipeline(model: Llama, plan: PipelinePlan) -> list[Llama]:
    last = plan.n_stages - 1
    return [build_stage(model, plan.layers[s], first=s == 0, last=s == last) for s in plan.local]


def fsdp_reshard_after_forward(dims: ParallelDims, plan) -> bool:
    """``parallel.reshard_after_forward`` (as parallel.zero sets it: ``ParallelDims``), except under a pipeline schedule that splits input and weight
    gradients: its weight pass reads the gathered parameters after the input pass has run FSDP's backward
    hooks, so blocks keep their parameters gathered from forward to the step's gradient reduction (ZeRO-2
    within the stage; resharding there gave wrong gradients: 1e-2 off from the second step)."""
    split = plan is not None and plan.schedule in SPLIT_BACKWARD
    return dims.reshard_after_forward and not split


def fsdp_wraps(dims: ParallelDims, parallel: ParallelConfig) -> bool:
    """Whether FSDP2 wraps the model: it shards (dp_shard x cp > 1), replicates TP / PP parameters, or offloads
    them to the host (parallel.cpu_offload, on any number of ranks; loom.resolve refuses the layouts it cannot)."""
    return dims.fsdp_applied or parallel.cpu_offload


def explicit_prefetch(setting: str, dims: ParallelDims) -> bool:
    """``parallel.fsdp_prefetch``: ``auto`` prefetches explicitly under expert parallelism only (measured there,
    docs/benchmarks.md)."""
    return dims.ep_enabled if setting == "auto" else setting == "explicit"


def parallelize_llama(
    model: Llama,
    dims: ParallelDims,
    training: TrainingConfig,
    parallel: ParallelConfig,
    device: torch.device,
    seed: int,
) -> ParallelModel:
    plan = pipeline_plan(model, dims, parallel, training.seq_len) if dims.pp_enabled else None
    parts = split_pipeline(model, plan) if plan else [model]
    for part in parts:
        if dims.tp_enabled:
            apply_tp(
                part,
                dims["tp"],
                loss_parallel=parallel.loss_parallel,
                async_tp=parallel.async_tp,
                expert_parallel=dims.ep_enabled,
                expert_tp=dims.etp_enabled,
            )
        if dims.cp_enabled:
            apply_context_parallel(part, dims["cp"], parallel.cp_method)
        if dims.ep_enabled:
            apply_expert_parallel(
                part, dims["ep"], dims["ep_tp"] if dims.etp_enabled else None, parallel.ep_exchange
            )
        if training.float8 != "none":
            apply_float8(part, training.float8, training.float8_all_gather, shards=dims.dp_shard * dims.cp)
        apply_activation_checkpointing(part.layers, training.activation_checkpointing, training.ac_every)
        apply_activation_offload(part, training.activation_offload, device)  # around the checkpoints
        if training.compile:
            # recompute-everything checkpointing outside the compiled block under TP and with FlexAttention,
            # where compiling it inside fails (docs/parallelism.md, docs/kernels.md)
            apply_compile(
                part.layers,
                inside_checkpoint=(dims.tp_enabled or model.args.attention == "flex")
                and training.activation_checkpointing in ("full", "every_k"),
                cuda_graphs=training.cuda_graphs,
                counts_loads=model.args.moe_bias_speed > 0,
            )
        if dims.ep_enabled:
            apply_fsdp_experts(
                part,
                dims["experts_dp"],
                compute_dtype=DTYPES[training.dtype],
                reshard_after_forward=fsdp_reshard_after_forward(dims, plan),
                cpu_offload=parallel.cpu_offload,
                reduce_dtype=DTYPES[parallel.reduce_dtype],
                grad_factor=dims.expert_grad_factor,
            )
        if fsdp_wraps(dims, parallel):
            # under DiLoCo each dp_replicate group shards on its own: no gradient reduction across groups
            mesh = dims["dp_replicate", "dp_shard_cp"] if dims.replicate_reduces else dims["dp_shard_cp"]
            apply_fsdp(
                part,
                list(part.layers.values()),
                mesh,
                compute_dtype=DTYPES[training.dtype],
                reshard_after_forward=fsdp_reshard_after_forward(dims, plan),
                cpu_offload=parallel.cpu_offload,
                explicit_prefetch=explicit_prefetch(parallel.fsdp_prefetch, dims),
                reduce_dtype=DTYPES[parallel.reduce_dtype],
                symm_mem=parallel.fsdp_symm_mem,
                grad_copy=parallel.fsdp_grad_copy,
                device=device,
                # resolved for the model by the engine (loom.parallel.vocab_embedding_rules.fsdp_embedding)
                vocab_embedding=parallel.fsdp_embedding == "vocab",
                gather_copy=parallel.fsdp_gather_copy,
            )
        init_device = torch.device("cpu") if parallel.cpu_offload else device
        # drawn where compute runs (the same values with the state in host memory), stored on init_device
        materialize(
            part, init_device, seed, part.param_std, part.init_buffers, draw_device=device, keep=keep_shard
        )
        init_adapters(part, seed, draw_device=device, keep=keep_shard)
        if parallel.cpu_offload:
            part.init_buffers(device)  # buffers are not offloaded: they live where compute runs
    modules = parts
    if dims.ddp_enabled and not dims.replicate_with_fsdp:
        assert not parallel.cpu_offload, "loom.resolve refuses cpu_offload without sharding over replicas"
        modules = [apply_ddp(part, dims["dp_replicate"], bucket_mb=parallel.ddp_bucket_mb) for part in parts]
    return ParallelModel(parts, modules, plan)
