"""The engine: the build half of training and its step. ``Engine(cfg, objective)`` forms the process group and
mesh, the run dir, the data, the model (with the objective's heads), the optimizer, the checkpointer, the step
strategy and the step hooks (loom.train.hooks); ``step(micro_batches, number)`` runs one step: count → forward and
backward → hooks → clip → optimizer. What it publishes to the loop and the methods above it: the mesh and dims, the
device, the forward context (autocast + loss parallel), a frozen copy of the policy, an LR scale, the
data-parallel sum."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from loom.checkpoint.hf.reader import load_hf_weights
from loom.checkpoint.manager import CheckpointManager
from loom.checkpoint.peft import load_peft_adapter
from loom.config.errors import ConfigError, SharedError, UserError
from loom.config.load import profile_window, to_toml
from loom.config.sections import Config
from loom.data import build_loader, build_tokenizer, describe_sources, prepare_data
from loom.data.loader import MicroBatch
from loom.data.sources import parse_source
from loom.kernels.dispatch import (
    AttentionShape,
    check_fixed_attention,
    describe_choice,
    fastest,
    measure_attention,
)
from loom.metrics.nvtx import enable as enable_nvtx
from loom.metrics.nvtx import nvtx_range
from loom.metrics.profile import StepProfiler, transformer_blocks
from loom.models.common.layers import attend
from loom.models.common.lora import adapters_hidden, apply_lora, frozen_dtype
from loom.models.registry import build_model, spec_of
from loom.numerics import DTYPES
from loom.parallel.context_parallel import shard_sequence
from loom.parallel.parallelize import fsdp_reshard_after_forward, fsdp_wraps, parallelize_llama
from loom.parallel.placement import check_placement
from loom.parallel.shards import local_tensor, quantize_base
from loom.parallel.tensor_parallel import loss_parallel_context
from loom.parallel.vocab_embedding_rules import fsdp_embedding
from loom.resolve import Run, handed, resolve, times_attention
from loom.runtime.env import DistEnv, ensure_process_group, init_distributed
from loom.runtime.fault_tolerance import data_shard
from loom.runtime.guard import PREEMPTED, StepCheck
from loom.runtime.health import Health, prepare_process, startup_timeout
from loom.runtime.restarts import this_attempt
from loom.runtime.run_lock import acquire, hold_as_worker
from loom.runtime.topology import apply_placement
from loom.train.diloco import DiLoCoHook
from loom.train.grads import unique_params, use_norm_kernel
from loom.train.hooks import (
    FaultToleranceHook,
    GarbageCollection,
    PreemptionHook,
    StepHook,
    StragglersHook,
)
from loom.train.moe_stats import MoEBalance
from loom.train.noise_scale import NoiseScaleProbe
from loom.train.nvtx_ranges import NvtxRanges
from loom.train.objective import Objective
from loom.train.optimizer import OptimizerParts
from loom.train.precision import Float8Scales, LossScaler, autocast_context
from loom.train.run_dir import check_writable_dirs, record_run_files
from loom.train.schedule import SchedulerParts, lr_factor
from loom.train.steps import (
    DelayedLocalStep,
    LocalStep,
    PipelineStep,
    StepContext,
    TwoBWCheckpoint,
    TwoBWStep,
)
from loom.train.zero import OptimizerShard


def parallelize(model):
    """The family's parallelize function (its spec's; the Llama-like families share loom's one composition order)."""
    return spec_of(model.args).parallelize or parallelize_llama


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite, read with one sync: each tensor's sum of absolute values
    (one foreach kernel, fp32) is finite where all its elements are; only where one is not (a NaN or inf, or a sum
    past fp32's range) is each tensor checked element by element. Run before each sampling of the rollouts: two
    kernels, not two per parameter."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return True
    if bool(torch.isfinite(torch.stack(torch._foreach_norm(tensors, 1, dtype=torch.float32))).all()):
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def count_params(args, lora=None, replace_head=None) -> tuple[int, int]:
    """(parameters, trainable parameters) of the whole model (whatever this rank holds), with ``lora``'s
    adapters where it has a rank, and the head an objective puts in place of the LM head (``replace_head``: a
    reward model's score head)."""
    with torch.device("meta"):
        model = build_model(args)
        if lora is not None:
            apply_lora(model, lora)
        if replace_head is not None:
            replace_head(model)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def step_hooks(cfg, engine, owner) -> list[StepHook]:
    """The run's hooks, from its config: DiLoCo (parallel.diloco_inner_steps), a mixture of experts' balance
    (the model has MoE blocks), the noise-scale probe (metrics.noise_scale), torchft (parallel.fault_tolerance),
    NVTX ranges (metrics.nvtx), stragglers (metrics.straggler_fraction, several ranks), float8 weights' scales
    (training.float8_all_gather), garbage collection at fixed steps (training.gc_every), preemption (always: a
    stop request saves and exits).
    ``owner``: the loop whose state a recovering torchft peer receives (``state_dict`` / ``load_state_dict``)."""
    hooks: list[StepHook] = []
    if cfg.parallel.diloco_inner_steps:  # the dp_replicate groups average their weights every H steps
        hooks.append(DiLoCoHook.build(engine.parts, engine.dims, cfg.parallel))
    if engine.model_args.moe:
        hooks.append(
            MoEBalance(
                engine.parts,
                engine.dims,
                cfg.training.global_batch_size,
                engine.model_args.n_layers,
                cfg.training.compile,
                engine.steps.stage_sum,
                engine.model_args,
            )
        )
    if cfg.metrics.noise_scale:  # resolve allows it only with accumulation and no pipeline
        hooks.append(NoiseScaleProbe.build(engine.steps, engine.dims, engine.objective))
    if cfg.parallel.fault_tolerance:  # this job is one of several torchft replica groups
        hooks.append(FaultToleranceHook.build(cfg.parallel, engine, owner))
    if cfg.metrics.nvtx:  # the block ranges (none under torch.compile) and the banner's line
        hooks.append(NvtxRanges(None if cfg.training.compile else transformer_blocks(engine.parts)))
    if cfg.metrics.straggler_fraction > 0 and engine.env.world_size > 1:  # per-rank timing at logged steps
        hooks.append(StragglersHook.build(engine, cfg.metrics.straggler_fraction))
    if cfg.parallel.pp_schedule == "pipedream_2bw":  # its checkpoints hold the older weight version too
        hooks.append(TwoBWCheckpoint(engine.steps.versions))
    if cfg.training.float8_all_gather and cfg.parallel.pp_schedule != "pipedream_2bw":
        # after every hook that changes weights (DiLoCo's average); 2BW swaps weight versions itself, so its
        # gathers keep reducing each weight's amax as they run
        hooks.append(
            Float8Scales(engine.parts, after_quorum=cfg.parallel.fault_tolerance, optimizer=engine.optimizer)
        )
    if cfg.training.gc_every:
        hooks.append(GarbageCollection(cfg.training.gc_every))
    hooks.append(PreemptionHook(cfg.checkpoint.preempt_grace_s, engine.env, engine.run_dir))
    return hooks


def embedded_rejected(cfg: Config, objective: Objective) -> str:
    """The embedded preference pairs' rejected answers: data.embedded_rejected, 'auto' settled by the objective (a
    reward model trained from its seed learns the echoed code, not another function's docstring)."""
    chosen = cfg.data.embedded_rejected
    return objective.rejected if chosen == "auto" else chosen


@dataclass
class StepOut:
    """What one step gives the loop: its global loss, gradient norm and count, the LR it ran at, the objective's
    statistics, the hooks' figures; ``check``: its verdict, read later (``committed`` false: no update, rerun)."""

    loss: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    lr: float = 0.0
    stats: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    check: StepCheck | None = None
    committed: bool = True

    def fields(self) -> dict:
        """The step's fields as the loop's records read them."""
        if not self.committed:
            return {"committed": False}
        return {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "tokens": self.tokens,
            "lr": self.lr,
            "stats": self.stats,
            **self.figures,
        }


class Engine:
    """The built run (see the module's docstring). ``objective``: what each step minimizes and the hooks it joins
    (loom.train.objective.Objective); ``owner``: the loop, whose ``step`` the health monitor reports and whose
    ``state_dict`` / ``load_state_dict`` a recovering torchft peer receives; ``rules``: the method's, handed to the
    resolver (loom.methods.rules_of)."""

    def __init__(
        self,
        cfg: Config,
        objective: Objective,
        owner,
        env: DistEnv | None = None,
        rules: Sequence[Callable[[Config], None]] = (),
    ):
        self.cfg, self.objective = cfg, objective
        self._read_ahead: list | None = None  # pipedream_2bw: the next step's token ids, read a step early
        if env is None:  # the flight recorder and TORCH_DISTRIBUTED_DEBUG are read as the group forms
            prepare_process(
                cfg.run.dir,
                cfg.run.device,
                cfg.parallel.distributed_debug,
                comm_timing=cfg.metrics.straggler_fraction > 0,
            )
        device_index = None
        if env is None:  # parallel.placement = auto: this rank's GPU and CPUs from the host's topology
            device_index, lines = apply_placement(cfg.parallel, cfg.run.device)
            for line in lines:
                print(line, flush=True)
        self.env = env or init_distributed(
            cfg.run.device,
            cfg.parallel.backend,
            cfg.parallel.cpu_offload,
            timeout=startup_timeout(cfg.parallel.timeout_s),
            device_index=device_index,
            zero_cta=cfg.parallel.fsdp_symm_mem,
        )
        self.device = self.env.device
        # the run the launcher resolved (loom.resolve.handed), else every cross-field rule checked here (the
        # method's too); the model's come with the tokenizer
        run = handed(cfg, self.env.world_size)
        self.run = run if isinstance(run, Run) else resolve(cfg, self.env.world_size, rules=rules)
        self.dims, self.accum = self.run.dims, self.run.accum
        # offload runs FSDP2, on a 1-rank mesh when alone
        if self.dims.distributed or cfg.parallel.cpu_offload:
            ensure_process_group(self.env, cfg.parallel.backend, cfg.parallel.cpu_offload)
            self.dims.build_mesh(self.device.type)
            for line in check_placement(
                self.dims
            ):  # tp / cp groups that span hosts (loom.parallel.placement)
                if self.env.is_main:
                    print(line, flush=True)
        self._setup_determinism()
        self._setup_run_dir()
        # monitored barriers, timeouts and hang reports (loom.runtime.health)
        self.health = Health(self.env, cfg.parallel.timeout_s, self.run_dir, step=lambda: owner.step)
        # an elastic agent's restart of this run (rank 0 reads <run.dir>/restarts.jsonl): what it resumes from
        self.attempt = self.env.share_from_main(this_attempt(self.run_dir) if self.env.is_main else None)
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self._build_checkpointer()
        self._build_profiler()
        self._build_steps()
        self.hooks: list[StepHook] = step_hooks(cfg, self, owner)
        self.objective.prepare(self)  # e.g. DPO's cached reference pass

    # ---- what the engine publishes ------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The module a training forward calls (a DDP wrapper where there is one; one part: no pipeline)."""
        return self.steps.module

    @property
    def loss_parallel(self) -> bool:
        """Whether the loss is vocab-parallel (tensor parallelism's loss_parallel)."""
        return self.dims.tp_enabled and self.cfg.parallel.loss_parallel

    @property
    def replica(self):
        """The state a checkpoint holds beside the model's, from the hooks (DiLoCo's outer state), or None."""
        return next((h.replica for h in self.hooks if h.replica is not None), None)

    def extra_state(self) -> dict:
        """Entries the hooks add to a checkpoint beside the model and optimizer state (``StepHook.extra_state``)."""
        return {k: v for h in self.hooks for k, v in h.extra_state().items()}

    def autocast(self):
        """The step's autocast (none in float32, or where FSDP2 casts)."""
        return autocast_context(self.dtype, self.device, fsdp_casts=fsdp_wraps(self.dims, self.cfg.parallel))

    @contextlib.contextmanager
    def forward_context(self):
        """What a training forward runs under: the loss parallel context (vocab-sharded logits under TP) and the
        step's autocast."""
        with loss_parallel_context(self.loss_parallel), self.autocast():
            yield

    def positions(self, mb: MicroBatch) -> torch.Tensor | None:
        """The per-document positions a forward takes (None where the model runs without them)."""
        return self.steps.ctx.positions(mb)

    def local_tokens(self, mb: MicroBatch) -> MicroBatch:
        """This rank's share of a micro-batch on the device: under context parallelism its two chunks of
        every sequence (loom.parallel.context_parallel), else all of it."""
        mb = mb.to(self.device)
        if not self.dims.cp_enabled:
            return mb
        rank, cp = self.dims.cp_rank(), self.dims.cp
        return MicroBatch(
            *(shard_sequence(t, rank, cp) for t in (mb.inputs, mb.labels, mb.positions, mb.document_ids))
        )

    def data_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks that hold different tokens of a step, and over whatever the hooks add
        (torchft's replica groups)."""
        with nvtx_range("allreduce.data_sum"):
            t = self.dims.data_sum(t)
            for hook in self.hooks:
                t = hook.reduce(t)
            return t

    def scale_lr(self, ratio: float) -> None:
        """This step's LR: the schedule's times ``ratio`` (the scheduler sets the plain value again after each
        update; e.g. grpo.lr_ratio)."""
        sched, opt = self.scheduler, self.cfg.optimizer
        for s in sched.schedulers:
            lr = opt.lr * lr_factor(s.last_epoch, sched.total_steps, opt) * ratio
            for group in s.optimizer.param_groups:
                group["lr"] = lr

    def frozen_copy(self, copy_weights: bool = True) -> torch.nn.Module:
        """A frozen model of the policy's shape without the objective's heads, parallelized in the policy's layout
        (TP and FSDP2 shard it as the policy's parameters are, so the copy's shards are the policy's), with no
        gradients and no optimizer state; ``copy_weights``: the policy's weights as they are now copied in (else
        the caller copies them later). No activation checkpointing (nothing runs backward through it) and no DDP
        wrapper (nothing to reduce: every data-parallel rank holds the same weights)."""
        from loom.models.common.init import canonical_name

        cfg, (policy,) = self.cfg, self.parts  # one part: pipeline parallelism is refused where it is used
        with torch.device("meta"):
            model = build_model(self.model_args)
        training = replace(cfg.training, activation_checkpointing="none")
        (ref,) = parallelize(model)(
            model, self.dims, training, self.parallel, self.device, cfg.run.seed
        ).parts
        if copy_weights:
            with torch.no_grad():
                for named in ("named_parameters", "named_buffers"):
                    mine = {canonical_name(n): t for n, t in getattr(policy, named)()}
                    theirs = {canonical_name(n): t for n, t in getattr(ref, named)()}
                    assert mine.keys() == theirs.keys(), sorted(mine.keys() ^ theirs.keys())
                    for name, t in theirs.items():
                        local_tensor(t).copy_(local_tensor(mine[name]))
        ref.requires_grad_(False)
        return ref.eval()

    def weights_finite(self) -> bool:
        """Whether every weight this rank holds is finite (``all_finite``)."""
        return all_finite([local_tensor(p).detach() for p in self.params])

    # ---- build steps ------------------------------------------------------
    def _setup_determinism(self) -> None:
        torch.manual_seed(self.cfg.run.seed)
        if self.cfg.run.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False

    def _setup_run_dir(self) -> None:
        """Rank 0 checks the run and checkpoint folders can be written and locks the run dir (a no-op where the
        CLI or launcher holds the lock); every rank stops with its error, printed once."""
        self.run_dir = self.cfg.run.dir
        recorded = self.cfg  # what config.toml and every checkpoint record; only rank 0 writes them
        error = None
        hold_as_worker(self.run_dir)  # every launched rank: the run dir stays locked while any of them lives
        if self.env.is_main:
            try:
                check_writable_dirs(self.cfg)
                acquire(self.run_dir)
                recorded = record_run_files(self.cfg)  # the tokenizer copied into the run dir, paths absolute
            except (ConfigError, UserError) as err:
                error = str(err)
        error = self.env.share_from_main(error)
        if error is not None:
            raise SharedError(error)
        self.recorded_toml = to_toml(recorded)
        if self.env.is_main:
            with open(os.path.join(self.run_dir, "config.toml"), "w") as fh:
                fh.write(self.recorded_toml)
            with contextlib.suppress(FileNotFoundError):
                os.remove(
                    os.path.join(self.run_dir, PREEMPTED)
                )  # an earlier run's: the launcher reads this one's
        self.env.barrier()

    def _build_data(self) -> None:
        cfg = self.cfg
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        own = self.objective.build_loader(self)  # an objective that makes its own data (GRPO's rollouts)
        if own is not None:
            self.loader, self.data_fingerprints = own, []
            return
        cache = cfg.data.cache_dir or os.path.join(self.run_dir, "cache")
        error = None
        if self.env.is_main:  # one rank tokenizes (or finds the cache); the others wait, then map it
            try:
                files = prepare_data(
                    cfg.data,
                    self.tokenizer,
                    cache,
                    self.objective.data,
                    embedded_rejected(cfg, self.objective),
                )
                describe_sources(cfg.data, files, os.path.join(self.run_dir, "data_sources.json"))
            except (
                ConfigError,
                UserError,
            ) as err:  # e.g. bytes that are not UTF-8: every rank stops, one line
                error = str(err)
        error = self.env.share_from_main(error)
        if error is not None:
            raise SharedError(error)
        if not self.env.is_main:
            files = prepare_data(
                cfg.data, self.tokenizer, cache, self.objective.data, embedded_rejected(cfg, self.objective)
            )
        # sizes and modification times of the source files: a resume says when they changed under the same name
        self.data_fingerprints = [
            spec.fingerprint()
            for spec in parse_source(cfg.data.source, cfg.data.text_field, cfg.data.encoding_errors)
        ]
        t = cfg.training
        # with fault tolerance, this rank's place among the ranks of every replica group
        dp_rank, dp_size = data_shard(cfg.parallel, self.dims.dp_rank(), self.dims.dp_size)
        self.loader = build_loader(
            cfg.data,
            self.tokenizer,
            files,
            seq_len=t.seq_len,
            seed=cfg.run.seed,
            dp_rank=dp_rank,
            dp_size=dp_size,
            micro_batch=t.micro_batch_size,
            accumulation=self.accum,
            kind=self.objective.data,
        )

    def _build_model(self) -> None:
        cfg = self.cfg
        if self.run.model_args is None:  # checked against the degrees before attention is timed
            self.run = self.run.with_model(self.tokenizer)
        self.attention_times: dict | None = None
        if times_attention(self.run):
            self.run = self.run.with_attention(lambda: self._measure_attention(self.run.model_args))
        self.kernels, self.model_args = self.run.kernels, self.run.model_args
        # SDPA pinned to one backend, or FA4, by hand: the device's own check on this rank's shape, a ConfigError
        # where it refuses
        check_fixed_attention(self.kernels.attention, self.attention_shape(self.model_args), self.device)
        with torch.device("meta"):
            model = build_model(self.model_args)
        # LoRA: adapters on lora.targets, the rest frozen (0: off)
        self.n_adapted = apply_lora(model, cfg.lora, frozen_dtype(cfg.lora, cfg.training.dtype))
        self.objective.replace_head(model)  # a reward model's score head in place of the LM head
        self.objective.attach(model)  # heads it trains beside the model (PPO's value function)
        # MFU counts what the run computes: a frozen base takes no weight gradients (loom.metrics.flops)
        self.adapter_params = (
            count_params(self.model_args, cfg.lora, self.objective.replace_head)[1]
            if self.n_adapted
            else None
        )
        # parallel.fsdp_embedding resolved for this model and objective (auto: vocab or gather)
        split = fsdp_embedding(cfg.parallel, self.dims, self.model_args, cfg.training, self.objective)
        self.parallel = replace(cfg.parallel, fsdp_embedding=split)
        pm = parallelize(model)(model, self.dims, cfg.training, self.parallel, self.device, cfg.run.seed)
        self.parts = pm.parts  # this rank's model parts (pipeline stages or the model)
        if cfg.model.init_from:
            # the folder holds the base model only: no adapters, no heads of the objective
            with adapters_hidden(self.parts), self.objective.heads_hidden(self.parts):
                for part in self.parts:
                    load_hf_weights(part, cfg.model.init_from, whole_model=pm.plan is None)
        if cfg.lora.rank and cfg.lora.init_from:
            for part in self.parts:
                load_peft_adapter(part, cfg.lora, whole_model=pm.plan is None, args=self.model_args)
        # QLoRA: the base is final now; before the first forward
        if cfg.lora.rank and cfg.lora.base_dtype == "nf4":
            for part in self.parts:
                quantize_base(part)
        self.params = unique_params(self.parts)
        self.dtype = DTYPES[cfg.training.dtype]
        self.parallel_model = pm

    def attention_shape(self, args) -> AttentionShape:
        """What one attention call of this rank sees: a micro-batch of whole sequences, the heads tp leaves it, one
        head dim (latent attention pads queries / keys and values to the wider of the two for a fixed kernel)."""
        cfg, tp = self.cfg, self.cfg.parallel.tp
        return AttentionShape(
            cfg.training.micro_batch_size,
            args.n_heads // tp,
            args.n_kv_heads // tp,
            cfg.training.seq_len,
            max(args.head_dim, args.value_head_dim),
            DTYPES[cfg.training.dtype],
        )

    def _measure_attention(self, args) -> str:
        """``model.attention = auto`` on CUDA: forward + backward of the candidates on this rank's attention shape
        (packed documents: loom's kernel and FlexAttention on the run's first micro-batch's documents; otherwise
        loom's kernel, SDPA pinned to cuDNN and to FlashAttention-2, those PyTorch lets run here, and FlashAttention-4
        where it is installed and runs on this GPU), timed once
        per shape in the process; every rank uses rank 0's figures, so all choose the same backend."""
        cfg = self.cfg
        shape = self.attention_shape(args)
        positions = self._first_positions() if cfg.data.document_positions else None
        times = self.env.share_from_main(measure_attention(attend, shape, self.device, positions))
        torch.cuda.empty_cache()
        self.attention_times = {
            "shape": shape.describe(),
            "ms_fwd_bwd": times,
            "chosen": fastest(times),
            "verdict": describe_choice(times),
        }
        if self.env.is_main:
            with open(os.path.join(self.run_dir, "kernels.json"), "w") as fh:
                json.dump(self.attention_times, fh, indent=1)
        return self.attention_times["chosen"]

    def _first_positions(self) -> torch.Tensor:
        """Per-document positions (B, S) of this rank's first micro-batch, read without moving the loader."""
        state = self.loader.state_dict()
        batch = self.loader.next_step().micro_batches[0]
        self.loader.load_state_dict(state)
        return batch.positions.to(self.device)

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        # offload: state on the host
        opt_device = torch.device("cpu") if cfg.parallel.cpu_offload else self.device
        shard = None
        if self.dims.shard_optimizer:  # ZeRO-1: each DDP replica steps its own parameters (loom.train.zero)
            shard = OptimizerShard(
                self.params, self.dims["dp_replicate"] if self.dims.dp_replicate > 1 else None
            )
        self.optimizer = OptimizerParts(
            self.parts,
            cfg.optimizer,
            opt_device,
            offload=cfg.parallel.cpu_offload,
            shard=shard,
            state_root=self.run_dir,
            rank=self.env.rank,
        )
        use_norm_kernel(cfg.training.grad_norm_kernel)
        self.scheduler = SchedulerParts(self.optimizer, cfg.training.steps, cfg.optimizer)
        # training.cuda_graphs: gradients accumulate into tensors of their own, kept between steps; a first backward
        # would otherwise hand the graphs' output memory to .grad, which the next micro-batch's replay overwrites
        self.keep_grads = cfg.training.cuda_graphs
        if self.keep_grads:
            for p in self.params:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        self.scaler = LossScaler(
            cfg.training.dtype == "float16", cfg.training.loss_scale_init, cfg.training.loss_scale_window
        )

    def _build_checkpointer(self) -> None:
        self._check_checkpoint_space()
        self.checkpointer = CheckpointManager(
            self.cfg.checkpoint,
            self.run_dir,
            is_main=self.env.is_main,
            barrier=self.health.barrier,
            share=self.env.share_from_main,
        )

    def _check_checkpoint_space(self) -> None:
        """A run that will save refuses to start when the checkpoint folder's disk cannot hold one checkpoint
        (float32 weights and the trainable ones' two AdamW moments), instead of failing at its first save."""
        c = self.cfg.checkpoint
        error = None
        if self.env.is_main and (c.every or c.at_end):
            folder = c.dir or os.path.join(self.run_dir, "checkpoints")
            total, trainable = count_params(self.model_args, self.cfg.lora, self.objective.replace_head)
            need = 4 * (total + 2 * trainable)  # the AdamW moments of the trainable parameters only
            if self.cfg.parallel.pp_schedule == "pipedream_2bw":  # and the older weight version
                need += 4 * total
            free = shutil.disk_usage(folder).free
            if free < need:
                error = (
                    f"checkpoint.dir {folder}: a checkpoint of this model needs about {need:,} bytes (float32 "
                    f"weights and AdamW moments), the disk has {free:,} free: free space or choose another "
                    "checkpoint.dir"
                )
        error = self.env.share_from_main(error)
        if error is not None:
            raise SharedError(error)

    def _build_steps(self) -> None:
        """The step strategy, chosen once: the whole model on this rank, or a pipeline schedule over its stages."""
        cfg, pm = self.cfg, self.parallel_model
        self.objective.configure(self.model_args)  # e.g. whether the model's forward computes the loss
        ctx = StepContext(
            self.dims,
            self.device,
            self.autocast,
            self.loss_parallel,
            cfg.data.document_positions,
            self.profiler,
            cfg.training.cuda_graphs,
        )
        two_bw = cfg.parallel.pp_schedule == "pipedream_2bw"  # 1-step-delayed weights, whatever pp
        if pm.plan is None:
            local = DelayedLocalStep if two_bw else LocalStep
            self.steps: LocalStep | PipelineStep = local(pm.modules[0], self.parts, self.objective, ctx)
        elif two_bw:
            self.steps = TwoBWStep(pm.plan, self.parts, pm.modules, self.objective, ctx, self.accum)
        else:
            self.steps = PipelineStep(pm.plan, self.parts, pm.modules, self.objective, ctx, self.accum)
        if pm.plan is not None:
            self.steps.steps = cfg.training.steps

    def _upcoming(self, number: int) -> list[MicroBatch] | None:
        """Step ``number + 1``'s micro-batches on this rank, read without moving the loader (pipedream_2bw runs
        their first forwards in step ``number``); None after the run's last step."""
        if number >= self.cfg.training.steps:
            return None
        state = self.loader.state_dict()
        batch = self.loader.next_step().micro_batches
        self.loader.load_state_dict(state)
        # the token ids as the loader gave them, on the host: comparing them next step waits for no GPU
        self._read_ahead = [mb.inputs for mb in batch]
        return [self.local_tokens(mb) for mb in batch]

    def _check_read_ahead(self, micro_batches: list[MicroBatch]) -> None:
        """pipedream_2bw ran this step's first forwards in the step before: its micro-batches must be the ones
        read ahead then, or the run stops instead of computing on another batch."""
        ahead, self._read_ahead = self._read_ahead, None
        if ahead is not None and (
            len(ahead) != len(micro_batches)
            or not all(torch.equal(a, mb.inputs) for a, mb in zip(ahead, micro_batches))
        ):
            raise RuntimeError(
                "pipedream_2bw: this step's micro-batches are not the ones the step before already ran forward "
                "(the data position moved between steps)"
            )

    def _build_profiler(self) -> None:
        """metrics.profile_steps; no block ranges under torch.compile (the hooks would run in its graph); NVTX
        ranges on or off for this process (metrics.nvtx: one run may follow another in a process)."""
        enable_nvtx(self.cfg.metrics.nvtx)
        blocks = None if self.cfg.training.compile else transformer_blocks(self.parts)
        # no memory snapshot of MoE blocks under activation checkpointing: PyTorch's memory history breaks their
        # backward (docs/metrics.md)
        no_snapshot = (
            "metrics.profile_memory = false"
            if not self.cfg.metrics.profile_memory
            else "skipped: PyTorch's memory history breaks the backward of MoE blocks under activation "
            "checkpointing"
            if self.model_args.moe and self.cfg.training.activation_checkpointing != "none"
            else ""
        )
        self.profiler = StepProfiler(
            profile_window(self.cfg.metrics),
            self.run_dir,
            self.env.rank,
            self.device,
            blocks,
            is_main=self.env.is_main,
            no_snapshot=no_snapshot,
            host=self.cfg.metrics.profile_host,
        )

    # ---- one step -------------------------------------------------------------
    def step(self, micro_batches: list[MicroBatch], number: int) -> StepOut:
        """Step ``number`` over this rank's micro-batches: count → forward and backward → hooks → clip →
        optimizer. Its verdict (``StepOut.check``) is read by the loop later, without waiting here."""
        mbs = [self.local_tokens(mb) for mb in micro_batches]
        local = sum(self.objective.count(mb) for mb in mbs).to(torch.float32)
        for hook in self.hooks:
            hook.before_count(local)
        n_tokens = self.data_sum(local)
        self.objective.begin(mbs, self.data_sum)  # e.g. KTO's KL estimate over the global batch
        # a global batch without a unit to count (an SFT batch without an assistant token) has loss 0 and zero
        # gradients, not 0 / 0, and makes no update (``has_units``; the loop's settle says so)
        has_units, denominator = n_tokens > 0, n_tokens.clamp(min=1)
        # gradient reductions average over the dp x cp ranks; multiplying by their count makes them a sum,
        # so every micro-batch on every rank contributes token_loss / global_tokens
        loss_scale = self.scaler.scale
        grad_scale = self.dims.dp_size * self.dims.cp * loss_scale / denominator
        for hook in self.hooks:
            grad_scale = hook.grad_scale(grad_scale, loss_scale)
        for hook in self.hooks:
            hook.before_step(loss_scale)
        self.objective.step_stats()  # statistics of forwards before this step are not its own
        if isinstance(self.steps, TwoBWStep):  # it runs the next step's first forwards in this one
            self._check_read_ahead(micro_batches)
            self.steps.upcoming = lambda: self._upcoming(number)
        result = next(
            (r for h in self.hooks if (r := h.run_step(self.steps, mbs, grad_scale, loss_scale)) is not None),
            None,
        ) or self.steps.step(mbs, grad_scale)
        stats = self.objective_stats(denominator)
        lr = self.optimizer.param_groups[0]["lr"]
        for hook in self.hooks:
            hook.after_backward(self.params)
        loss = self.data_sum(result.loss_sum) / denominator
        with self.profiler.phase(
            "optimizer"
        ):  # grad norm, clipping, step (skipped where not finite), zero_grad
            if not all([hook.commits() for hook in self.hooks]):  # e.g. a replica group failed: no update
                self.optimizer.zero_grad(set_to_none=True)
                return StepOut(committed=False)
            with nvtx_range("grad_norm"):  # the norm's all-reduce over the shards / stages
                norm = self.steps.grad_norm() / loss_scale
            for hook in self.hooks:
                hook.observe_norm(norm, denominator)
            applies, check = self._update(loss, norm, has_units, number, {"tokens": n_tokens, **stats})
        out = StepOut(loss, norm, n_tokens, lr, stats, check=check)
        for hook in self.hooks:
            out.figures.update(hook.step_out(applies, result.shape_inference, self.device))
        return out

    def _update(
        self, loss: torch.Tensor, norm: torch.Tensor, has_units: torch.Tensor, number: int, figures: dict
    ) -> tuple[torch.Tensor, StepCheck]:
        """Clip and step the optimizer where the update applies; (whether it applies, the step's verdict, which
        carries ``figures`` to the host with it)."""
        t = self.cfg.training
        # both are global (summed and normed over every rank): every rank reaches the same verdict. Under
        # float16 an infinite gradient norm is an overflow, the loss scaler's to handle.
        finite = torch.isfinite(loss)
        if not self.scaler.enabled:
            finite = finite & torch.isfinite(norm.to(loss.device))
        clip = 1.0 if t.max_norm == 0 else torch.clamp(t.max_norm / (norm + 1e-6), max=1.0)
        scaled = self.scaler.enabled or t.max_norm
        factor = clip / self.scaler.scale if scaled else None
        deferred = self.optimizer.skips_on_device and not self.scaler.enabled
        # whether the update applies: not where the loss or norm is not finite, nor where nothing was counted.
        # the loop's settle tells the two apart: an empty step's loss and norm are finite (0)
        applies = finite & has_units
        for hook in self.hooks:
            applies = hook.agree(applies)
        # copied to the host before the update is queued: reading it waits for this point, not the update
        check = StepCheck(number, applies, loss, norm, deferred, figures)
        if deferred:  # the device skips a non-finite update itself; the host reads the verdict a step later
            self.optimizer.step(factor, finite=applies)
            self.scheduler.step()
        else:  # float16's loss scale and the optimizers that cannot skip on the device decide on the host
            stepped = bool(applies)
            if stepped and self.scaler.enabled:
                stepped = self.scaler.update(float(norm))
            if stepped:
                self.optimizer.step(factor)
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        for hook in self.hooks:
            hook.after_update(number)
        return applies, check

    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(summed loss, global count, the objective's statistics) of validation ``batches``, summed over the
        data-parallel ranks; the model in eval mode meanwhile."""
        for part in self.parts:
            part.eval()
        batches = [self.local_tokens(mb) for mb in batches]
        count = self.data_sum(sum(self.objective.count(mb) for mb in batches).to(torch.float32))
        self.objective.begin(batches, self.data_sum)
        self.objective.step_stats()
        total = self.steps.evaluate(batches)
        stats = {k: float(v) for k, v in self.objective_stats(count).items()}
        for part in self.parts:
            part.train()
        return total, count, stats

    def objective_stats(self, count: torch.Tensor) -> dict[str, torch.Tensor]:
        """The objective's statistics of the micro-batches just run, summed over the data-parallel ranks and divided
        by the global ``count`` (e.g. DPO's rewards and accuracy per pair)."""
        stats = self.objective.step_stats()
        return {
            k: self.data_sum(torch.as_tensor(v, dtype=torch.float32, device=self.device).clone()) / count
            for k, v in sorted(stats.items())
        }

    # ---- what the banner says ---------------------------------------------------
    def measured(self) -> str:
        """The attention timings taken at start-up, for the banner ('' where none were)."""
        if self.attention_times is None:
            return ""
        t = self.attention_times
        figures = ", ".join(f"{name} {ms:.3f}" for name, ms in t["ms_fwd_bwd"].items())
        return f" (attention timed at start-up on {t['shape']}: {t['verdict']}; ms per forward+backward: {figures})"

    def describe_steps(self) -> list[str]:
        """The step strategy's banner lines."""
        lines = self.steps.describe(self.accum)
        plan = self.parallel_model.plan
        if (
            plan is not None
            and self.dims.fsdp_applied
            and self.dims.reshard_after_forward
            and not fsdp_reshard_after_forward(self.dims, plan)
        ):
            lines.append(
                f"pipeline: {plan.schedule} computes weight gradients in a pass of their own, so FSDP keeps "
                "each block's parameters gathered from forward to the gradient reduction (parallel."
                "reshard_after_forward = true does not apply)"
            )
        return lines
