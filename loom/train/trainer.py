"""The trainer, assembled from small build steps. ``Trainer(cfg).fit()`` is the whole job."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time

import torch

from loom.checkpoint.hf.reader import load_hf_weights
from loom.checkpoint.manager import CheckpointManager, step_dir_name
from loom.checkpoint.peft import load_peft_adapter
from loom.config.errors import ConfigError, SharedError, UserError
from loom.config.load import profile_window, to_toml
from loom.config.sections import Config
from loom.data import build_loader, build_tokenizer, describe_sources, prepare_data
from loom.data.loader import MicroBatch
from loom.data.sources import parse_source
from loom.eval.hook import training_evals
from loom.kernels.dispatch import AttentionShape, fastest, measure_attention
from loom.metrics.flops import device_peak, mfu, mfu_note
from loom.metrics.logger import MetricsLogger, rewind_metrics
from loom.metrics.memory import peak_memory_gib, reset_peak
from loom.metrics.nvtx import nvtx_range, enable as enable_nvtx
from loom.metrics.profile import StepProfiler, nvtx_block_ranges, transformer_blocks
from loom.models.common.layers import attend
from loom.models.common.lora import adapters_hidden, apply_lora, frozen_dtype
from loom.parallel.shards import quantize_base
from loom.models.registry import build_model
from loom.numerics import DTYPES
from loom.parallel.context_parallel import shard_sequence
from loom.runtime.env import DistEnv, ensure_process_group, init_distributed
from loom.runtime.health import Health, prepare_process, startup_timeout
from loom.parallel.expert_parallel import expert_params
from loom.runtime.fault_tolerance import ReplicaGroups, data_shard, lighthouse_address
from loom.parallel.parallelize import fsdp_reshard_after_forward, fsdp_wraps, parallelize_llama
from loom.parallel.placement import check_placement
from loom.resolve import embedded_rejected, resolve, times_attention
from loom.train.grads import scale_grads, unique_params
from loom.train.diloco import DiLoCo
from loom.runtime.guard import PREEMPTED, NonFiniteGuard, Preemption, StepCheck, StopVote, TrainingStopped
from loom.train.moe_stats import MoEBalance
from loom.train.objective import Objective, build_objective
from loom.runtime.restarts import begin as begin_attempt, metrics_fields, restart_checkpoint, this_attempt
from loom.train.reward import attach_score_head
from loom.train.noise_scale import NoiseScaleProbe
from loom.train.optimizer import OptimizerParts
from loom.train.zero import OptimizerShard
from loom.train.precision import LossScaler, autocast_context
from loom.train.resume_changes import (apply_optimizer_config, check_checkpoint, checkpoint_values, loader_state,
                                       on_main, restore_loss_scale)
from loom.runtime.run_lock import acquire, hold_as_worker
from loom.train.run_dir import check_writable_dirs, record_run_files
from loom.train.schedule import SchedulerParts
from loom.runtime.stragglers import Stragglers
from loom.train.steps import LocalStep, PipelineStep, StepContext


def count_params(args, lora=None, score_head: bool = False) -> tuple[int, int]:
    """(parameters, trainable parameters) of the whole model (whatever this rank holds), with ``lora``'s
    adapters where it has a rank, and a reward model's score head in place of the LM head (``score_head``)."""
    with torch.device("meta"):
        model = build_model(args)
        if lora is not None:
            apply_lora(model, lora)
        if score_head:
            attach_score_head(model)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def data_objective(objective: str) -> str:
    """The data an objective reads: a reward model trains on DPO's preference pairs (loom.data.dpo)."""
    return "dpo" if objective == "reward" else objective


class Trainer:
    """``objective``: what each step minimizes (default: language modeling over every labelled token)."""

    def __init__(self, cfg: Config, env: DistEnv | None = None, objective: Objective | None = None):
        self.cfg = cfg
        if env is None:  # the flight recorder and TORCH_DISTRIBUTED_DEBUG are read as the group forms
            prepare_process(cfg.run.dir, cfg.run.device, cfg.parallel.distributed_debug,
                            comm_timing=cfg.metrics.straggler_fraction > 0)
        self.env = env or init_distributed(cfg.run.device, cfg.parallel.backend, cfg.parallel.cpu_offload,
                                           timeout=startup_timeout(cfg.parallel.timeout_s))
        self.device = self.env.device
        self.run = resolve(cfg, self.env.world_size)  # every cross-field rule; the model's come with the tokenizer
        self.dims, self.accum = self.run.dims, self.run.accum
        if self.dims.distributed or cfg.parallel.cpu_offload:  # offload runs FSDP2, on a 1-rank mesh when alone
            ensure_process_group(self.env, cfg.parallel.backend, cfg.parallel.cpu_offload)
            self.dims.build_mesh(self.device.type)
            for line in check_placement(self.dims):  # tp / cp groups that span hosts (loom.parallel.placement)
                if self.env.is_main:
                    print(line, flush=True)
        self._objective = objective
        self._setup_determinism()
        self._setup_run_dir()
        # monitored barriers, timeouts and hang reports (loom.parallel.health); per-rank timing (loom.train.stragglers)
        self.health = Health(self.env, cfg.parallel.timeout_s, self.run_dir, step=lambda: self.step)
        self.stragglers = Stragglers(self.env, cfg.metrics.straggler_fraction, self.run_dir, self.device,
                                     group=self.health.group)
        # an elastic agent's restart of this run (rank 0 reads <run.dir>/restarts.jsonl): what it resumes from
        self.attempt = self.env.share_from_main(this_attempt(self.run_dir) if self.env.is_main else None)
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self._build_checkpointer()
        self._build_profiler()
        self._build_steps()
        self._build_fault_tolerance()
        getattr(self.objective, "prepare", lambda trainer: None)(self)  # e.g. DPO's cached reference pass
        self.evals = training_evals(cfg, self.run_dir, self.env.is_main, self.parts[0])  # eval_hook / eval_tasks
        self.step, self.tokens_seen = 0, 0
        self.guard = NonFiniteGuard(cfg.training.nonfinite, cfg.training.nonfinite_limit)
        self.preemption: Preemption | None = None  # set while fit() runs
        self._pending: StepCheck | None = None  # the last step's verdict, until the host has read it
        self.val_stats: dict[str, float] = {}  # the objective's statistics of the last validation pass
        self.stop_vote = StopVote(torch.distributed.new_group(backend="gloo") if self.env.world_size > 1 else None)

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
                os.remove(os.path.join(self.run_dir, PREEMPTED))  # an earlier run's: the launcher reads this one's
        self.env.barrier()

    def _build_data(self) -> None:
        cfg = self.cfg
        if hasattr(self._objective, "build_loader"):  # an objective that makes its own data (GRPO's rollouts)
            self.tokenizer, self.data_fingerprints = build_tokenizer(cfg.data.tokenizer), []
            self.loader = self._objective.build_loader(self)
            return
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        cache = cfg.data.cache_dir or os.path.join(self.run_dir, "cache")
        error = None
        if self.env.is_main:  # one rank tokenizes (or finds the cache); the others wait, then map it
            try:
                files = prepare_data(cfg.data, self.tokenizer, cache, data_objective(cfg.training.objective),
                                     embedded_rejected(cfg))
                describe_sources(cfg.data, files, os.path.join(self.run_dir, "data_sources.json"))
            except (ConfigError, UserError) as err:  # e.g. bytes that are not UTF-8: every rank stops, one line
                error = str(err)
        error = self.env.share_from_main(error)
        if error is not None:
            raise SharedError(error)
        if not self.env.is_main:
            files = prepare_data(cfg.data, self.tokenizer, cache, data_objective(cfg.training.objective),
                                 embedded_rejected(cfg))
        # sizes and modification times of the source files: a resume says when they changed under the same name
        self.data_fingerprints = [spec.fingerprint() for spec in
                                  parse_source(cfg.data.source, cfg.data.text_field, cfg.data.encoding_errors)]
        t = cfg.training
        # with fault tolerance, this rank's place among the ranks of every replica group
        dp_rank, dp_size = data_shard(cfg.parallel, self.dims.dp_rank(), self.dims.dp_size)
        self.loader = build_loader(cfg.data, self.tokenizer, files, seq_len=t.seq_len, seed=cfg.run.seed,
                                   dp_rank=dp_rank, dp_size=dp_size,
                                   micro_batch=t.micro_batch_size, accumulation=self.accum,
                                   objective=data_objective(t.objective))

    def _build_model(self) -> None:
        cfg = self.cfg
        self.run = self.run.with_model(self.tokenizer)  # checked against the degrees before attention is timed
        self.attention_times: dict | None = None
        if times_attention(self.run):
            self.run = self.run.with_attention(lambda: self._measure_attention(self.run.model_args))
        self.kernels, self.model_args = self.run.kernels, self.run.model_args
        with torch.device("meta"):
            model = build_model(self.model_args)
        # LoRA: adapters on lora.targets, the rest frozen (0: off)
        self.n_adapted = apply_lora(model, cfg.lora, frozen_dtype(cfg.lora, cfg.training.dtype))
        self.score_head = cfg.training.objective == "reward"
        if self.score_head:  # a reward model: the trainable score head in place of the LM head (loom.train.reward)
            attach_score_head(model)
        getattr(self._objective, "attach", lambda model: None)(model)  # heads it trains beside the model (PPO's)
        # MFU counts what the run computes: a frozen base takes no weight gradients (loom.metrics.flops)
        self.adapter_params = count_params(self.model_args, cfg.lora, self.score_head)[1] if self.n_adapted else None
        pm = parallelize_llama(model, self.dims, cfg.training, cfg.parallel, self.device, cfg.run.seed)
        self.parts = pm.parts  # this rank's model parts (pipeline stages or the model)
        if cfg.model.init_from:
            hidden = getattr(self._objective, "heads_hidden", lambda parts: contextlib.nullcontext())
            with adapters_hidden(self.parts), hidden(self.parts):  # the folder holds the base model only
                for part in self.parts:
                    load_hf_weights(part, cfg.model.init_from, whole_model=pm.plan is None)
        if cfg.lora.rank and cfg.lora.init_from:
            for part in self.parts:
                load_peft_adapter(part, cfg.lora, whole_model=pm.plan is None)
        if cfg.lora.rank and cfg.lora.base_dtype == "nf4":  # QLoRA: the base is final now; before the first forward
            for part in self.parts:
                quantize_base(part)
        self.params = unique_params(self.parts)
        self.dtype = DTYPES[cfg.training.dtype]
        self.parallel_model = pm

    def _measure_attention(self, args) -> str:
        """``model.attention = auto`` on CUDA: forward + backward of the candidates on this rank's attention shape
        (packed documents: loom's kernel and FlexAttention on the run's first micro-batch's documents; otherwise
        SDPA and loom's kernel); every rank uses rank 0's figures, so all choose the same backend."""
        cfg, tp = self.cfg, self.cfg.parallel.tp
        shape = AttentionShape(cfg.training.micro_batch_size, args.n_heads // tp, args.n_kv_heads // tp,
                               cfg.training.seq_len, args.head_dim, DTYPES[cfg.training.dtype])
        positions = self._first_positions() if cfg.data.document_positions else None
        times = self.env.share_from_main(measure_attention(attend, shape, self.device, positions))
        torch.cuda.empty_cache()
        self.attention_times = {"shape": shape.describe(), "ms_fwd_bwd": times, "chosen": fastest(times)}
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
        opt_device = torch.device("cpu") if cfg.parallel.cpu_offload else self.device  # offload: state on the host
        shard = None
        if self.dims.shard_optimizer:  # ZeRO-1: each DDP replica steps its own parameters (loom.train.zero)
            shard = OptimizerShard(self.params, self.dims["dp_replicate"] if self.dims.dp_replicate > 1 else None)
        self.optimizer = OptimizerParts(self.parts, cfg.optimizer, opt_device, offload=cfg.parallel.cpu_offload,
                                        shard=shard)
        self.scheduler = SchedulerParts(self.optimizer, cfg.training.steps, cfg.optimizer)
        # training.cuda_graphs: gradients accumulate into tensors of their own, kept between steps; a first backward
        # would otherwise hand the graphs' output memory to .grad, which the next micro-batch's replay overwrites
        self._keep_grads = cfg.training.cuda_graphs
        if self._keep_grads:
            for p in self.params:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        # parallel.diloco_inner_steps: the dp_replicate groups average their weights every H steps (loom.train.diloco)
        self.diloco = DiLoCo.build(self.parts, self.dims, cfg.parallel) if cfg.parallel.diloco_inner_steps else None
        self.scaler = LossScaler(cfg.training.dtype == "float16", cfg.training.loss_scale_init,
                                 cfg.training.loss_scale_window)

    def _build_fault_tolerance(self) -> None:
        """parallel.fault_tolerance: this job is one of several torchft replica groups (loom.parallel.fault_tolerance);
        a recovering peer gets this group's weights, optimizer state and trainer state."""
        self.ft = None
        if self.cfg.parallel.fault_tolerance:
            self.ft = ReplicaGroups(self.cfg.parallel, rank=self.env.rank, world_size=self.env.world_size,
                                    device=self.device, parts=self.parts, optimizers=self.optimizer.optimizers,
                                    trainer_state=self.state_for_checkpoint, load_trainer_state=self.load_trainer_state)

    def _data_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks that hold different tokens of a step, and over the replica groups."""
        with nvtx_range("allreduce.data_sum"):
            t = self.dims.data_sum(t)
            return self.ft.sum_(t) if self.ft else t

    def _build_checkpointer(self) -> None:
        self._check_checkpoint_space()
        self.checkpointer = CheckpointManager(self.cfg.checkpoint, self.run_dir, is_main=self.env.is_main,
                                              barrier=self.health.barrier, share=self.env.share_from_main)

    def _check_checkpoint_space(self) -> None:
        """A run that will save refuses to start when the checkpoint folder's disk cannot hold one checkpoint
        (float32 weights and the trainable ones' two AdamW moments), instead of failing at its first save."""
        c = self.cfg.checkpoint
        error = None
        if self.env.is_main and (c.every or c.at_end):
            folder = c.dir or os.path.join(self.run_dir, "checkpoints")
            total, trainable = count_params(self.model_args, self.cfg.lora, self.cfg.training.objective == "reward")
            need = 4 * (total + 2 * trainable)  # the AdamW moments of the trainable parameters only
            free = shutil.disk_usage(folder).free
            if free < need:
                error = (f"checkpoint.dir {folder}: a checkpoint of this model needs about {need:,} bytes (float32 "
                         f"weights and AdamW moments), the disk has {free:,} free: free space or choose another "
                         "checkpoint.dir")
        error = self.env.share_from_main(error)
        if error is not None:
            raise SharedError(error)

    def _build_steps(self) -> None:
        """The step strategy, chosen once: the whole model on this rank, or a pipeline schedule over its stages."""
        cfg, pm = self.cfg, self.parallel_model
        # the loss inside the model's forward: fused (no full logits), or with multi-token prediction's own losses
        in_forward = self.model_args.fused_loss or getattr(self.model_args, "mtp_depth", 0) > 0
        self.objective = self._objective or build_objective(cfg.training.objective, in_forward, cfg.dpo,
                                                            reward=cfg.reward)
        ctx = StepContext(self.dims, self.device, self._autocast, self.dims.tp_enabled and cfg.parallel.loss_parallel,
                          cfg.data.document_positions, self.profiler, cfg.training.cuda_graphs)
        if pm.plan is None:
            self.steps: LocalStep | PipelineStep = LocalStep(pm.modules[0], self.parts, self.objective, ctx)
        else:
            self.steps = PipelineStep(pm.plan, self.parts, pm.modules, self.objective, ctx, self.accum)
        self.moe = MoEBalance(self.parts, self.dims, cfg.training.global_batch_size, self.model_args.n_layers,
                              cfg.training.compile, self.steps.stage_sum,
                              self.model_args) if self.model_args.moe else None
        # metrics.noise_scale (loom.train.noise_scale); resolve allows it only with accumulation and no pipeline
        self.noise = NoiseScaleProbe.build(self.steps, self.dims, self.objective) if cfg.metrics.noise_scale else None

    def _build_profiler(self) -> None:
        """metrics.profile_steps; no block ranges under torch.compile (the hooks would run in its graph); NVTX
        ranges on or off for this process (metrics.nvtx: one run may follow another in a process)."""
        enable_nvtx(self.cfg.metrics.nvtx)
        blocks = None if self.cfg.training.compile else transformer_blocks(self.parts)
        self.nvtx_blocks = nvtx_block_ranges(blocks) if self.cfg.metrics.nvtx else None
        # PyTorch's memory history made the backward of MoE blocks under activation checkpointing fail (torch 2.11,
        # H100: "run_backward returned NULL without setting an exception"; docs/metrics.md): no snapshot there
        no_snapshot = "skipped: PyTorch's memory history breaks the backward of MoE blocks under activation " \
            "checkpointing" if self.model_args.moe and self.cfg.training.activation_checkpointing != "none" else ""
        self.profiler = StepProfiler(profile_window(self.cfg.metrics), self.run_dir, self.env.rank, self.device,
                                     blocks, is_main=self.env.is_main, no_snapshot=no_snapshot)

    # ---- one step -------------------------------------------------------------
    def _local_tokens(self, mb: MicroBatch) -> MicroBatch:
        """This rank's share of a micro-batch on the device: under context parallelism its two chunks of
        every sequence (loom.parallel.context_parallel), else all of it."""
        mb = mb.to(self.device)
        if not self.dims.cp_enabled:
            return mb
        rank, cp = self.dims.cp_rank(), self.dims.cp
        return MicroBatch(*(shard_sequence(t, rank, cp) for t in (mb.inputs, mb.labels, mb.positions,
                                                                   mb.document_ids)))

    def _autocast(self):
        return autocast_context(self.dtype, self.device, fsdp_casts=fsdp_wraps(self.dims, self.cfg.parallel))

    def train_step(self, micro_batches: list[MicroBatch]) -> dict:
        mbs = [self._local_tokens(mb) for mb in micro_batches]
        local = sum(self.objective.count(mb) for mb in mbs).to(torch.float32)
        group = self.diloco.group_sum(local.clone()) if self.diloco else None  # DiLoCo: a replica group's tokens
        n_tokens = self._data_sum(local)
        # a global batch without a unit to count (an SFT batch without an assistant token) has loss 0 and zero
        # gradients, not 0 / 0, and makes no update (``has_units``; _settle says so)
        has_units, denominator = n_tokens > 0, n_tokens.clamp(min=1)
        # gradient reductions average over the dp x cp ranks; multiplying by their count makes them a sum,
        # so every micro-batch on every rank contributes token_loss / global_tokens
        grad_scale = self.dims.dp_size * self.dims.cp * self.scaler.scale / denominator
        if self.diloco:  # a group's gradient is the mean over its own tokens (FSDP2 averages over dp_shard x cp)
            grad_scale = self.dims.dp_shard * self.dims.cp * self.scaler.scale / group.clamp(min=1)
        if self.moe:
            self.moe.scale(self.scaler.scale)
        getattr(self.objective, "step_stats", dict)()  # statistics of forwards before this step are not its own
        result = self.noise.step(mbs, grad_scale, self.scaler.scale) if self.noise else self.steps.step(mbs, grad_scale)
        stats = self._objective_stats(denominator)
        if self.dims.ep_enabled:  # see loom.parallel.expert_parallel: expert gradients averaged over fewer ranks
            scale_grads(expert_params(self.parts), self.dims.expert_grad_factor)
        lr = self.optimizer.param_groups[0]["lr"]
        if self.ft:  # each group's gradient is its tokens' share of the global mean: summed over the groups
            self.ft.sum_grads(self.params, self.cfg.parallel.ddp_bucket_mb)
        loss = self._data_sum(result.loss_sum) / denominator
        with self.profiler.phase("optimizer"):  # grad norm, clipping, step (skipped where not finite), zero_grad
            if self.ft and not self.ft.should_commit():  # a replica group failed during the step: no update
                self.optimizer.zero_grad(set_to_none=True)
                return {"committed": False}
            with nvtx_range("grad_norm"):  # the norm's all-reduce over the shards / stages
                norm = self.steps.grad_norm() / self.scaler.scale
            if self.noise:
                self.noise.observe(norm, denominator)
            # both are global (summed and normed over every rank): every rank reaches the same verdict. Under
            # float16 an infinite gradient norm is an overflow, the loss scaler's to handle.
            finite = torch.isfinite(loss)
            if not self.scaler.enabled:
                finite = finite & torch.isfinite(norm.to(loss.device))
            clip = 1.0 if self.cfg.training.max_norm == 0 else torch.clamp(
                self.cfg.training.max_norm / (norm + 1e-6), max=1.0)
            scaled = self.scaler.enabled or self.cfg.training.max_norm
            factor = clip / self.scaler.scale if scaled else None
            deferred = self.optimizer.skips_on_device and not self.scaler.enabled
            # whether the update applies: not where the loss or norm is not finite, nor where nothing was counted.
            # _settle tells the two apart: an empty step's loss and norm are finite (0)
            applies = finite & has_units
            if self.diloco:  # a gradient norm is its group's: the groups skip together
                applies = self.diloco.agree(applies)
            # copied to the host before the update is queued: reading it waits for this point, not the update
            self._pending = StepCheck(self.step + 1, applies, loss, norm, deferred)
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
            self.optimizer.zero_grad(set_to_none=not self._keep_grads)
            if self.diloco:  # every H steps (per fragment), applied or not: the rounds stay aligned
                self.diloco.after_step(self.step + 1)
        out = {"loss": loss, "grad_norm": norm, "tokens": n_tokens, "lr": lr, "stats": stats}
        if self.moe:  # aux-loss-free balancing: the selection biases move after the update (loom.train.moe_stats)
            out["moe_bias"] = self.moe.update_bias(applies, self.device)
        if self.moe:
            balance = self.moe.read(self.device)
            # a pipeline's first schedule run in a process also runs each stage on placeholder inputs (shape
            # inference), whose routing is noise: that step's balance is not reported
            out["moe_balance"] = None if result.shape_inference else balance
        return out

    def _evaluates_at(self, step: int) -> bool:
        """Whether ``step`` has a validation pass: every training.eval_every steps, and the last step
        (training.eval_at_end) where the layout can run it (a pipeline needs whole schedule runs)."""
        t = self.cfg.training
        if t.eval_every and step % t.eval_every == 0:
            return True
        return (t.eval_at_end and step == t.steps and self.cfg.data.val_fraction > 0
                and (self.dims.pp == 1 or t.eval_batches % self.accum == 0))

    @torch.no_grad()
    def evaluate(self, quiet: bool = False) -> float | None:
        """The validation loss on the held-out windows (None without any); ``quiet``: no warning when they hold no
        target (the pass at the end that training.eval_at_end adds by default)."""
        batches = self.loader.validation(self.cfg.training.eval_batches)
        if not batches:
            return None
        for part in self.parts:
            part.eval()
        batches = [self._local_tokens(mb) for mb in batches]
        count = self._data_sum(sum(self.objective.count(mb) for mb in batches).to(torch.float32))
        getattr(self.objective, "step_stats", dict)()
        total = self.steps.evaluate(batches)
        self.val_stats = {k: float(v) for k, v in self._objective_stats(count).items()}
        for part in self.parts:
            part.train()
        if float(count) == 0:  # held-out windows without a target (SFT: no assistant token): no loss to report
            if self.env.is_main and not quiet:
                print(f"step {self.step}: warning: the validation batches hold nothing to evaluate (targets 0): no "
                      "val_loss (raise training.eval_batches or training.seq_len)", flush=True)
            return None
        return float(self._data_sum(total) / count)

    def run_evals(self) -> dict[str, float]:
        """training.eval_hook and eval_tasks on the live model (loom.eval.hook): {"eval/<name>": value}."""
        if self.evals is None:
            return {}
        for part in self.parts:
            part.eval()
        try:
            # the model itself (one part: no pipeline), not a DDP wrapper: evaluation takes no gradients
            return self.evals(self.parts[0], self.tokenizer, self.step, self.device, self._autocast)
        finally:
            for part in self.parts:
                part.train()

    def _objective_stats(self, count: torch.Tensor) -> dict[str, torch.Tensor]:
        """The objective's statistics of the micro-batches just run, summed over the data-parallel ranks and divided
        by the global ``count`` (e.g. DPO's rewards and accuracy per pair)."""
        stats = self.objective.step_stats() if hasattr(self.objective, "step_stats") else {}
        return {k: self._data_sum(torch.as_tensor(v, dtype=torch.float32, device=self.device).clone()) / count
                for k, v in sorted(stats.items())}

    # ---- the loop ---------------------------------------------------------------
    def state_for_checkpoint(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "lineage": self.checkpointer.lineage, "nonfinite": self.guard.state_dict(),
                "data_fingerprints": self.data_fingerprints,
                **({"diloco": self.diloco.record(self.step)} if self.diloco else {}),
                "rng": {"cpu": torch.get_rng_state().tolist(),
                        "cuda": torch.cuda.get_rng_state().tolist() if self.device.type == "cuda" else None}}

    def load_trainer_state(self, state: dict) -> None:
        """A loaded checkpoint's trainer state, adapted to this run's config where it differs from the one the
        checkpoint was written with (loom.train.resume_changes: data position, LR schedule, optimizer groups,
        loss scale)."""
        old = checkpoint_values(state.get("checkpoint"))  # the checkpoint's config (None: unknown, the same)
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.loader.load_state_dict(loader_state(state["loader"], old))
        self.scheduler.load_state_dict(state["scheduler"])  # its position; the schedule is this run's
        apply_optimizer_config(self.optimizer, self.cfg.optimizer)
        self.scaler.load_state_dict(state["scaler"])
        restore_loss_scale(self.scaler, old, self.cfg.training)
        self.guard.load_state_dict(state.get("nonfinite", {}))  # steps whose batches are skipped stay skipped
        if self.diloco:  # the checkpoint's pending outer reductions (parallel.diloco_overlap_steps)
            self.diloco.resumed(self.step)
        torch.set_rng_state(torch.tensor(state["rng"]["cpu"], dtype=torch.uint8))
        if state["rng"].get("cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(state["rng"]["cuda"], dtype=torch.uint8))

    def save_checkpoint(self) -> None:
        """Save this step; weights that are not finite are never written (the run stops, the last checkpoint stays)."""
        if self.env.any_rank(not self._weights_finite()):
            raise TrainingStopped(f"the weights are not finite at step {self.step}: no checkpoint written (the last "
                                  "complete one stays)")
        with nvtx_range("checkpoint_save"):
            self.checkpointer.save(self.step, self.parts, self.optimizer, self.state_for_checkpoint(),
                                   self.recorded_toml, replica=self.diloco)

    def resume(self) -> None:
        # a restarted attempt continues the launch's own lineage; otherwise checkpoint.resume decides
        folder = restart_checkpoint(self.attempt, self.checkpointer) or self.checkpointer.choose()
        if folder is None:
            return
        # this run's config against the checkpoint's before any weight is read: a shape change stops here
        changes = on_main(lambda: check_checkpoint(folder, self.cfg, self.tokenizer, self.kernels),
                          self.env.is_main, self.env.share_from_main)
        if self.diloco:  # before any weight is read: another number of groups is refused
            self.diloco.check_resume(folder)
        state = self.checkpointer.load(folder, self.parts, self.optimizer, replica=self.diloco)
        if state is None and self.diloco:  # weights only: the first round starts from them
            self.diloco.restart()
        if state is not None:
            self.load_trainer_state(state)
            if self.env.is_main:
                print(f"resumed from step {self.step}", flush=True)
                if changes.line():
                    print(changes.line(), flush=True)
                if state.get("data_fingerprints", self.data_fingerprints) != self.data_fingerprints:
                    print(f"data.source = {self.cfg.data.source or '<stdlib>'!r}: its files changed since the "
                          "checkpoint (sizes or modification times); the data position continues in the new "
                          "content, so the batches differ from an uninterrupted run", flush=True)
                # records a run wrote past this checkpoint: the resumed run writes those steps again
                dropped = rewind_metrics(os.path.join(self.run_dir, "metrics.jsonl"), self.step)
                if dropped:
                    print(f"metrics.jsonl: dropped {dropped} record(s) after step {self.step}", flush=True)

    def _weights_finite(self) -> bool:
        local = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in self.params]
        return bool(torch.stack([torch.isfinite(t).all() for t in local if t.numel()]).all()) if local else True

    def _rollback(self, logger, records: list[dict]) -> None:
        """training.nonfinite = rollback: the newest complete checkpoint of this run back in place; the guard
        keeps its record of offending steps, whose batches the replay skips; records past it are dropped."""
        self.checkpointer.wait()
        folder = self.checkpointer.latest()
        if folder is None:
            raise TrainingStopped(f"non-finite step {self.step} and no complete checkpoint of this run to roll back "
                                  "to (training.nonfinite = rollback; save with checkpoint.every)")
        guard = self.guard.state_dict()
        state = self.checkpointer.load(folder, self.parts, self.optimizer, replica=self.diloco)
        self.load_trainer_state(state)
        self.guard.load_state_dict(guard)
        self.guard.rolled_back_to(self.step)
        records[:] = [r for r in records if r["step"] <= self.step]
        if logger:
            logger.rewind(self.step)
        if self.env.is_main:
            print(f"rolled back to step {self.step} ({folder}); the batches of step(s) "
                  f"{', '.join(map(str, sorted(self.guard.skip_steps)))} will be skipped", flush=True)

    def _skip_offending_batch(self) -> None:
        """A step whose batch made a rollback happen: its data is consumed, no update is made."""
        self.loader.next_step()
        self.step += 1
        self.tokens_seen += self.cfg.training.global_batch_size * self.cfg.training.seq_len
        if self.env.is_main:
            print(f"step {self.step}: batch skipped (it made the loss non-finite before a rollback)", flush=True)

    def _settle(self) -> str:
        """Read the last step's verdict: ``ok``; or, for a step without an update, take back the host's counts of
        the update the device skipped and say so at once. A step that counted nothing (targets 0) is ``ok``; for a
        non-finite one, answer what training.nonfinite does (``skip``, ``stop``, ``rollback``)."""
        check, self._pending = self._pending, None
        if check is None:
            return "ok"
        applied, loss, norm = check.read()
        if applied:
            self.guard.finite_step()
            return "ok"
        if check.deferred:
            self.optimizer.unstep()
            self.scheduler.unstep()
        if math.isfinite(loss) and math.isfinite(norm):  # not applied, yet finite: the global batch counted nothing
            if self.env.is_main:
                print(f"step {check.step}: warning: nothing to train on in the global batch (targets 0: every label "
                      "masked): loss 0, no update (the optimizer and the LR schedule do not advance; the data does)",
                      flush=True)
            return "ok"
        action = self.guard.bad_step(check.step, loss, norm)
        if self.env.is_main:
            print(f"step {check.step}: non-finite loss {loss} / grad norm {norm}: update skipped "
                  f"({self.guard.streak} in a row, {self.guard.skipped} in all; training.nonfinite = "
                  f"{self.guard.mode})", flush=True)
        return action

    def fit(self) -> list[dict]:
        """Train to ``training.steps``; returns the logged records (rank 0; others get [])."""
        cfg = self.cfg
        self.resume()
        begin_attempt(self.attempt, self.run_dir, step=self.step, world_size=self.env.world_size,
                      lineage=self.checkpointer.lineage, is_main=self.env.is_main)  # restarts.jsonl, one line
        if self.ft:
            self.ft.set_step(self.step)  # the lighthouse compares the groups' steps: a group behind recovers
        if self.step == 0 and self.env.is_main:
            self._set_aside_old_metrics()
        self.preemption = Preemption(cfg.checkpoint.preempt_grace_s, rank=self.env.rank)
        peak = device_peak(self.device, cfg.training.dtype)
        if self.env.is_main:
            for line in self._banner():
                print(line, flush=True)
        logger = MetricsLogger(self.run_dir, cfg.training.steps, tensorboard=cfg.metrics.tensorboard,
                               progress=cfg.metrics.progress, start_step=self.step,
                               config=cfg, console=getattr(self.objective, "console", ())) \
            if self.env.is_main else None
        records: list[dict] = []
        reset_peak(self.device)
        t_last, tokens_last = time.perf_counter(), self.tokens_seen
        finished = False
        try:
            self.health.start_barrier()  # every rank built and resumed: names the ranks that never arrive
            self.health.start_training()  # from here each collective waits at most parallel.timeout_s
            self.stragglers.start(self.step)
            while self.step < cfg.training.steps:
                self.checkpointer.poll()
                verdict = self._settle()  # the last step's, if still unread
                if verdict == "stop":
                    raise TrainingStopped(self.guard.why)
                if verdict == "rollback":
                    self._rollback(logger, records)
                    t_last, tokens_last = time.perf_counter(), self.tokens_seen
                    continue
                if self.step + 1 in self.guard.skip_steps:
                    self._skip_offending_batch()
                    continue
                if self.ft:  # the replica groups' quorum; a group behind the others takes a peer's state here
                    self.ft.start_step()
                    if self.step >= cfg.training.steps:
                        continue
                logs = self._logs_at(self.step + 1)
                position = self.loader.state_dict() if self.ft else None  # a step not committed reruns its batch
                with self.stragglers.data_wait(), nvtx_range("data_wait"):
                    data = self.loader.next_step(with_hash=self.env.is_main and logs)  # the hash reads the whole batch
                self.profiler.start(self.step + 1)
                with nvtx_range(f"step {self.step + 1}"):
                    out = self.train_step(data.micro_batches)
                if not out.get("committed", True):
                    self.loader.load_state_dict(position)
                    if self.env.is_main:
                        print(f"step {self.step + 1}: not committed (a replica group failed during it): it runs "
                              "again", flush=True)
                    continue
                self.step += 1
                self.profiler.step_done(self.step)
                self.tokens_seen += cfg.training.global_batch_size * cfg.training.seq_len
                preempted = self.stop_vote.agreed(self.preemption.requested)  # every step: schedulers give 30 s
                saves = bool(cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0) or preempted
                # records and checkpoints see this step's verdict (these steps sync the host anyway)
                verdict = self._settle() if logs or saves or self.step == cfg.training.steps else "unread"
                if verdict == "rollback":
                    self._rollback(logger, records)
                    t_last, tokens_last = time.perf_counter(), self.tokens_seen
                    continue
                if logger:
                    logger.progress.update(self.step)
                val, evals = None, {}
                if verdict != "stop" and self._evaluates_at(self.step):
                    with nvtx_range("validation"):
                        val = self.evaluate(quiet=not (cfg.training.eval_every
                                                       and self.step % cfg.training.eval_every == 0))
                        evals = self.run_evals()
                if logs or verdict == "stop":  # the step that stops the run is on record too
                    now = time.perf_counter()
                    rec = self._record(out, data.global_hash, val, now - t_last, self.tokens_seen - tokens_last, peak)
                    rec.update(evals)
                    rec.update(self.stragglers.interval(self.step, now - t_last))  # every rank: one all_gather
                    t_last, tokens_last = now, self.tokens_seen
                    if logger:
                        logger.log(rec)
                        records.append(rec)
                if verdict == "stop":
                    raise TrainingStopped(self.guard.why)
                if saves:
                    self.save_checkpoint()
                if preempted:
                    self.checkpointer.wait()
                    if self.env.is_main:
                        with open(os.path.join(self.run_dir, PREEMPTED), "w") as fh:
                            json.dump({"step": self.step, "reason": self.preemption.reason}, fh)
                        print(f"{self.preemption.reason or 'stop request'}: saved step {self.step}, exiting", flush=True)
                    break
            else:
                if cfg.checkpoint.at_end and not (cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0):
                    self.save_checkpoint()
            if self.diloco:  # outer reductions still in flight finish before the process group can go
                self.diloco.wait()
            self.checkpointer.wait()
            finished = True
        except RuntimeError as err:  # a collective that timed out: the hang report (loom.parallel.health)
            if not self.health.is_hang(err):
                raise
            raise self.health.hang(err) from None
        finally:
            self.health.close()
            self.stop_vote.close(wait=finished)
            if self.ft:
                self.ft.shutdown()
            self.preemption.restore()
            self.profiler.close()
            if self.nvtx_blocks:
                self.nvtx_blocks.close()
            if logger:
                logger.close()
        if self.env.is_main:
            print(self._where_things_are(), flush=True)
        return records

    def _banner(self) -> list[str]:
        """What this run is: its folder, the model actually built, the layout, the data, the kernels."""
        cfg, args = self.cfg, self.model_args
        name = f"{cfg.model.init_from} (imported)" if cfg.model.init_from else f"flavor {cfg.model.flavor}"
        moe = f", {args.moe_experts} experts (top {args.moe_top_k})" if args.moe_experts else ""
        note = mfu_note(self.device, cfg.training.dtype)
        cp_note = f" (cp > 1: attention goes through loom's flash_attention op, K/V by {cfg.parallel.cp_method})" \
            if self.dims.cp_enabled else ""
        t = cfg.training
        total, trainable = count_params(args, cfg.lora, self.score_head)
        lora = cfg.lora
        adapters = [f"LoRA rank {lora.rank} on {lora.targets} ({self.n_adapted} linears, base {lora.base_dtype}): "
                    f"{trainable / 1e6:.2f}M trainable parameters, {100 * trainable / total:.2f}%"] if lora.rank else []
        if lora.rank and not cfg.model.init_from:  # the base stays frozen at its seeded random weights
            adapters.append("warning: LoRA adapters on an untrained base (no model.init_from): the base stays frozen "
                            "at its random initialization, so the adapters alone learn; set model.init_from to a "
                            "trained model (a Hugging Face folder or a `loom convert --to-hf` export)")
        return [
            f"loom: run dir {os.path.abspath(self.run_dir)}",
            f"model: {name}, {total / 1e6:.1f}M params ({args.n_layers} layers, dim {args.dim}, "
            f"{args.n_heads} heads, vocab {args.vocab_size}{moe})",
            *adapters,
            f"layout: {self.dims.describe()}, accumulation {self.accum}, dtype {t.dtype}, device {self.device.type}"
            f"{'; ' + note if note else ''}",
            *(["offload: FSDP2 keeps the weights, gradients and AdamW state in host memory; the device holds the "
               "blocks being computed (parallel.cpu_offload)"] if cfg.parallel.cpu_offload else []),
            f"batch: {t.global_batch_size} x {t.seq_len} = {t.global_batch_size * t.seq_len:,} tokens per step, "
            f"{t.steps} steps",
            *self.loader.describe(t.global_batch_size, t.steps),
            f"kernels: {self.kernels.describe()}{self._measured()}{cp_note}",
            *self._describe_steps(),
            *([f"fault tolerance: replica group {cfg.parallel.ft_replica_id} of {cfg.parallel.ft_replica_groups} "
               f"(torchft, lighthouse {lighthouse_address(cfg.parallel)}); the groups split each global batch"]
              if self.ft else []),
        ]

    def _where_things_are(self) -> str:
        """The run's last line: where its newest checkpoint, metrics and TensorBoard events are."""
        parts = [f"loom: stopped at step {self.step}"]
        saved = self.checkpointer.last_saved_step
        if saved is not None:
            folder = os.path.join(self.checkpointer.dir, step_dir_name(saved))
            parts.append(f"checkpoint {os.path.abspath(folder)}")
        for label, name in (("metrics", "metrics.jsonl"), ("TensorBoard events", "tensorboard")):
            path = os.path.join(os.path.abspath(self.run_dir), name)
            if os.path.exists(path):
                parts.append(f"{label} {path}")
        return "; ".join(parts)

    def _set_aside_old_metrics(self) -> None:
        """A fresh start in a run dir with an earlier run's metrics.jsonl: renamed, never appended to or lost."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if os.path.exists(path) and os.path.getsize(path):
            dest = os.path.join(self.run_dir, f"metrics.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            os.replace(path, dest)
            print(f"a fresh start: the earlier metrics.jsonl is now {dest}", flush=True)

    def _measured(self) -> str:
        if self.attention_times is None:
            return ""
        t = self.attention_times
        figures = ", ".join(f"{name} {ms:.3f}" for name, ms in t["ms_fwd_bwd"].items())
        return f" (attention measured at start-up, ms per forward+backward on {t['shape']}: {figures})"

    def _describe_steps(self) -> list[str]:
        lines = self.steps.describe(self.accum)
        plan = self.parallel_model.plan
        if plan is not None and self.dims.fsdp_applied and self.dims.reshard_after_forward and not \
                fsdp_reshard_after_forward(self.dims, plan):
            lines.append(f"pipeline: {plan.schedule} computes weight gradients in a pass of their own, so FSDP keeps "
                         "each block's parameters gathered from forward to the gradient reduction (parallel."
                         "reshard_after_forward = true does not apply)")
        return lines

    def _logs_at(self, step: int) -> bool:
        """Whether ``step`` is logged (metrics.every, the last step, or a validation step)."""
        t = self.cfg.training
        return (step % self.cfg.metrics.every == 0 or step == t.steps
                or bool(t.eval_every and step % t.eval_every == 0))

    def _record(self, out: dict, batch_hash, val, seconds: float, tokens: int, peak) -> dict:
        tps = tokens / max(seconds, 1e-9)
        per_dev = tps / self.env.world_size
        return {
            "step": self.step,
            "loss": float(out["loss"]),
            "grad_norm": float(out["grad_norm"]),
            "lr": out["lr"],
            "tokens": self.tokens_seen,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": per_dev,
            "mfu": mfu(per_dev, self.model_args, self.cfg.training.seq_len, peak, self.adapter_params),
            "mem_gib": peak_memory_gib(self.device),
            "val_loss": val,
            **({"noise_scale": self.noise.value()} if self.noise else {}),
            "targets": float(out["tokens"]),  # the global count the loss is averaged over (tokens; DPO: pairs)
            **{k: float(v) for k, v in out.get("stats", {}).items()},
            **({f"val_{k}": v for k, v in self.val_stats.items()} if val is not None else {}),
            **({"diloco_bytes": self.diloco.bytes_sent} if self.diloco else {}),
            "skipped_steps": self.scaler.skipped,
            "nonfinite_steps": self.guard.skipped,
            "batch_hash": batch_hash,
            **({"replica_groups": self.ft.participants} if self.ft else {}),
            **({"mem_gib_max_rank": self.env.max_over_ranks(peak_memory_gib(self.device))}
               if self.dims.distributed else {}),
            **self.steps.record(),
            **metrics_fields(self.attempt),  # restarts: this attempt's index after an elastic restart
            **getattr(self.objective, "record", dict)(),  # e.g. GRPO's rewards and time split
            **({"moe_balance": None if out["moe_balance"] is None else float(out["moe_balance"])}
               if "moe_balance" in out else {}),
            **{k: float(v) for k, v in out.get("moe_bias", {}).items()},
        }
