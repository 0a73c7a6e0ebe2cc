"""One place that resolves a run: a ``Config``, a world size and the tokenizer become the parallel degrees, the
accumulation count, the device, the model's shape and its kernels (loom.kernels.dispatch chooses them). The
resolver is a driver: the generic rules (degrees, accumulation, device, the model's shape) live here, then it runs
the rule sets it is handed: each optional feature's (``FEATURES``, each in the feature's own module) and the
training methods'. A single field's rules stay in its config section. ``loom train`` (its precheck and the
Trainer), ``loom plan`` and ``loom convert`` all resolve through here. ``loom train`` resolves once, in the launching
process, and hands its workers the result (``Resolved``, ``handing``, ``handed``): a worker resolves nothing
again."""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from loom.config.errors import ConfigError
from loom.config.load import profile_window
from loom.config.sections import Config, ParallelConfig, check_inactive_fields
from loom.models.common.lora_rules import RULES as LORA
from loom.parallel.cuda_graphs_rules import RULES as CUDA_GRAPHS
from loom.parallel.dims import ParallelDims, tp_limit
from loom.parallel.grad_copy_rules import RULES as GRAD_COPY
from loom.parallel.offload_rules import RULES as OFFLOAD
from loom.parallel.pipedream_rules import RULES as PIPEDREAM
from loom.parallel.pipeline import SINGLE_STAGE, SPLIT_BACKWARD, V_SHAPED, stages_per_rank
from loom.parallel.symm_mem_rules import RULES as SYMM_MEM
from loom.parallel.vocab_embedding_rules import RULES as VOCAB_EMBEDDING
from loom.parallel.vocab_embedding_rules import model_refusal
from loom.runtime.fault_tolerance import replica_groups
from loom.runtime.fault_tolerance_rules import RULES as FAULT_TOLERANCE
from loom.train.diloco_rules import RULES as DILOCO
from loom.train.zero_rules import RULES as ZERO

# the optional features' rule sets, run in this order at each stage (config, layout, machine, device): which of
# two broken rules is named first stays as it was
FEATURES = (
    ZERO,
    OFFLOAD,
    CUDA_GRAPHS,
    FAULT_TOLERANCE,
    DILOCO,
    PIPEDREAM,
    LORA,
    SYMM_MEM,
    GRAD_COPY,
    VOCAB_EMBEDDING,
)


@dataclass(frozen=True)
class Run:
    """A resolved run. ``model_args`` carries the kernels (``kernels``) and is None until a tokenizer is given."""

    cfg: Config
    dims: ParallelDims
    accum: int  # micro-batches per rank per optimizer step
    device: str  # "cuda" | "cpu"
    model_args: object = None
    kernels: object = None
    triton: bool | None = (
        None  # whether Triton is there (None: look; the planner assumes a GPU machine with it)
    )

    def with_model(self, tokenizer) -> Run:
        """The model's shape and kernels (chosen without timing) for this tokenizer, checked against the degrees."""
        kernels = model_kernels(self.cfg, self.device, triton=self.triton)
        args = resolve_model_args(self.cfg, tokenizer, kernels)
        check_model(self.dims, args, self.cfg.parallel)
        return replace(self, model_args=args, kernels=kernels)

    def with_attention(self, measure: Callable[[], str]) -> Run:
        """``model.attention = auto`` settled by timing the candidates (``measure`` names the faster)."""
        kernels = model_kernels(self.cfg, self.device, measure, self.triton, self.model_args.sliding_window)
        return replace(self, kernels=kernels, model_args=self.model_args.with_(**kernels.as_args()))


def resolve(
    cfg: Config,
    world_size: int,
    tokenizer=None,
    *,
    rules: Sequence[Callable[[Config], None]] = (),
    device: str | None = None,
    triton: bool | None = None,
) -> Run:
    """Check ``cfg`` for ``world_size`` ranks (and, given the tokenizer, the model's shape) and resolve it.
    ``device``: the device type to resolve kernels for (default: the run's, from run.device and this machine, whose
    installed packages are then checked too); ``triton``: whether Triton is installed there (None: look here).
    ``rules``: the chosen method's (loom.methods.rules_of hands them)."""
    check_config(cfg, rules)
    dims = ParallelDims.from_config(
        cfg.parallel, world_size
    )  # parallel.zero mapped there (dims.zero_degrees)
    for feature in FEATURES:
        if feature.layout is not None:
            feature.layout(cfg, dims)
    check_mpi_layout(cfg, dims)
    t = cfg.training
    if cfg.parallel.reduce_dtype != "float32" and not (dims.fsdp_enabled or dims.replicate_with_fsdp):
        raise ConfigError(
            "parallel.reduce_dtype",
            cfg.parallel.reduce_dtype,
            f"sets FSDP2's reduction, and this layout has none (dp_shard {dims.dp_shard}, dp_replicate "
            f"{dims.dp_replicate} on {world_size} ranks: DDP or one replica): allowed float32 here",
        )
    if t.float8_all_gather and not dims.fsdp_enabled:
        raise ConfigError(
            "training.float8_all_gather",
            True,
            f"gathers FSDP2's weights, and this layout shards none (dp_shard {dims.dp_shard} x cp {dims.cp} on "
            f"{world_size} ranks): allowed false here",
        )
    accum = accumulation_steps(
        t, dims.dp_size * replica_groups(cfg.parallel)
    )  # the groups split each global batch
    check_microbatches(dims, accum, cfg.parallel, t.global_batch_size)
    check_noise_scale(cfg, dims, accum)
    if device is None:  # this machine's (the planner names a device it does not have)
        device = run_device(cfg)
        check_machine(cfg, device)
    run = Run(cfg, dims, accum, device, triton=triton)
    return run if tokenizer is None else run.with_model(tokenizer)


# ---- rules over the config alone -----------------------------------------------------


def check_config(cfg: Config, rules: Sequence[Callable[[Config], None]] = ()) -> None:
    """Rules that relate fields of the config (no world size, model or device needed); ``rules``: the chosen
    method's, run after the features' (loom.methods hands them)."""
    if cfg.model.init_from and cfg.model.n_layers:
        raise ConfigError(
            "model.n_layers",
            cfg.model.n_layers,
            "must be 0 with model.init_from (the checkpoint fixes the layer count)",
        )
    t = cfg.training
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            "training.global_batch_size",
            t.global_batch_size,
            f"must be a multiple of training.micro_batch_size ({t.micro_batch_size})",
        )
    if t.eval_every and cfg.data.val_fraction == 0:
        raise ConfigError(
            "training.eval_every",
            t.eval_every,
            "needs held-out data, but data.val_fraction is 0: "
            "set data.val_fraction > 0 (e.g. 0.01) or training.eval_every 0",
        )
    if (t.eval_hook or t.eval_tasks) and (cfg.parallel.pp > 1 or cfg.parallel.cp > 1):
        field = "training.eval_hook" if t.eval_hook else "training.eval_tasks"
        raise ConfigError(
            field,
            t.eval_hook or t.eval_tasks,
            "runs on the whole model: not with parallel.pp > 1 or "
            "parallel.cp > 1 (evaluate the checkpoints with `loom eval`)",
        )
    check_parallel_fields(cfg)
    for feature in FEATURES:
        if feature.config is not None:
            feature.config(cfg)
    for rule in rules:
        rule(cfg)
    check_inactive_fields(cfg)  # after the rules above, whose messages are more specific
    if cfg.optimizer.warmup_steps > t.steps:
        raise ConfigError(
            "optimizer.warmup_steps", cfg.optimizer.warmup_steps, f"must be <= training.steps ({t.steps})"
        )
    window = profile_window(cfg.metrics)
    if window and window[1] > t.steps:
        raise ConfigError(
            "metrics.profile_steps",
            cfg.metrics.profile_steps,
            f"the last profiled step must be <= training.steps ({t.steps})",
        )


def check_parallel_fields(cfg: Config) -> None:
    """Parallel options that contradict each other or the training and model sections."""
    p, t = cfg.parallel, cfg.training
    v = stages_per_rank(p)
    if p.pp_schedule in SINGLE_STAGE and v != 1:
        raise ConfigError(
            "parallel.pp_virtual_stages",
            p.pp_virtual_stages,
            f"pp_schedule {p.pp_schedule} runs one stage per rank: allowed 0 or 1 "
            "(interleaved_1f1b, looped_bfs, interleaved_zb, zbv, dualpipev run several)",
        )
    if p.pp_schedule in V_SHAPED and v != 2:
        raise ConfigError(
            "parallel.pp_virtual_stages",
            p.pp_virtual_stages,
            f"pp_schedule {p.pp_schedule} is V-shaped: exactly 2 stages per rank (allowed 0 or 2)",
        )
    split = p.pp_layers_per_stage
    if split:
        if len(split) != p.pp * v:
            raise ConfigError(
                "parallel.pp_layers_per_stage",
                split,
                f"expected one entry per pipeline stage: pp x stages per rank = {p.pp} x {v} = {p.pp * v}",
            )
        empty = next((s for s, n in enumerate(split) if n == 0 and 0 < s < len(split) - 1), None)
        if empty is not None:
            raise ConfigError(
                "parallel.pp_layers_per_stage",
                split,
                f"stage {empty} would hold nothing (no layer, no embedding, no head)",
            )
    if p.pp > 1 and t.compile and p.pp_schedule in SPLIT_BACKWARD:
        raise ConfigError(
            "parallel.pp_schedule",
            p.pp_schedule,
            "splits input and weight gradients, which torch.compile does not support: set "
            "training.compile false or use gpipe | 1f1b | interleaved_1f1b | looped_bfs",
        )
    if p.async_tp and p.tp == 1:
        raise ConfigError("parallel.async_tp", True, "needs parallel.tp > 1")
    if p.async_tp and not t.compile:
        raise ConfigError(
            "parallel.async_tp", True, "needs training.compile true (the pass runs in the compiler)"
        )
    if p.cp > 1:
        if t.seq_len % (2 * p.cp):
            raise ConfigError(
                "parallel.cp",
                p.cp,
                f"training.seq_len {t.seq_len} must split into 2 x cp = {2 * p.cp} "
                "equal chunks (each cp rank holds two: balanced causal work)",
            )
    if p.cpu_offload and (p.tp > 1 or p.pp > 1):
        raise ConfigError("parallel.cpu_offload", True, "supported with data parallelism only (tp = pp = 1)")
    if p.cpu_offload and p.backend == "nccl":
        raise ConfigError(
            "parallel.backend",
            "nccl",
            "parallel.cpu_offload keeps the gradients on the host, which "
            "NCCL cannot reduce: allowed auto (cuda:nccl,cpu:gloo on GPUs) | gloo",
        )
    if t.float8 != "none" and p.tp > 1:
        raise ConfigError(
            "training.float8",
            t.float8,
            "not with parallel.tp > 1: float8 under TP needs torchao's float8 sharding plans in place of "
            "loom's, not built because gloo (the CPU ranks loom's TP tests run on) refuses float8 "
            "collectives: allowed none there",
        )
    if p.reduce_dtype != "float32" and (t.dtype != "bfloat16" or p.cpu_offload):
        raise ConfigError(
            "parallel.reduce_dtype",
            p.reduce_dtype,
            f"reduces bf16 compute's gradients under FSDP2: needs training.dtype bfloat16 (got {t.dtype}) and no "
            "parallel.cpu_offload; allowed float32 otherwise",
        )
    if t.float8_all_gather and (t.float8 != "tensorwise" or p.cpu_offload):
        raise ConfigError(
            "training.float8_all_gather",
            True,
            f"gathers float8 weights under FSDP2: needs training.float8 tensorwise (got {t.float8}) and no "
            "parallel.cpu_offload (its weights are gathered from the host); allowed false otherwise",
        )
    if t.float8 != "none" and t.dtype != "bfloat16":
        raise ConfigError("training.float8", t.float8, f"needs training.dtype bfloat16 (got {t.dtype})")
    if cfg.model.fused_norm == "true" and p.tp > 1:
        raise ConfigError(
            "model.fused_norm",
            True,
            "not supported with parallel.tp > 1 (sequence-parallel norms run "
            "on DTensors): allowed auto | false there",
        )
    if cfg.model.fused_loss == "true" and (p.tp > 1 or p.pp > 1):
        raise ConfigError(
            "model.fused_loss",
            True,
            "not supported with parallel.tp > 1 or parallel.pp > 1 (vocab-"
            "sharded or stage-split output): allowed auto | false there",
        )


# ---- rules that need the world size ---------------------------------------------------


def check_mpi_layout(cfg: Config, dims: ParallelDims) -> None:
    """parallel.backend = mpi runs data-parallel replicas (DDP: all-reduce and broadcast) only: PyTorch's MPI
    process group has no reduce-scatter, which FSDP, ZeRO and sequence-parallel tensor parallelism need, and the
    other layouts are not tested on it."""
    if cfg.parallel.backend != "mpi":
        return
    used = {n: getattr(dims, n) for n in ("dp_shard", "tp", "pp", "cp", "ep") if getattr(dims, n) > 1}
    if used or cfg.parallel.cpu_offload:
        what = ", ".join(f"{n} = {v}" for n, v in used.items()) or "cpu_offload = true"
        raise ConfigError(
            "parallel.backend",
            "mpi",
            f"runs data-parallel replicas only (parallel.dp_replicate = world, dp_shard = 1; PyTorch's MPI group "
            f"has no reduce-scatter), and this layout has {what}: use auto | nccl | gloo with mpirun's ranks",
        )


def accumulation_steps(training, dp_size: int) -> int:
    """Micro-batches per rank per optimizer step, or a ConfigError when the global batch does not split."""
    per_pass = training.micro_batch_size * dp_size
    if training.global_batch_size % per_pass:
        raise ConfigError(
            "training.global_batch_size",
            training.global_batch_size,
            f"must be a multiple of micro_batch_size x data-parallel size = "
            f"{training.micro_batch_size} x {dp_size} = {per_pass}",
        )
    return training.global_batch_size // per_pass


def check_noise_scale(cfg: Config, dims: ParallelDims, accum: int) -> None:
    """metrics.noise_scale reads the gradient between a step's first micro-batch and the rest
    (loom.train.noise_scale): a pipeline schedule runs them together, and under expert parallelism the experts'
    gradients reduce over another group of ranks than the rest (the estimate is not built for that)."""
    if not cfg.metrics.noise_scale:
        return
    if dims.pp_enabled or dims.ep_enabled:
        raise ConfigError("metrics.noise_scale", True, "needs parallel.pp = 1 and parallel.ep = 1")
    if accum < 2:
        raise ConfigError(
            "metrics.noise_scale",
            True,
            f"needs 2 or more micro-batches per step on each rank (this "
            f"run has {accum}: training.global_batch_size / (micro_batch_size x {dims.dp_size} "
            "data-parallel ranks))",
        )


def check_microbatches(dims: ParallelDims, n: int, parallel: ParallelConfig, global_batch: int) -> None:
    """The pipeline's micro-batch count (the accumulation count) against what the schedule needs (validation runs
    whole schedule runs of ``n`` micro-batches: training.eval_batches counts global batches)."""
    if dims.pp == 1:
        return
    v_shaped = parallel.pp_schedule in V_SHAPED
    need, rule = (2 * dims.pp, "2 x pp") if v_shaped else (dims.pp, "pp")
    if n < need:
        raise ConfigError(
            "training.global_batch_size",
            global_batch,
            f"pp_schedule {parallel.pp_schedule} needs at least {rule} = {need} micro-batches per "
            f"step; global_batch_size / (micro_batch_size x data-parallel size) = {n}",
        )
    rounds = max(1, n // dims.pp)
    if parallel.pp_schedule in ("interleaved_1f1b", "interleaved_zb") and n % rounds:
        raise ConfigError(
            "training.global_batch_size",
            global_batch,
            f"pp_schedule {parallel.pp_schedule} needs the micro-batch count ({n}) to be a multiple "
            f"of its rounds (micro-batches // pp = {rounds})",
        )


# ---- the device -----------------------------------------------------------------------


def run_device(cfg: Config) -> str:
    """The device type this run trains on: run.device, ``auto`` meaning CUDA where this machine has it."""
    import torch

    return (
        "cuda"
        if cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )


def check_machine(cfg: Config, device: str) -> None:
    """What the run needs installed, or of its device type, wherever it runs."""
    if cfg.parallel.backend == "mpi":
        from loom.runtime.env import check_mpi

        check_mpi()
    if not cfg.metrics.profile_host and device != "cuda":
        raise ConfigError(
            "metrics.profile_host",
            False,
            f"records the GPU's activity alone, and this run is on the {device}: allowed true here",
        )
    if cfg.parallel.async_tp and device != "cuda":
        raise ConfigError("parallel.async_tp", True, "needs CUDA devices (symmetric memory)")
    for feature in FEATURES:
        if feature.machine is not None:
            feature.machine(cfg, device)
    if cfg.training.float8 != "none":
        from loom.models.common.float8 import float8_available

        if not float8_available():
            raise ConfigError(
                "training.float8",
                cfg.training.float8,
                "needs the 'torchao' package (pip install 'loom-train[float8]'); allowed without it: none",
            )


def check_device(cfg: Config) -> None:
    """What the config asks of this machine's GPUs (the CLI checks it once, before any worker starts; the Python
    API lets float8 run emulated on the CPU)."""
    import torch

    cuda = torch.cuda.is_available()
    if cfg.run.device == "cuda" and not cuda:
        raise ConfigError("run.device", "cuda", "no CUDA device is visible; allowed here: auto | cpu")
    device = run_device(cfg)
    if cfg.parallel.backend == "nccl" and device != "cuda":
        raise ConfigError(
            "parallel.backend",
            "nccl",
            "needs CUDA devices and this run is on the CPU"
            f"{'' if cuda else ' (no CUDA device is visible)'}: allowed auto | gloo",
        )
    for feature in FEATURES:
        if feature.device is not None:
            feature.device(cfg, device)
    t = cfg.training
    if t.float8 != "none" and (device != "cuda" or torch.cuda.get_device_capability(0) < (8, 9)):
        where = "this run is on the CPU" if device != "cuda" else f"{torch.cuda.get_device_name(0)} is older"
        raise ConfigError(
            "training.float8",
            t.float8,
            f"float8 matmuls need a CUDA GPU of compute capability 8.9 or "
            f"newer (Ada, Hopper) and {where}: allowed none",
        )


# ---- the model and its kernels ----------------------------------------------------------


def resolve_model_args(cfg: Config, tokenizer, kernels=None):
    """Flavor shape (or model.init_from's) + vocabulary (flavor, then model.vocab_size, else the tokenizer's rounded
    to 128) + the sliding window (model.sliding_window, else the flavor's or the folder's) + ``kernels``, by default
    those ``model_kernels`` picks without measuring."""
    from loom.models.llama import round_vocab
    from loom.models.registry import all_flavors

    if cfg.model.init_from:
        from loom.checkpoint.hf.reader import llama_args_from_hf

        args = llama_args_from_hf(cfg.model.init_from)
        if cfg.model.moe_experts and cfg.model.moe_experts != args.moe_experts:
            held = f"{args.moe_experts} experts" if args.moe else "a dense model"
            raise ConfigError(
                "model.moe_experts",
                cfg.model.moe_experts,
                f"model.init_from {cfg.model.init_from} holds {held}: allowed 0 (the folder's)",
            )
        if args.moe and cfg.model.moe_ffn_dim and cfg.model.moe_ffn_dim != args.expert_ffn_dim:
            raise ConfigError(
                "model.moe_ffn_dim",
                cfg.model.moe_ffn_dim,
                f"model.init_from {cfg.model.init_from} "
                f"has experts {args.expert_ffn_dim} wide: allowed 0 (the folder's)",
            )
    else:
        args = all_flavors()[cfg.model.flavor]
    window = cfg.model.sliding_window or args.sliding_window
    vocab = cfg.model.vocab_size or args.vocab_size or round_vocab(tokenizer.vocab_size)
    if vocab < tokenizer.vocab_size:
        raise ConfigError(
            "model.vocab_size", vocab, f"must be >= the tokenizer's vocabulary ({tokenizer.vocab_size})"
        )
    tie = args.tie_embeddings if cfg.model.tie_embeddings == "flavor" else cfg.model.tie_embeddings == "true"
    m = cfg.model
    kernels = kernels or model_kernels(cfg, run_device(cfg), window=window)
    args = args.with_(
        vocab_size=vocab,
        tie_embeddings=tie,
        max_seq_len=cfg.training.seq_len,
        n_layers=m.n_layers or args.n_layers,
        residual_init=m.residual_init,
        sliding_window=window,
        moe_experts=m.moe_experts or args.moe_experts,
        moe_top_k=m.moe_top_k or args.moe_top_k,
        moe_ffn_dim=m.moe_ffn_dim or args.moe_ffn_dim,
        moe_aux_loss=m.moe_aux_loss,
        **kernels.as_args(),
    )
    args = family_settings(args, cfg)
    check_moe(args, cfg)
    check_mla(args, cfg)
    return args


def dense_first_blocks(args, cfg: Config):
    """model.first_k_dense on a DeepSeek-V3-family shape, checked: a flavor's may change, a folder's may not (its
    weights say which blocks hold experts)."""
    k = cfg.model.first_k_dense
    if k < 0:
        return args
    if "first_k_dense" not in getattr(args, "__dataclass_fields__", {}):
        raise ConfigError(
            "model.first_k_dense",
            k,
            "dense first blocks are the DeepSeek-V3 family's (a deepseek_v3 flavor or folder): allowed -1",
        )
    if cfg.model.init_from and k != args.first_k_dense:
        raise ConfigError(
            "model.first_k_dense",
            k,
            f"model.init_from {cfg.model.init_from} has {args.first_k_dense} dense first blocks: allowed -1 "
            f"| {args.first_k_dense}",
        )
    if k > args.n_layers:
        raise ConfigError("model.first_k_dense", k, f"allowed -1 | 0..{args.n_layers} (model.n_layers)")
    return args.with_(first_k_dense=k)


def family_settings(args, cfg: Config):
    """model.moe_bias_speed and model.mtp_depth / mtp_weight on the family's args, checked."""
    m = cfg.model
    if m.moe_bias_speed >= 0:
        if m.moe_bias_speed > 0 and not args.moe:
            raise ConfigError(
                "model.moe_bias_speed", m.moe_bias_speed, "needs a mixture-of-experts model: allowed -1 | 0"
            )
        args = args.with_(moe_bias_speed=m.moe_bias_speed, moe_bias=args.moe_bias or m.moe_bias_speed > 0)
    check_bias_under_2bw(args, cfg)
    args = dense_first_blocks(args, cfg)
    has_mtp = "mtp_depth" in getattr(args, "__dataclass_fields__", {})
    if m.mtp_depth > 0 and not has_mtp:
        raise ConfigError(
            "model.mtp_depth",
            m.mtp_depth,
            "multi-token prediction is the DeepSeek-V3 family's "
            "(a deepseek_v3 flavor or folder): allowed -1 | 0",
        )
    if has_mtp:
        depth = args.mtp_depth if m.mtp_depth < 0 else m.mtp_depth
        args = args.with_(mtp_depth=depth, mtp_weight=m.mtp_weight)
        # under a pipeline the modules sit on the last stage, given the token ids beside the labels, with a copy of
        # the embedding (loom.parallel.pipeline.build_stage). torch's separate weight pass fails on a last stage whose
        # tied weight is both the head and the embedding the modules read ("backward through the graph a second
        # time"); DeepSeek-V3's own head is untied
        if (
            depth
            and cfg.parallel.pp > 1
            and args.tie_embeddings
            and cfg.parallel.pp_schedule in SPLIT_BACKWARD
        ):
            raise ConfigError(
                "model.tie_embeddings",
                cfg.model.tie_embeddings,
                f"a tied head with multi-token prediction under parallel.pp_schedule = {cfg.parallel.pp_schedule} "
                "(input and weight gradients apart: torch's weight pass cannot run the last stage's graph where the "
                "tied weight is both the head and the MTP modules' embedding): allowed false, or pp_schedule gpipe "
                "| 1f1b | interleaved_1f1b | looped_bfs | pipedream_2bw",
            )
    return args


def check_bias_under_2bw(args, cfg: Config) -> None:
    """pipedream_2bw's pipeline runs the next step's first forwards before this step's selection-bias update, so a
    moving bias routes them otherwise than its one-rank delayed rule does (measured: loss 1e-4, grad norm 4e-3
    off): refused, the bias frozen works."""
    speed = getattr(args, "moe_bias_speed", 0) if getattr(args, "moe_bias", False) else 0
    if speed > 0 and cfg.parallel.pp > 1 and cfg.parallel.pp_schedule == "pipedream_2bw":
        raise ConfigError(
            "parallel.pp_schedule",
            "pipedream_2bw",
            f"not with a moving expert selection bias (model.moe_bias_speed {speed}: the next step's first "
            "forwards would route before this step's bias update): allowed model.moe_bias_speed 0, or another "
            "schedule",
        )


def check_mla(args, cfg: Config) -> None:
    """LoRA targets against the model's attention kind: multi-head latent attention adapts q_a, q_b (or q where the
    query is not compressed), kv_a, kv_b, o; grouped-query attention q, k, v, o; shared_gate / shared_up /
    shared_down need shared experts."""
    from loom.models.common.lora import MLA_TARGETS, SHARED_TARGETS, parse_targets

    if not cfg.lora.rank:
        return
    targets = parse_targets(cfg.lora.targets)
    attention = [t for t in targets if t in MLA_TARGETS or t in ("k", "v")]
    if args.mla:
        have = ("q_a", "q_b") if args.q_lora_rank else ("q",)
        allowed = [*have, "kv_a", "kv_b", "o"]
        wrong = [t for t in attention if t not in allowed]
        kind = "multi-head latent attention" + (" with a compressed query" if args.q_lora_rank else "")
    else:
        allowed = ["q", "k", "v", "o"]
        wrong = [t for t in attention if t not in allowed]
        kind = "grouped-query attention"
    if wrong:
        raise ConfigError(
            "lora.targets",
            cfg.lora.targets,
            f"{', '.join(wrong)}: not a linear of this model's {kind}: its attention targets are "
            f"{', '.join(allowed)}",
        )
    shared = [t for t in targets if t in SHARED_TARGETS]
    if shared and not getattr(args, "moe_shared_experts", 0):
        raise ConfigError(
            "lora.targets",
            cfg.lora.targets,
            f"{', '.join(shared)}: this model has no shared experts (DeepSeek-V3's family has them); its "
            f"attention targets are {', '.join(allowed)}",
        )


def check_moe(args, cfg: Config) -> None:
    """What a mixture-of-experts model does not support (yet), as config errors."""
    if not args.moe:
        return
    if args.moe_top_k > args.moe_experts:
        raise ConfigError(
            "model.moe_top_k", args.moe_top_k, f"must be <= the number of experts ({args.moe_experts})"
        )
    if args.moe_top_k > args.moe_experts // args.moe_groups * args.moe_topk_groups:
        raise ConfigError(
            "model.moe_top_k",
            args.moe_top_k,
            f"must be <= the experts of the {args.moe_topk_groups} "
            f"groups each token chooses among ({args.moe_experts // args.moe_groups} each)",
        )
    if cfg.training.cuda_graphs:
        raise ConfigError(
            "training.cuda_graphs",
            True,
            "not with a mixture-of-experts model (the experts' token counts are read on the host every step)",
        )
    if cfg.training.compile and cfg.training.activation_checkpointing == "matmuls" and cfg.parallel.ep > 1:
        raise ConfigError(
            "training.activation_checkpointing",
            "matmuls",
            "with training.compile under expert parallelism (parallel.ep > 1): a MoE block compiles inside its "
            "checkpoint there (its token exchange breaks the graph), where the policy sees compiled kernels, not "
            "matmuls, and would keep none of them: allowed none | op | full | every_k there",
        )
    if cfg.training.compile and cfg.training.dtype != "bfloat16":
        raise ConfigError(
            "training.compile",
            True,
            "with a mixture-of-experts model needs training.dtype bfloat16 "
            "(the experts' grouped GEMM keeps shapes static; the per-expert loop of other dtypes has "
            "data-dependent sizes): allowed false with " + cfg.training.dtype,
        )


def check_model(dims: ParallelDims, args, parallel: ParallelConfig) -> None:
    """The model's shape against the parallel degrees that split it."""
    if parallel.fsdp_embedding == "vocab" and (why := model_refusal(args, equal_widths=True)):
        raise ConfigError("parallel.fsdp_embedding", "vocab", f"{why}: allowed auto | gather")
    if dims.etp > 1:
        if not args.moe:
            raise ConfigError(
                "parallel.etp", dims.etp, "needs a mixture-of-experts model: allowed 1 for a dense model"
            )
        if args.expert_ffn_dim % (8 * dims.etp):
            raise ConfigError(
                "parallel.etp",
                dims.etp,
                f"must divide the experts' hidden width "
                f"({args.expert_ffn_dim}) into slices of a multiple of 8 (the bf16 grouped GEMM "
                "needs 16-byte rows)",
            )
    if dims.ep > 1:
        if not args.moe:
            raise ConfigError(
                "parallel.ep",
                dims.ep,
                "needs a mixture-of-experts model (model.moe_experts > 0 "
                "or the debug_moe flavor): allowed 1 for a dense model",
            )
        if args.moe_experts % dims.ep:
            raise ConfigError(
                "parallel.ep", dims.ep, f"must divide the number of experts ({args.moe_experts})"
            )
    if dims.cp_enabled and args.sliding_window:
        raise ConfigError(
            "parallel.cp",
            dims.cp,
            f"not supported with a sliding window (the model's is "
            f"{args.sliding_window}: model.sliding_window or model.init_from's): allowed 1",
        )
    if dims.tp > 1:
        for what, n in (
            ("attention heads", args.n_heads),
            ("KV heads", args.n_kv_heads),
            ("feed-forward width", args.ffn_dim),
            ("vocabulary", args.vocab_size),
        ):
            if n % dims.tp:
                raise ConfigError(
                    "parallel.tp",
                    dims.tp,
                    f"must divide the model's {what} ({n}); allowed: a divisor of "
                    f"gcd(heads, KV heads, ffn, vocab) = {tp_limit(args)}",
                )
    if dims.pp > 1:
        stages = dims.pp * stages_per_rank(parallel)
        split = parallel.pp_layers_per_stage
        if split and sum(split) != args.n_layers:
            raise ConfigError(
                "parallel.pp_layers_per_stage",
                split,
                f"must add up to the model's {args.n_layers} layers (adds up to {sum(split)})",
            )
        if not split and stages > args.n_layers:
            raise ConfigError(
                "parallel.pp",
                dims.pp,
                f"{stages} pipeline stages ({dims.pp} ranks x {stages // dims.pp}) for "
                f"{args.n_layers} layers: each stage needs a layer (lower parallel.pp or "
                "pp_virtual_stages, or give parallel.pp_layers_per_stage)",
            )


def model_kernels(
    cfg: Config,
    device: str,
    measure_attention: Callable[[], str] | None = None,
    triton: bool | None = None,
    window: int | None = None,
):
    """The kernels loom.kernels.dispatch.kernel_choice picks for this config's model on ``device``: its sliding
    window (``window``, None: ``model_window``) and its latent attention's head width (read only where loom's
    kernel would run it)."""
    from loom.kernels.dispatch import kernel_choice

    def attention_width() -> int:
        args = model_shape(cfg)
        return max(args.head_dim, args.value_head_dim) if args.mla else 0

    def head_dim() -> int:
        # what the attention call sees (latent attention pads to one width for pinned SDPA)
        return attention_width() or model_shape(cfg).head_dim

    return kernel_choice(
        cfg,
        device,
        measure_attention,
        triton,
        (lambda: model_window(cfg)) if window is None else (lambda: window),
        attention_width,
        head_dim,
    )


def model_shape(cfg: Config):
    """The model's shape before it is resolved (the flavor's, or model.init_from's)."""
    if not cfg.model.init_from:
        from loom.models.registry import all_flavors

        return all_flavors()[cfg.model.flavor]
    from loom.checkpoint.hf.reader import llama_args_from_hf

    return llama_args_from_hf(cfg.model.init_from)


def model_window(cfg: Config) -> int:
    """The model's sliding window before the model is resolved: model.sliding_window, else model.init_from's
    (0: none)."""
    if cfg.model.sliding_window or not cfg.model.init_from:
        return cfg.model.sliding_window
    from loom.checkpoint.hf.reader import llama_args_from_hf

    return llama_args_from_hf(cfg.model.init_from).sliding_window


def times_attention(run: Run) -> bool:
    """Whether the trainer times the attention backends at start-up: not for deterministic runs (no timing picks
    their kernels), nor under context parallelism (attention always runs loom's op), nor for packed documents where
    only loom's kernel can run (Flex under compiled op-level checkpointing), nor with a sliding window (the timing
    runs the backends without one; loom's kernel skips the blocks outside the window), nor for multi-head latent
    attention (the timing runs grouped-query shapes)."""
    from loom.kernels.dispatch import flex_unsupported

    cfg = run.cfg
    window = run.model_args is not None and run.model_args.sliding_window > 0
    mla = run.model_args is not None and run.model_args.mla  # the timing runs GQA's shapes
    return not (
        cfg.run.deterministic
        or run.dims.cp_enabled
        or window
        or mla
        or (cfg.data.document_positions and flex_unsupported(cfg))
    )


# ---- the resolved run handed to the workers -------------------------------------------

RESOLVED_ENV = "LOOM_RESOLVED_RUN"  # the resolved run a launcher's workers read (``handing``)
# the most a hand-off may take of the environment (Linux caps one variable at 128 KiB); 128 node counts of a run
# take ~5 KB: past this nothing is handed and each worker resolves its own world, once
RESOLVED_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class Resolved:
    """What the launching process resolved for ``cfg``: per world size a job may form on, the run (``Run``) or the
    one-line error that refuses the layout there. One world, or with ``--nnodes MIN:MAX`` every node count's: an
    elastic job that re-forms on another node count reads that world's entry and resolves nothing again."""

    cfg: Config
    runs: dict[int, Run | str] = field(default_factory=dict)

    def get(self, cfg: Config, world_size: int) -> Run | str | None:
        """The run (or the refusal) for ``cfg`` on ``world_size`` ranks; None where this was resolved for another
        config (its file was edited between restarts) or without that world."""
        return self.runs.get(world_size) if cfg == self.cfg else None


@contextlib.contextmanager
def handing(resolved: Resolved | None):
    """Inside, this process and the workers it starts read ``resolved``: pickled, compressed and base64-encoded
    into the environment variable ``LOOM_RESOLVED_RUN``, which the elastic agent's workers inherit on every
    restart; no file, so nothing is left behind by a launcher that is killed. A pickle, not TOML: the reader is
    the same loom on the same machine, and the run holds dataclasses (degrees, model shape, kernels) that TOML
    cannot carry; the config a run records stays config.toml. None (or too large): nothing is handed."""
    encoded = None if resolved is None else base64.b64encode(zlib.compress(pickle.dumps(resolved))).decode()
    if encoded is None or len(encoded) > RESOLVED_MAX_BYTES:
        yield
        return
    before = os.environ.get(RESOLVED_ENV)
    os.environ[RESOLVED_ENV] = encoded
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RESOLVED_ENV, None)
        else:
            os.environ[RESOLVED_ENV] = before


def handed(cfg: Config, world_size: int) -> Run | str | None:
    """The run this process was handed for ``cfg`` on ``world_size`` ranks (a fresh copy: the engine builds its
    mesh into the degrees), the error that refuses the layout there, or None where nothing was handed for them
    (a worker ``torchrun`` started, a test building an engine): then the caller resolves."""
    encoded = os.environ.get(RESOLVED_ENV)
    if not encoded:
        return None
    return pickle.loads(zlib.decompress(base64.b64decode(encoded))).get(cfg, world_size)
