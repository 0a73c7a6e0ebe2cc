"""The trainer, assembled from small build steps. ``Trainer(cfg).fit()`` is the whole job."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from loom.config.errors import ConfigError, SharedError, UserError
from loom.config.load import accumulation_steps, profile_window, to_toml
from loom.config.sections import Config
from loom.data import build_loader, build_tokenizer, prepare_data
from loom.data import describe_sources
from loom.data.loader import MicroBatch
from loom.kernels.dispatch import KernelChoice, resolve_kernels
from loom.kernels.triton_support import has_triton
from loom.models.common.float8 import float8_available
from loom.models.common.moe import set_aux_scale, take_balance
from loom.metrics.flops import device_peak, mfu
from loom.metrics.logger import MetricsLogger
from loom.metrics.memory import peak_memory_gib, reset_peak
from loom.metrics.profile import StepProfiler, transformer_blocks
from loom.models.llama import FLAVORS, Llama, round_vocab
from loom.parallel.parallelize import fsdp_reshard_after_forward, parallelize_llama
from loom.parallel.context_parallel import shard_sequence
from loom.parallel.dims import ParallelDims
from loom.parallel.env import DistEnv, init_distributed
from loom.parallel.expert_parallel import expert_params
from loom.parallel.pipeline import V_SHAPED, BusyClock, build_schedule, forward_chain, theoretical_bubble
from loom.parallel.tensor_parallel import loss_parallel_context, to_local_loss
from loom.train.grads import TiedEmbeddingGrads, global_grad_norm, scale_grads, unique_params
from loom.train.guard import NonFiniteGuard, Preemption, StepCheck, StopVote, TrainingStopped
from loom.train.optimizer import OptimizerParts
from loom.numerics import DTYPES, cross_entropy_sum, valid_tokens
from loom.train.precision import LossScaler, autocast_context
from loom.train.run_dir import acquire, check_writable_dirs
from loom.train.schedule import SchedulerParts


def resolve_model_args(cfg: Config, tokenizer, kernels: KernelChoice | None = None):
    """Flavor shape + vocabulary (flavor, then model.vocab_size, else tokenizer rounded to 128) + ``kernels``,
    by default those ``kernel_choice(cfg)`` picks without measuring (the trainer may replace them after timing)."""
    if cfg.model.init_from:
        from loom.checkpoint.hf import llama_args_from_hf

        args = llama_args_from_hf(cfg.model.init_from)
        if cfg.model.moe_experts and cfg.model.moe_experts != args.moe_experts:
            held = f"{args.moe_experts} experts" if args.moe else "a dense model"
            raise ConfigError("model.moe_experts", cfg.model.moe_experts, f"model.init_from {cfg.model.init_from} "
                              f"holds {held}: allowed 0 (the folder's)")
        if args.moe and cfg.model.moe_ffn_dim and cfg.model.moe_ffn_dim != args.expert_ffn_dim:
            raise ConfigError("model.moe_ffn_dim", cfg.model.moe_ffn_dim, f"model.init_from {cfg.model.init_from} "
                              f"has experts {args.expert_ffn_dim} wide: allowed 0 (the folder's)")
    else:
        args = FLAVORS[cfg.model.flavor]
    vocab = cfg.model.vocab_size or args.vocab_size or round_vocab(tokenizer.vocab_size)
    if vocab < tokenizer.vocab_size:
        raise ConfigError("model.vocab_size", vocab, f"must be >= the tokenizer's vocabulary ({tokenizer.vocab_size})")
    tie = args.tie_embeddings if cfg.model.tie_embeddings == "flavor" else cfg.model.tie_embeddings == "true"
    layers = cfg.model.n_layers or args.n_layers
    m = cfg.model
    args = args.with_(vocab_size=vocab, tie_embeddings=tie, max_seq_len=cfg.training.seq_len, n_layers=layers,
                      residual_init=m.residual_init, moe_experts=m.moe_experts or args.moe_experts,
                      moe_top_k=m.moe_top_k or args.moe_top_k, moe_ffn_dim=m.moe_ffn_dim or args.moe_ffn_dim,
                      moe_aux_loss=m.moe_aux_loss, **(kernels or kernel_choice(cfg)).as_args())
    check_moe(args, cfg)
    return args


def check_moe(args, cfg: Config) -> None:
    """What a mixture-of-experts model does not support (yet), as config errors."""
    if not args.moe:
        return
    if args.moe_top_k > args.moe_experts:
        raise ConfigError("model.moe_top_k", args.moe_top_k, f"must be <= the number of experts ({args.moe_experts})")
    if cfg.training.compile and cfg.training.dtype != "bfloat16":
        raise ConfigError("training.compile", True, "with a mixture-of-experts model needs training.dtype bfloat16 "
                          "(the experts' grouped GEMM keeps shapes static; the per-expert loop of other dtypes has "
                          "data-dependent sizes): allowed false with " + cfg.training.dtype)


def flex_unsupported(cfg: Config) -> bool:
    """FlexAttention inside compiled blocks under op-level checkpointing: its backward hit a CUDA illegal address
    (torch 2.11 on an H100, whether the policy saved Flex's output or recomputed it; bench/NOTES.md). Full and
    every-k recomputation avoid it by checkpointing outside the compiled block (``parallelize_llama``)."""
    return cfg.training.compile and cfg.training.activation_checkpointing == "op"


def kernel_choice(cfg: Config, measure_attention=None) -> KernelChoice:
    """model.attention / model.fused_* with ``auto`` resolved for this run (loom.kernels.dispatch);
    ``measure_attention``: a callable timing the attention backends on this run's shape (the trainer's)."""
    device = "cuda" if cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available()) else "cpu"
    if cfg.model.attention == "flex" and device != "cuda":
        raise ConfigError("model.attention", "flex", "needs CUDA (PyTorch's FlexAttention has no backward on "
                          "CPU): allowed auto | sdpa | flash")
    if cfg.model.attention == "flex" and flex_unsupported(cfg):
        raise ConfigError("model.attention", "flex", "under training.compile with training.activation_checkpointing "
                          "op crashed its backward (CUDA illegal address; torch 2.11, H100): allowed auto | sdpa | "
                          "flash there (or flex without compile, or with none | full | every_k checkpointing)")
    if device == "cuda" and not has_triton() and (cfg.model.attention in ("flash", "flex") or "true" in (
            cfg.model.fused_norm, cfg.model.fused_rope, cfg.model.fused_swiglu, cfg.model.fused_loss)):
        raise ConfigError("model.attention / model.fused_*",
                          cfg.model.attention if cfg.model.attention in ("flash", "flex") else "true",
                          "needs Triton on CUDA (pip install triton); allowed auto | sdpa | false without it")
    if cfg.training.float8 != "none" and not float8_available():
        raise ConfigError("training.float8", cfg.training.float8, "needs torchao (pip install torchao): allowed none")
    return resolve_kernels(cfg.model, device, compile=cfg.training.compile, documents=cfg.data.document_positions,
                           tp=cfg.parallel.tp > 1, pp=cfg.parallel.pp > 1, measure_attention=measure_attention)


def count_params(args) -> int:
    """Parameters of the whole model (whatever this rank holds)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Llama(args).parameters())


PREEMPTED = "preempted.json"  # written by rank 0 after a preemption save: the launcher reads it


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv | None = None):
        self.cfg = cfg
        self.env = env or init_distributed(cfg.run.device, cfg.parallel.backend)
        self.device = self.env.device
        self.dims = ParallelDims.from_config(cfg.parallel, self.env.world_size)
        if self.dims.distributed:
            self.dims.build_mesh(self.device.type)
        self.accum = accumulation_steps(cfg.training, self.dims.dp_size)
        t = cfg.training
        self.dims.check_microbatches(self.accum, cfg.parallel, t.global_batch_size,
                                     t.eval_batches if t.eval_every else None)
        if cfg.parallel.async_tp and self.device.type != "cuda":
            raise ConfigError("parallel.async_tp", True, "needs CUDA devices (symmetric memory)")
        self._setup_determinism()
        self._setup_run_dir()
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self._build_checkpointer()
        self._build_profiler()
        self.step, self.tokens_seen = 0, 0
        self.guard = NonFiniteGuard(cfg.training.nonfinite, cfg.training.nonfinite_limit)
        self.preemption: Preemption | None = None  # set while fit() runs
        self._pending: StepCheck | None = None  # the last step's verdict, until the host has read it
        self.stop_vote = StopVote(dist.new_group(backend="gloo") if self.env.world_size > 1 else None)

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
        error = None
        if self.env.is_main:
            try:
                check_writable_dirs(self.cfg)
                acquire(self.run_dir)
            except (ConfigError, UserError) as err:
                error = str(err)
        error = self.share_from_main(error)
        if error is not None:
            raise SharedError(error)
        if self.env.is_main:
            with open(os.path.join(self.run_dir, "config.toml"), "w") as fh:
                fh.write(to_toml(self.cfg))
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.run_dir, PREEMPTED))  # an earlier run's: the launcher reads this one's
        self.barrier()

    def _build_data(self) -> None:
        cfg = self.cfg
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        cache = cfg.data.cache_dir or os.path.join(self.run_dir, "cache")
        error = None
        if self.env.is_main:  # one rank tokenizes (or finds the cache); the others wait, then map it
            try:
                files = prepare_data(cfg.data, self.tokenizer, cache)
                describe_sources(cfg.data, files, os.path.join(self.run_dir, "data_sources.json"))
            except (ConfigError, UserError) as err:  # e.g. bytes that are not UTF-8: every rank stops, one line
                error = str(err)
        error = self.share_from_main(error)
        if error is not None:
            raise SharedError(error)
        if not self.env.is_main:
            files = prepare_data(cfg.data, self.tokenizer, cache)
        t = cfg.training
        self.loader = build_loader(cfg.data, self.tokenizer, files, seq_len=t.seq_len, seed=cfg.run.seed,
                                   dp_rank=self.dims.dp_rank(), dp_size=self.dims.dp_size,
                                   micro_batch=t.micro_batch_size, accumulation=self.accum)

    def _build_model(self) -> None:
        cfg = self.cfg
        shape = resolve_model_args(cfg, self.tokenizer)
        self.dims.check_model(shape, cfg.parallel)  # before timing attention on the per-rank head counts
        self.attention_times: dict | None = None  # deterministic runs do not let a timing pick their kernels
        # under context parallelism attention always runs loom's op: nothing to time
        # nor with packed documents where only loom's kernel can run (Flex under compiled op-level checkpointing)
        untimed = cfg.run.deterministic or self.dims.cp_enabled or (cfg.data.document_positions and flex_unsupported(cfg))
        measure = None if untimed else (lambda: self._measure_attention(shape))
        self.kernels = kernel_choice(cfg, measure)
        self.model_args = shape.with_(**self.kernels.as_args())
        with torch.device("meta"):
            model = Llama(self.model_args)
        pm = parallelize_llama(model, self.dims, cfg.training, cfg.parallel, self.device, cfg.run.seed)
        self.parts, self.plan = pm.parts, pm.plan  # this rank's model parts (pipeline stages or the model)
        self._pipeline_ran = False  # whether a pipeline schedule ran in this process (its first run infers shapes)
        if cfg.model.init_from:
            from loom.checkpoint.hf import load_hf_weights

            for part in self.parts:
                load_hf_weights(part, cfg.model.init_from, whole_model=self.plan is None)
        self.params = unique_params(self.parts)
        self.dtype = DTYPES[cfg.training.dtype]
        self.loss_parallel = self.dims.tp_enabled and cfg.parallel.loss_parallel
        self.model = pm.modules[0] if self.plan is None else None
        self.pipeline = None
        if self.plan is not None:
            self.busy = BusyClock(self.device)
            self.pipeline = build_schedule(self.plan, pm.modules, self.dims["pp"].get_group(), self.device,
                                           self.accum, self._pipeline_loss, self.busy)
            self.tied = TiedEmbeddingGrads(self.parts, self.plan, self.dims)
            self.norm_params = self.tied.params_counted_once(self.parts)

    def _measure_attention(self, args) -> str:
        """``model.attention = auto`` on CUDA: forward + backward of the candidates on this rank's attention shape
        (packed documents: loom's kernel and FlexAttention on the run's first micro-batch's documents; otherwise
        SDPA and loom's kernel); every rank uses rank 0's figures, so all choose the same backend."""
        from loom.kernels.select import AttentionShape, attention_inputs, fastest, measure
        from loom.models.common.layers import attend

        cfg, tp = self.cfg, self.cfg.parallel.tp
        shape = AttentionShape(cfg.training.micro_batch_size, args.n_heads // tp, args.n_kv_heads // tp,
                               cfg.training.seq_len, args.head_dim, DTYPES[cfg.training.dtype])
        positions = self._first_positions() if cfg.data.document_positions else None
        names = ("sdpa", "flash") if positions is None else ("flash", "flex")
        candidates = {name: (lambda q, k, v, name=name: attend(q, k, v, name, positions)) for name in names}
        times = self.share_from_main(measure(candidates, attention_inputs(shape, self.device)))
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
        opt_device = torch.device("cpu") if cfg.parallel.cpu_offload and self.dims.fsdp_enabled else self.device
        self.optimizer = OptimizerParts(self.parts, cfg.optimizer, opt_device)
        self.scheduler = SchedulerParts(self.optimizer, cfg.training.steps, cfg.optimizer)
        self.scaler = LossScaler(cfg.training.dtype == "float16", cfg.training.loss_scale_init,
                                 cfg.training.loss_scale_window)

    def _build_checkpointer(self) -> None:
        from loom.checkpoint.manager import CheckpointManager

        self._check_checkpoint_space()
        self.checkpointer = CheckpointManager(self.cfg.checkpoint, self.run_dir, is_main=self.env.is_main,
                                              barrier=self.barrier, share=self.share_from_main)

    def _check_checkpoint_space(self) -> None:
        """A run that will save refuses to start when the checkpoint folder's disk cannot hold one checkpoint
        (float32 weights and the two AdamW moments), instead of failing at its first save."""
        c = self.cfg.checkpoint
        error = None
        if self.env.is_main and (c.every or c.at_end):
            folder = c.dir or os.path.join(self.run_dir, "checkpoints")
            need = 3 * 4 * count_params(self.model_args)
            free = shutil.disk_usage(folder).free
            if free < need:
                error = (f"checkpoint.dir {folder}: a checkpoint of this model needs about {need:,} bytes (float32 "
                         f"weights and AdamW moments), the disk has {free:,} free: free space or choose another "
                         "checkpoint.dir")
        error = self.share_from_main(error)
        if error is not None:
            raise SharedError(error)

    def _build_profiler(self) -> None:
        """metrics.profile_steps; no block ranges under torch.compile (the hooks would run in its graph)."""
        blocks = None if self.cfg.training.compile else transformer_blocks(self.parts)
        # PyTorch's memory history made the backward of MoE blocks under activation checkpointing fail (torch 2.11,
        # H100: "run_backward returned NULL without setting an exception"; bench/NOTES.md): no snapshot there
        no_snapshot = "skipped: PyTorch's memory history breaks the backward of MoE blocks under activation " \
            "checkpointing" if self.model_args.moe and self.cfg.training.activation_checkpointing != "none" else ""
        self.profiler = StepProfiler(profile_window(self.cfg.metrics), self.run_dir, self.env.rank, self.device,
                                     blocks, is_main=self.env.is_main, no_snapshot=no_snapshot)

    # ---- collectives over the data-parallel ranks ----------------------------
    def barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()

    def share_from_main(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.env.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that hold different tokens of the step: data parallel x context parallel."""
        if self.dims.dp_size * self.dims.cp > 1:
            dist.all_reduce(t, group=self.dims["dp_cp"].get_group())
        return t

    def _local_tokens(self, mb: MicroBatch) -> MicroBatch:
        """This rank's share of a micro-batch on the device: under context parallelism its two chunks of
        every sequence (loom.parallel.context_parallel), else all of it."""
        mb = mb.to(self.device)
        if not self.dims.cp_enabled:
            return mb
        rank, cp = self.dims.cp_rank(), self.dims.cp
        return MicroBatch(*(shard_sequence(t, rank, cp) for t in (mb.inputs, mb.labels, mb.positions,
                                                                   mb.document_ids)))

    def any_rank(self, flag: bool) -> bool:
        if self.env.world_size == 1:
            return flag
        return self._max_over_ranks(float(flag)) > 0


    # ---- one step -------------------------------------------------------------
    def _autocast(self):
        return autocast_context(self.dtype, self.device, fsdp_casts=self.dims.fsdp_applied)

    def _positions(self, mb: MicroBatch) -> torch.Tensor | None:
        """The per-document positions the model takes (data.document_positions), else None."""
        return mb.positions if self.cfg.data.document_positions else None

    def _forward_loss(self, mb: MicroBatch) -> torch.Tensor:
        """Summed token loss of one micro-batch (call under ``loss_parallel_context`` with TP)."""
        with self._autocast():
            positions = self._positions(mb)
            if self.model_args.fused_loss:  # loss inside forward, where FSDP2 has the output weight unsharded
                return to_local_loss(self.model(mb.inputs, positions, labels=mb.labels))
            logits = self.model(mb.inputs, positions)  # (B, S, V), or a vocab-sharded DTensor (B, S, V/tp)
        return to_local_loss(cross_entropy_sum(logits, mb.labels))

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss_fn: the summed token loss scaled to its share of the step's gradient."""
        return to_local_loss(cross_entropy_sum(logits, labels)) * self._grad_scale

    def _accumulate(self, mbs: list[MicroBatch], grad_scale: torch.Tensor) -> torch.Tensor:
        """Forward/backward of every micro-batch in turn; returns this rank's summed loss."""
        loss_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(mbs):
            with self._no_sync(last=i == len(mbs) - 1), loss_parallel_context(self.loss_parallel):
                with self.profiler.phase("forward"):
                    loss = self._forward_loss(mb)
                with self.profiler.phase("backward"):
                    (loss * grad_scale).backward()
            loss_sum += loss.detach()
        return loss_sum

    def _pipeline_step(self, mbs: list[MicroBatch], grad_scale: torch.Tensor) -> torch.Tensor:
        """One schedule run over the step's micro-batches (the accumulation count); returns the summed
        loss of this data-parallel rank's batch on every pp rank."""
        self._grad_scale = grad_scale
        self.busy.start()
        with self.profiler.phase("forward_backward"):
            losses = self._run_schedule(self.pipeline.step, mbs)
        self.busy.stop()
        self.tied.sync()
        loss_sum = torch.stack(losses).sum().detach() / grad_scale if losses else torch.zeros((), device=self.device)
        dist.all_reduce(loss_sum, group=self.dims["pp"].get_group())  # only the last stage holds it
        return loss_sum

    def _run_schedule(self, run, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """``run`` (the schedule's step or eval) over ``mbs`` joined into (M x B, S), which the schedule
        cuts back into M micro-batches; returns the last stage's loss_fn outputs (empty elsewhere)."""
        labels = torch.cat([mb.labels for mb in mbs])
        # per-document positions go to every stage as a keyword (the schedule cuts it like the inputs): each
        # stage's attention masks its documents and RoPE restarts per document
        kwargs = {"positions": torch.cat([mb.positions for mb in mbs])} if self.cfg.data.document_positions else {}
        losses: list[torch.Tensor] = []
        with self._autocast(), loss_parallel_context(self.loss_parallel):
            if self.plan.has_first:
                run(torch.cat([mb.inputs for mb in mbs]), target=labels, losses=losses, **kwargs)
            else:
                run(target=labels, losses=losses, **kwargs)
        return losses

    def _grad_norm(self) -> torch.Tensor:
        if self.plan is None:
            return global_grad_norm(self.params)
        sq = global_grad_norm(self.norm_params).to(self.device) ** 2  # each stage's share, tied weight once
        dist.all_reduce(sq, group=self.dims["pp"].get_group())
        return sq.sqrt()

    def _no_sync(self, last: bool):
        if self.dims.ddp_enabled and not self.dims.replicate_with_fsdp and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def train_step(self, micro_batches: list[MicroBatch]) -> dict:
        mbs = [self._local_tokens(mb) for mb in micro_batches]
        n_tokens = self.dp_sum(sum(valid_tokens(mb.labels) for mb in mbs).to(torch.float32))
        # gradient reductions average over the dp x cp ranks; multiplying by their count makes them a sum,
        # so every micro-batch on every rank contributes token_loss / global_tokens
        grad_scale = self.dims.dp_size * self.dims.cp * self.scaler.scale / n_tokens
        if self.model_args.moe:  # the balance loss is a mean over the step's sequences, reduced the same way
            for part in self.parts:
                set_aux_scale(part, self.dims.dp_size * self.dims.cp * self.scaler.scale
                              / self.cfg.training.global_batch_size)
        if self.pipeline is not None:
            loss_sum = self._pipeline_step(mbs, grad_scale)
        else:
            loss_sum = self._accumulate(mbs, grad_scale)
        if self.dims.ep_enabled:  # see loom.parallel.expert_parallel: expert gradients averaged over fewer ranks
            scale_grads(expert_params(self.parts), self.dims.expert_grad_factor)
        lr = self.optimizer.param_groups[0]["lr"]
        loss = self.dp_sum(loss_sum) / n_tokens
        with self.profiler.phase("optimizer"):  # grad norm, clipping, step (skipped where not finite), zero_grad
            norm = self._grad_norm() / self.scaler.scale
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
            # copied to the host before the update is queued: reading it waits for this point, not the update
            self._pending = StepCheck(self.step + 1, finite, loss, norm, deferred)
            if deferred:  # the device skips a non-finite update itself; the host reads the verdict a step later
                self.optimizer.step(factor, finite=finite)
                self.scheduler.step()
            else:  # float16's loss scale and the optimizers that cannot skip on the device decide on the host
                stepped = bool(finite)
                if stepped and self.scaler.enabled:
                    stepped = self.scaler.update(float(norm))
                if stepped:
                    self.optimizer.step(factor)
                    self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        out = {"loss": loss, "grad_norm": norm, "tokens": n_tokens, "lr": lr}
        if self.model_args.moe:
            balance = self._moe_balance()
            # a pipeline's first schedule run in a process also runs each stage on placeholder inputs (shape
            # inference), whose routing is noise: that step's balance is not reported
            first_pipeline_step = self.plan is not None and not self._pipeline_ran
            self._pipeline_ran = self.plan is not None
            out["moe_balance"] = None if first_pipeline_step else balance
        return out

    def _moe_balance(self) -> torch.Tensor | None:
        """This step's sequence-wise balance loss per MoE block and sequence: 1 when tokens spread evenly over the
        experts, up to n_experts / top_k when every token of a sequence picks the same experts."""
        sums = [b for part in self.parts if (b := take_balance(part)) is not None]
        if self.cfg.training.compile:  # compiled blocks do not record it (loom.models.common.moe)
            return None
        total = torch.stack(sums).sum() if sums else torch.zeros((), device=self.device)
        if self.plan is not None:  # each pp rank holds some of the blocks
            dist.all_reduce(total, group=self.dims["pp"].get_group())
        if self.dims.tp > 1:  # each tp rank holds a slice of every sequence (sequence parallelism)
            dist.all_reduce(total, group=self.dims["tp"].get_group())
        return self.dp_sum(total) / (self.cfg.training.global_batch_size * self.model_args.n_layers)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        batches = self.loader.validation(self.cfg.training.eval_batches)
        if not batches:
            return None
        for part in self.parts:
            part.eval()
        batches = [self._local_tokens(mb) for mb in batches]
        count = sum(valid_tokens(mb.labels) for mb in batches).to(torch.float32)
        if self.pipeline is not None:
            total = self._pipeline_validation(batches)
        else:
            total = torch.zeros((), device=self.device)
            for mb in batches:
                with loss_parallel_context(self.loss_parallel):
                    total += self._forward_loss(mb)
        for part in self.parts:
            part.train()
        return float(self.dp_sum(total) / self.dp_sum(count))

    def _pipeline_validation(self, batches: list[MicroBatch]) -> torch.Tensor:
        """Forward-only schedule runs over ``accum`` micro-batches at a time (the config check makes
        ``eval_batches`` a multiple), or for V-shaped schedules one micro-batch at a time through
        ``forward_chain``; the summed loss of this data-parallel rank, on every pp rank."""
        total = torch.zeros((), device=self.device)
        self._grad_scale = 1.0  # the loss_fn returns plain sums here
        timed = len(self.busy.spans)
        if self.plan.schedule in V_SHAPED:  # torch's forward-only run of these fails: stage by stage instead
            for mb in batches:
                with self._autocast(), loss_parallel_context(self.loss_parallel):
                    out = forward_chain(self.plan, self.parts, self.dims["pp"].get_group(), mb.inputs, self.device,
                                        self._positions(mb))
                    if out is not None:
                        total += self._pipeline_loss(out, mb.labels)
        else:
            for i in range(0, len(batches), self.accum):
                losses = self._run_schedule(self.pipeline.eval, batches[i:i + self.accum])
                if losses:
                    total += torch.stack(losses).sum()
        del self.busy.spans[timed:]  # the logged idle fraction is the training step's
        dist.all_reduce(total, group=self.dims["pp"].get_group())  # only the last stage holds it
        return total

    # ---- the loop ---------------------------------------------------------------
    def state_for_checkpoint(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "loader": self.loader.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "lineage": self.checkpointer.lineage, "nonfinite": self.guard.state_dict(),
                "rng": {"cpu": torch.get_rng_state().tolist(),
                        "cuda": torch.cuda.get_rng_state().tolist() if self.device.type == "cuda" else None}}

    def load_trainer_state(self, state: dict) -> None:
        """A loaded checkpoint's trainer state, adapted to this run's config where it differs from the one the
        checkpoint was written with (loom.train.resume_changes: data position, LR schedule, optimizer groups,
        loss scale)."""
        from loom.train.resume_changes import (apply_optimizer_config, checkpoint_values, loader_state,
                                               restore_loss_scale)

        old = checkpoint_values(state.get("checkpoint"))  # the checkpoint's config (None: unknown, the same)
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.loader.load_state_dict(loader_state(state["loader"], old))
        self.scheduler.load_state_dict(state["scheduler"])  # its position; the schedule is this run's
        apply_optimizer_config(self.optimizer, self.cfg.optimizer)
        self.scaler.load_state_dict(state["scaler"])
        restore_loss_scale(self.scaler, old, self.cfg.training)
        self.guard.load_state_dict(state.get("nonfinite", {}))  # steps whose batches are skipped stay skipped
        torch.set_rng_state(torch.tensor(state["rng"]["cpu"], dtype=torch.uint8))
        if state["rng"].get("cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(state["rng"]["cuda"], dtype=torch.uint8))

    def save_checkpoint(self) -> None:
        """Save this step; weights that are not finite are never written (the run stops, the last checkpoint stays)."""
        if self.any_rank(not self._weights_finite()):
            raise TrainingStopped(f"the weights are not finite at step {self.step}: no checkpoint written (the last "
                                  "complete one stays)")
        self.checkpointer.save(self.step, self.parts, self.optimizer, self.state_for_checkpoint(),
                               to_toml(self.cfg))

    def resume(self) -> None:
        from loom.metrics.logger import rewind_metrics
        from loom.train.resume_changes import check_checkpoint, on_main

        folder = self.checkpointer.choose()  # verified by rank 0, the same answer on every rank
        if folder is None:
            return
        # this run's config against the checkpoint's before any weight is read: a shape change stops here
        changes = on_main(lambda: check_checkpoint(folder, self.cfg, self.tokenizer, self.kernels),
                          self.env.is_main, self.share_from_main)
        state = self.checkpointer.load(folder, self.parts, self.optimizer)
        if state is not None:
            self.load_trainer_state(state)
            if self.env.is_main:
                print(f"resumed from step {self.step}", flush=True)
                if changes.line():
                    print(changes.line(), flush=True)
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
        state = self.checkpointer.load(folder, self.parts, self.optimizer)
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
        """Read the last step's verdict: ``ok``; or, for a non-finite step, take back the host's counts of the
        update the device skipped, say so at once, and answer what training.nonfinite does (``skip``, ``stop``,
        ``rollback``)."""
        check, self._pending = self._pending, None
        if check is None:
            return "ok"
        finite, loss, norm = check.read()
        if finite:
            self.guard.finite_step()
            return "ok"
        if check.deferred:
            self.optimizer.unstep()
            self.scheduler.unstep()
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
        if self.step == 0 and self.env.is_main:
            self._set_aside_old_metrics()
        self.preemption = Preemption(cfg.checkpoint.preempt_grace_s, rank=self.env.rank)
        peak = device_peak(self.device, cfg.training.dtype)
        logger = MetricsLogger(self.run_dir, cfg.training.steps, tensorboard=cfg.metrics.tensorboard,
                               progress=cfg.metrics.progress, start_step=self.step) if self.env.is_main else None
        if self.env.is_main:
            print(f"loom: {cfg.model.flavor} ({count_params(self.model_args) / 1e6:.1f}M params), "
                  f"{self.dims.describe()}, accumulation {self.accum}, dtype {cfg.training.dtype}, "
                  f"device {self.device.type}", flush=True)
            cp_note = " (cp > 1: attention goes through loom's flash_attention op)" if self.dims.cp_enabled else ""
            print(f"kernels: {self.kernels.describe()}{self._measured()}{cp_note}", flush=True)
            if self.plan is not None:
                self._describe_pipeline()
        records: list[dict] = []
        reset_peak(self.device)
        t_last, tokens_last = time.perf_counter(), self.tokens_seen
        finished = False
        try:
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
                logs = self._logs_at(self.step + 1)
                data = self.loader.next_step(with_hash=self.env.is_main and logs)  # the hash reads the whole batch
                self.profiler.start(self.step + 1)
                out = self.train_step(data.micro_batches)
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
                val = None
                if verdict != "stop" and cfg.training.eval_every and self.step % cfg.training.eval_every == 0:
                    val = self.evaluate()
                if logs or verdict == "stop":  # the step that stops the run is on record too
                    now = time.perf_counter()
                    rec = self._record(out, data.global_hash, val, now - t_last, self.tokens_seen - tokens_last, peak)
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
            self.checkpointer.wait()
            finished = True
        finally:
            self.stop_vote.close(wait=finished)
            self.preemption.restore()
            self.profiler.close()
            if logger:
                logger.close()
        return records

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

    def _describe_pipeline(self) -> None:
        p = self.plan
        try:
            bubble = f"{100 * theoretical_bubble(p.schedule, p.pp, self.accum, p.per_rank):.1f}%"
        except (ImportError, AttributeError, RuntimeError, ValueError) as err:  # private torch API moved
            bubble = f"unknown ({type(err).__name__}: {err})"
        print(f"pipeline: {p.schedule}, pp={p.pp}, {p.per_rank} stage(s) per rank, {self.accum} micro-batches: "
              f"theoretical bubble {bubble} (idle / total, F=1 B=2)", flush=True)
        print(f"pipeline split: {p.describe()}", flush=True)
        if self.dims.fsdp_applied and self.cfg.parallel.reshard_after_forward and not fsdp_reshard_after_forward(
                self.cfg.parallel, p):
            print(f"pipeline: {p.schedule} computes weight gradients in a pass of their own, so FSDP keeps each "
                  "block's parameters gathered from forward to the gradient reduction (parallel."
                  "reshard_after_forward = true does not apply)", flush=True)

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
            "mfu": mfu(per_dev, self.model_args, self.cfg.training.seq_len, peak),
            "mem_gib": peak_memory_gib(self.device),
            "val_loss": val,
            "skipped_steps": self.scaler.skipped,
            "nonfinite_steps": self.guard.skipped,
            "batch_hash": batch_hash,
            **({"mem_gib_max_rank": self._max_over_ranks(peak_memory_gib(self.device))}
               if self.dims.distributed else {}),
            **({"pp_idle": self._pp_idle()} if self.plan is not None else {}),
            **({"moe_balance": None if out["moe_balance"] is None else float(out["moe_balance"])}
               if "moe_balance" in out else {}),
        }

    def _max_over_ranks(self, x: float) -> float:
        t = torch.tensor([x], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def _pp_idle(self) -> list[float]:
        """Each pp rank's idle fraction in the last step (rank order), measured, for the log."""
        t = torch.tensor([self.busy.idle_fraction()], device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.dims.pp)]
        dist.all_gather(out, t, group=self.dims["pp"].get_group())
        return [round(float(x), 4) for x in out]
