"""The loop: the cadence around the engine's steps (loom.train.engine). Each step: poll the checkpointer, settle
the last step's verdict (skip, stop or roll back), the step itself, then validation, the logged record, saves and
a hook's stop request (preemption); the hooks (loom.train.hooks) join at the points they declare. ``Running`` holds
those pieces, so the loop's ``fit`` and a method's driver (GRPO's, PPO's ``drive``) call the same ones."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence

import torch

from loom.checkpoint.manager import step_dir_name
from loom.config.sections import Config
from loom.data.loader import MicroBatch
from loom.eval.hook import training_evals
from loom.metrics.flops import device_peak, mfu, mfu_note
from loom.metrics.logger import MetricsLogger, rewind_metrics
from loom.metrics.memory import peak_allocated_gib, peak_memory_gib, reset_peak
from loom.metrics.nvtx import nvtx_range
from loom.parallel.compile import graph_free, graph_free_blocks
from loom.runtime.env import DistEnv
from loom.runtime.guard import NonFiniteGuard, StepCheck, TrainingStopped
from loom.runtime.restarts import begin as begin_attempt
from loom.runtime.restarts import metrics_fields, restart_checkpoint
from loom.train.engine import Engine, count_params
from loom.train.objective import Objective
from loom.train.resume_changes import (
    apply_optimizer_config,
    check_checkpoint,
    checkpoint_values,
    loader_state,
    on_main,
    restore_loss_scale,
)


class Loop:
    """Training to ``training.steps`` around an ``Engine`` built for ``objective`` (``rules``: its method's, for the
    resolver). ``fit()`` is the whole job."""

    def __init__(
        self,
        cfg: Config,
        objective: Objective,
        env: DistEnv | None = None,
        rules: Sequence[Callable[[Config], None]] = (),
    ):
        self.cfg = cfg
        self.step, self.tokens_seen = 0, 0
        self.engine = Engine(cfg, objective, self, env, rules)
        e = self.engine
        self.evals = training_evals(cfg, e.run_dir, e.env.is_main, e.parts[0])  # eval_hook / eval_tasks
        self.guard = NonFiniteGuard(cfg.training.nonfinite, cfg.training.nonfinite_limit)
        self._pending: StepCheck | None = None  # the last step's verdict, until the host has read it
        self._settled: StepCheck | None = None  # the last verdict read
        # the logged records' peak memory over the ranks, on the host: the health monitor's gloo group (None where
        # the default group is gloo or there is one rank), as the stragglers' figures
        self._host_group = e.health.group
        self.val_stats: dict[str, float] = {}  # the objective's statistics of the last validation pass

    def __getattr__(self, name: str):
        """The engine's public attributes, read through the loop (``trainer.parts``, ``trainer.optimizer``)."""
        if name.startswith("_") or name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def train_step(self, micro_batches: list[MicroBatch]) -> dict:
        """The next step on ``micro_batches`` (the engine's); its verdict waits in ``_pending`` for ``_settle``."""
        out = self.engine.step(micro_batches, self.step + 1)
        if out.check is not None:
            self._pending = out.check
        return out.fields()

    def _evaluates_at(self, step: int) -> bool:
        """Whether ``step`` has a validation pass: every training.eval_every steps, and the last step
        (training.eval_at_end) where there is held-out data."""
        t = self.cfg.training
        if t.eval_every and step % t.eval_every == 0:
            return True
        return t.eval_at_end and step == t.steps and self.cfg.data.val_fraction > 0

    @torch.no_grad()
    def evaluate(self, quiet: bool = False) -> float | None:
        """The validation loss on the held-out windows (None without any); ``quiet``: no warning when they hold no
        target (the pass at the end that training.eval_at_end adds by default)."""
        # eval_batches global batches: accum micro-batches on each rank per batch, as a training step
        batches = self.loader.validation(self.cfg.training.eval_batches * self.accum)
        if not batches:
            return None
        total, count, self.val_stats = self.engine.evaluate(batches)
        # held-out windows without a target (SFT: no assistant token): no loss to report
        if float(count) == 0:
            if self.env.is_main and not quiet:
                print(
                    f"step {self.step}: warning: the validation batches hold nothing to evaluate (targets 0): no "
                    "val_loss (raise training.eval_batches or training.seq_len)",
                    flush=True,
                )
            return None
        return float(self.engine.data_sum(total) / count)

    def run_evals(self) -> dict[str, float]:
        """training.eval_hook and eval_tasks on the live model (loom.eval.hook): {"eval/<name>": value}."""
        if self.evals is None:
            return {}
        for part in self.parts:
            part.eval()
        try:
            # the model itself (one part: no pipeline), not a DDP wrapper: evaluation takes no gradients; its
            # forwards at shapes of their own run the blocks' compile without CUDA graphs (training.cuda_graphs)
            with graph_free(graph_free_blocks(self.parts[0])):
                return self.evals(self.parts[0], self.tokenizer, self.step, self.device, self.engine.autocast)
        finally:
            for part in self.parts:
                part.train()

    # ---- the loop ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """The trainer state a checkpoint saves beside the weights (and a recovering torchft peer receives)."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "loader": self.loader.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "lineage": self.checkpointer.lineage,
            "nonfinite": self.guard.state_dict(),
            "data_fingerprints": self.data_fingerprints,
            **{k: v for hook in self.engine.hooks for k, v in hook.state_dict(self.step).items()},
            "rng": {
                "cpu": torch.get_rng_state().tolist(),
                "cuda": torch.cuda.get_rng_state().tolist() if self.device.type == "cuda" else None,
            },
        }

    def load_state_dict(self, state: dict) -> None:
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
        for (
            hook
        ) in self.engine.hooks:  # e.g. DiLoCo's pending outer reductions (parallel.diloco_overlap_steps)
            hook.resumed(self.step)
        torch.set_rng_state(torch.tensor(state["rng"]["cpu"], dtype=torch.uint8))
        if state["rng"].get("cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.tensor(state["rng"]["cuda"], dtype=torch.uint8))

    def save_checkpoint(self) -> None:
        """Save this step; weights that are not finite are never written (the run stops, the last checkpoint stays)."""
        if self.env.any_rank(not self.engine.weights_finite()):
            raise TrainingStopped(
                f"the weights are not finite at step {self.step}: no checkpoint written (the last "
                "complete one stays)"
            )
        with nvtx_range("checkpoint_save"):
            self.checkpointer.save(
                self.step,
                self.parts,
                self.optimizer,
                self.state_dict(),
                self.recorded_toml,
                replica=self.engine.replica,
                extra=self.engine.extra_state(),
            )

    def resume(self) -> None:
        # a restarted attempt continues the launch's own lineage; otherwise checkpoint.resume decides
        folder = restart_checkpoint(self.attempt, self.checkpointer) or self.checkpointer.choose()
        if folder is None:
            return
        # this run's config against the checkpoint's before any weight is read: a shape change stops here
        changes = on_main(
            lambda: check_checkpoint(folder, self.cfg, self.tokenizer, self.kernels, self.model_args),
            self.env.is_main,
            self.env.share_from_main,
        )
        for hook in self.engine.hooks:  # before any weight is read (DiLoCo refuses another number of groups)
            hook.check_resume(folder)
        state = self.checkpointer.load(
            folder, self.parts, self.optimizer, replica=self.engine.replica, extra=self.engine.extra_state()
        )
        for hook in self.engine.hooks:
            hook.loaded(with_state=state is not None)
        if state is not None:
            self.load_state_dict(state)
            if self.env.is_main:
                print(f"resumed from step {self.step}", flush=True)
                if changes.line():
                    print(changes.line(), flush=True)
                if state.get("data_fingerprints", self.data_fingerprints) != self.data_fingerprints:
                    print(
                        f"data.source = {self.cfg.data.source or '<stdlib>'!r}: its files changed since the "
                        "checkpoint (sizes or modification times); the data position continues in the new "
                        "content, so the batches differ from an uninterrupted run",
                        flush=True,
                    )
                # records a run wrote past this checkpoint: the resumed run writes those steps again
                dropped = rewind_metrics(os.path.join(self.run_dir, "metrics.jsonl"), self.step)
                if dropped:
                    print(f"metrics.jsonl: dropped {dropped} record(s) after step {self.step}", flush=True)

    def _rollback(self, logger, records: list[dict]) -> None:
        """training.nonfinite = rollback: the newest complete checkpoint of this run back in place; the guard
        keeps its record of offending steps, whose batches the replay skips; records past it are dropped."""
        self.checkpointer.wait()
        folder = self.checkpointer.latest()
        if folder is None:
            raise TrainingStopped(
                f"non-finite step {self.step} and no complete checkpoint of this run to roll back "
                "to (training.nonfinite = rollback; save with checkpoint.every)"
            )
        guard = self.guard.state_dict()
        state = self.checkpointer.load(
            folder, self.parts, self.optimizer, replica=self.engine.replica, extra=self.engine.extra_state()
        )
        # as after a resume's load: float8 scales and casts recomputed, 2BW's older weights back
        for hook in self.engine.hooks:
            hook.loaded(with_state=True)
        self.load_state_dict(state)
        self.guard.load_state_dict(guard)
        self.guard.rolled_back_to(self.step)
        records[:] = [r for r in records if r["step"] <= self.step]
        if logger:
            logger.rewind(self.step)
        if self.env.is_main:
            print(
                f"rolled back to step {self.step} ({folder}); the batches of step(s) "
                f"{', '.join(map(str, sorted(self.guard.skip_steps)))} will be skipped",
                flush=True,
            )

    def _skip_offending_batch(self, consume: Callable[[], object]) -> None:
        """A step whose batch made a rollback happen: its data is consumed (``consume``), no update is made."""
        consume()
        self.step += 1
        self.tokens_seen += self.cfg.training.global_batch_size * self.cfg.training.seq_len
        if self.env.is_main:
            print(
                f"step {self.step}: batch skipped (it made the loss non-finite before a rollback)", flush=True
            )

    def _settle(self) -> str:
        """Read the last step's verdict: ``ok``; or, for a step without an update, take back the host's counts of
        the update the device skipped and say so at once. A step that counted nothing (targets 0) is ``ok``; for a
        non-finite one, answer what training.nonfinite does (``skip``, ``stop``, ``rollback``)."""
        check, self._pending = self._pending, None
        if check is None:
            return "ok"
        self._settled = check  # a logged record reads the step's figures from it (``_figures``)
        applied, loss, norm = check.read()
        if applied:
            self.guard.finite_step()
            return "ok"
        if check.deferred:
            self.optimizer.unstep()
            self.scheduler.unstep()
        if math.isfinite(loss) and math.isfinite(
            norm
        ):  # not applied, yet finite: the global batch counted nothing
            if self.env.is_main:
                print(
                    f"step {check.step}: warning: nothing to train on in the global batch (targets 0: every label "
                    "masked): loss 0, no update (the optimizer and the LR schedule do not advance; the data does)",
                    flush=True,
                )
            return "ok"
        action = self.guard.bad_step(check.step, loss, norm)
        if self.env.is_main:
            print(
                f"step {check.step}: non-finite loss {loss} / grad norm {norm}: update skipped "
                f"({self.guard.streak} in a row, {self.guard.skipped} in all; training.nonfinite = "
                f"{self.guard.mode})",
                flush=True,
            )
        return action

    def fit(self) -> list[dict]:
        """Train to ``training.steps`` on the loader's batches; returns the logged records (rank 0; others get [])."""
        with self.running(self.loader.next_step) as run:
            while run.next():
                # a step not committed reruns its batch
                position = self.loader.state_dict() if run.may_abort else None
                with run.data_wait():
                    data = self.loader.next_step(
                        with_hash=self.env.is_main and run.logs
                    )  # the hash reads the whole batch
                out = run.step(data.micro_batches)
                if not out.get("committed", True):
                    self.loader.load_state_dict(position)
                    if self.env.is_main:
                        print(
                            f"step {self.step + 1}: not committed (a replica group failed during it): it runs "
                            "again",
                            flush=True,
                        )
                    continue
                if run.after(out, data.global_hash):
                    break
        return run.records

    @contextlib.contextmanager
    def running(self, consume: Callable[[], object]):
        """The cadence around the steps of ``fit`` or of a method's driver (loom.methods.grpo.drive): resume, the
        banner and the logger, then the ``Running`` whose ``next`` / ``step`` / ``after`` the caller's loop calls;
        at the end the last save and the hooks' ``finish``, after an error the hang report, always the closes.
        ``consume``: takes one step's data unused (a step whose batch made a rollback happen is skipped)."""
        run = Running(self, consume)
        try:
            self.health.start_barrier()  # every rank built and resumed: names the ranks that never arrive
            self.health.start_training()  # from here each collective waits at most parallel.timeout_s
            yield run
            run.finish()
        except RuntimeError as err:  # a collective that timed out: the hang report (loom.runtime.health)
            if not self.health.is_hang(err):
                raise
            raise self.health.hang(err) from None
        finally:
            self.health.close()
            for hook in self.engine.hooks:
                hook.close()
            self.engine.optimizer.close()  # optimizer.offload nvme: its files go
            self.profiler.close()
            if run.logger:
                run.logger.close()
        if self.env.is_main:
            print(self._where_things_are(), flush=True)

    def _banner(self) -> list[str]:
        """What this run is: its folder, the model actually built, the layout, the data, the kernels."""
        cfg, args = self.cfg, self.model_args
        name = f"{cfg.model.init_from} (imported)" if cfg.model.init_from else f"flavor {cfg.model.flavor}"
        moe = f", {args.moe_experts} experts (top {args.moe_top_k})" if args.moe_experts else ""
        note = mfu_note(self.device, cfg.training.dtype)
        cp_note = (
            f" (cp > 1: attention goes through loom's flash_attention op, K/V by {cfg.parallel.cp_method})"
            if self.dims.cp_enabled
            else ""
        )
        t = cfg.training
        total, trainable = count_params(args, cfg.lora, self.objective.replace_head)
        lora = cfg.lora
        adapters = (
            [
                f"LoRA rank {lora.rank} on {lora.targets} ({self.n_adapted} linears, base {lora.base_dtype}): "
                f"{trainable / 1e6:.2f}M trainable parameters, {100 * trainable / total:.2f}%"
            ]
            if lora.rank
            else []
        )
        if lora.rank and not cfg.model.init_from:  # the base stays frozen at its seeded random weights
            adapters.append(
                "warning: LoRA adapters on an untrained base (no model.init_from): the base stays frozen "
                "at its random initialization, so the adapters alone learn; set model.init_from to a "
                "trained model (a Hugging Face folder or a `loom convert --to-hf` export)"
            )
        return [
            f"loom: run dir {os.path.abspath(self.run_dir)}",
            f"model: {name}, {total / 1e6:.1f}M params ({args.n_layers} layers, dim {args.dim}, "
            f"{args.n_heads} heads, vocab {args.vocab_size}{moe})",
            *adapters,
            f"layout: {self.dims.describe()}, accumulation {self.accum}, dtype {t.dtype}, device {self.device.type}"
            f"{'; ' + note if note else ''}",
            *(
                [
                    "offload: FSDP2 keeps the weights, gradients and AdamW state in host memory; the device holds the "
                    "blocks being computed (parallel.cpu_offload)"
                ]
                if cfg.parallel.cpu_offload
                else []
            ),
            *(
                [
                    f"offload: the saved activations of blocks {t.activation_offload} wait in host memory (training.activation_offload)"
                ]
                if t.activation_offload.strip().lower() not in ("none", "")
                else []
            ),
            *(
                [
                    f"offload: the AdamW moments live in files under {self.optimizer.folder.path} (optimizer.offload)"
                ]
                if self.optimizer.folder is not None
                else []
            ),
            f"batch: {t.global_batch_size} x {t.seq_len} = {t.global_batch_size * t.seq_len:,} tokens per step, "
            f"{t.steps} steps",
            *self.loader.describe(t.global_batch_size, t.steps),
            f"kernels: {self.kernels.describe()}{self.engine.measured()}{cp_note}",
            *self.engine.describe_steps(),
            *(line for hook in self.engine.hooks for line in hook.describe()),
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

    def _logs_at(self, step: int) -> bool:
        """Whether ``step`` is logged (metrics.every, the last step, or a validation step)."""
        t = self.cfg.training
        return (
            step % self.cfg.metrics.every == 0
            or step == t.steps
            or bool(t.eval_every and step % t.eval_every == 0)
        )

    def _memory(self) -> dict:
        """Peak memory: this rank's and, distributed, the largest rank's (one collective); on CUDA the
        allocated peak beside the reserved one."""
        mine = {"mem_gib": peak_memory_gib(self.device)}
        alloc = peak_allocated_gib(self.device)
        if alloc is not None:
            mine["mem_alloc_gib"] = alloc
        if not self.dims.distributed:
            return mine
        maxes = self.env.max_over_ranks(list(mine.values()), group=self._host_group)
        return {**mine, **{f"{k}_max_rank": v for k, v in zip(mine, maxes)}}

    def _figures(self, out: dict) -> dict[str, float]:
        """The step's loss, gradient norm, count and statistics: from its verdict's host copy where the host has
        read it (no wait for the update queued after them: the GPU keeps working while the host logs and queues
        the next step), else from the device."""
        check = self._settled
        if check is not None and check.step == self.step:
            return check.figures()
        return {
            "loss": float(out["loss"]),
            "grad_norm": float(out["grad_norm"]),
            "tokens": float(out["tokens"]),
            **{k: float(v) for k, v in out.get("stats", {}).items()},
        }

    def _record(self, out: dict, batch_hash, val, seconds: float, tokens: int, peak) -> dict:
        tps = tokens / max(seconds, 1e-9)
        per_dev = tps / self.env.world_size
        figures = self._figures(out)
        return {
            "step": self.step,
            "loss": figures.pop("loss"),
            "grad_norm": figures.pop("grad_norm"),
            "lr": out["lr"],
            "tokens": self.tokens_seen,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": per_dev,
            "mfu": mfu(per_dev, self.model_args, self.cfg.training.seq_len, peak, self.adapter_params),
            "val_loss": val,
            "targets": figures.pop(
                "tokens"
            ),  # the global count the loss is averaged over (tokens; DPO: pairs)
            **figures,
            **({f"val_{k}": v for k, v in self.val_stats.items()} if val is not None else {}),
            "skipped_steps": self.scaler.skipped,
            "nonfinite_steps": self.guard.skipped,
            "batch_hash": batch_hash,
            **{k: v for hook in self.engine.hooks for k, v in hook.record().items()},
            **self._memory(),
            **self.steps.record(),
            **metrics_fields(self.attempt),  # restarts: this attempt's index after an elastic restart
            **self.objective.record(),  # e.g. GRPO's rewards and time split
            **(
                {"moe_balance": None if out["moe_balance"] is None else float(out["moe_balance"])}
                if "moe_balance" in out
                else {}
            ),
            **{k: float(v) for k, v in out.get("moe_bias", {}).items()},
        }


class Running:
    """One ``fit`` of a loop, between its start (resume, restarts.jsonl, the hooks' ``begin``, the banner, the
    logger) and its end: the pieces of the cadence that the loop's ``fit`` and a method's driver both call. Each
    step: ``next`` (poll, settle the last step's verdict, roll back or skip, the hooks' quorum: whether a step
    follows), the caller's data inside ``data_wait``, ``step`` (the engine's), ``after`` (count it, then the stop
    vote, validation, the logged record, saves; true: the run stops here for a hook's request)."""

    def __init__(self, loop: Loop, consume: Callable[[], object]):
        self.loop, self.consume = loop, consume
        cfg = loop.cfg
        loop.resume()
        begin_attempt(
            loop.attempt,
            loop.run_dir,
            step=loop.step,
            world_size=loop.env.world_size,
            lineage=loop.checkpointer.lineage,
            is_main=loop.env.is_main,
        )  # restarts.jsonl, one line
        self.hooks = loop.engine.hooks
        self.may_abort = any(hook.may_abort for hook in self.hooks)  # a step may end uncommitted: it reruns
        for (
            hook
        ) in self.hooks:  # e.g. torchft: the lighthouse compares the groups' steps, a group behind recovers
            hook.begin(loop.step)
        if loop.step == 0 and loop.env.is_main:
            loop._set_aside_old_metrics()
        self.peak = device_peak(loop.device, cfg.training.dtype)
        if loop.env.is_main:
            for line in loop._banner():
                print(line, flush=True)
        self.logger = (
            MetricsLogger(
                loop.run_dir,
                cfg.training.steps,
                tensorboard=cfg.metrics.tensorboard,
                progress=cfg.metrics.progress,
                start_step=loop.step,
                config=cfg,
                console=loop.objective.console,
            )
            if loop.env.is_main
            else None
        )
        self.records: list[dict] = []
        reset_peak(loop.device)
        self.t_last, self.tokens_last = time.perf_counter(), loop.tokens_seen
        self.logs = False  # whether the next step is logged (set by ``next``)
        self.stopped = False  # a hook asked the run to stop: saved, no save at the end

    def _rolled_back(self) -> None:
        self.loop._rollback(self.logger, self.records)
        self.t_last, self.tokens_last = time.perf_counter(), self.loop.tokens_seen

    def next(self) -> bool:
        """Whether a step follows: poll the checkpointer, settle the last step's verdict (stop, roll back, skip
        an offending batch), the hooks' quorum; sets ``logs`` for the step."""
        loop, steps = self.loop, self.loop.cfg.training.steps
        while loop.step < steps:
            loop.checkpointer.poll()
            verdict = loop._settle()  # the last step's, if still unread
            if verdict == "stop":
                raise TrainingStopped(loop.guard.why)
            if verdict == "rollback":
                self._rolled_back()
                continue
            if loop.step + 1 in loop.guard.skip_steps:
                loop._skip_offending_batch(self.consume)
                continue
            for hook in (
                self.hooks
            ):  # e.g. the replica groups' quorum: a group behind the others takes a peer's state
                hook.quorum()
            if loop.step >= steps:
                continue
            self.logs = loop._logs_at(loop.step + 1)
            return True
        return False

    @contextlib.contextmanager
    def data_wait(self):
        """Around the wait for a step's data: every hook's ``data_wait`` (e.g. stragglers time it)."""
        with contextlib.ExitStack() as stack, nvtx_range("data_wait"):
            for hook in self.hooks:
                stack.enter_context(hook.data_wait())
            yield

    def step(self, micro_batches: list[MicroBatch]) -> dict:
        """The next step on this rank's ``micro_batches`` (the engine's, through the loop's ``train_step``)."""
        loop = self.loop
        loop.profiler.start(loop.step + 1)
        with nvtx_range(f"step {loop.step + 1}"):
            return loop.train_step(micro_batches)

    def after(self, out: dict, batch_hash) -> bool:
        """A committed step: count it, then the hooks' stop vote, its verdict where read, validation, the logged
        record, saves; true where a hook's stop request saved it and the run ends here."""
        loop, cfg = self.loop, self.loop.cfg
        loop.step += 1
        loop.profiler.step_done(loop.step)
        loop.tokens_seen += cfg.training.global_batch_size * cfg.training.seq_len
        stop = any([hook.stops() for hook in self.hooks])  # every hook votes (a collective each)
        saves = bool(cfg.checkpoint.every and loop.step % cfg.checkpoint.every == 0) or stop
        # records and checkpoints see this step's verdict (these steps sync the host anyway)
        verdict = loop._settle() if self.logs or saves or loop.step == cfg.training.steps else "unread"
        if verdict == "rollback":
            self._rolled_back()
            return False
        if self.logger:
            self.logger.progress.update(loop.step)
        val, evals = None, {}
        if verdict != "stop" and loop._evaluates_at(loop.step):
            with nvtx_range("validation"):
                val = loop.evaluate(
                    quiet=not (cfg.training.eval_every and loop.step % cfg.training.eval_every == 0)
                )
                evals = loop.run_evals()
        if self.logs or verdict == "stop":  # the step that stops the run is on record too
            now = time.perf_counter()
            rec = loop._record(
                out, batch_hash, val, now - self.t_last, loop.tokens_seen - self.tokens_last, self.peak
            )
            rec.update(evals)
            for hook in self.hooks:  # every rank (e.g. stragglers: one all_gather)
                rec.update(hook.interval(loop.step, now - self.t_last))
            self.t_last, self.tokens_last = now, loop.tokens_seen
            if self.logger:
                self.logger.log(rec)
                self.records.append(rec)
        if verdict == "stop":
            raise TrainingStopped(loop.guard.why)
        if saves:
            loop.save_checkpoint()
        if stop:
            loop.checkpointer.wait()
            for hook in self.hooks:
                hook.stopped(loop.step)
            self.stopped = True
        return stop

    def finish(self) -> None:
        """The steps ended (all of them, or a stop request's): the last save (checkpoint.at_end) unless a stop
        saved already, work the hooks have in flight, the checkpointer's writes."""
        cfg, loop = self.loop.cfg, self.loop
        if (
            not self.stopped
            and cfg.checkpoint.at_end
            and not (cfg.checkpoint.every and loop.step % cfg.checkpoint.every == 0)
        ):
            loop.save_checkpoint()
        for (
            hook
        ) in self.hooks:  # e.g. DiLoCo's outer reductions in flight finish before the process group can go
            hook.finish()
        loop.checkpointer.wait()
