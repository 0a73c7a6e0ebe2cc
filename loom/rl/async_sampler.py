"""Asynchronous GRPO's sampler (grpo.max_staleness = k > 0): the rollouts of later steps are sampled on a thread,
on a snapshot of the policy (a plain copy, loom.rl.sync), while the trainer trains the current step. At the start of
step n the thread has finished (the snapshot is free), the snapshot is refreshed to the current weights (version
n - 1: n - 1 optimizer steps) and step n + k's batch is queued; step n takes its batch, queued at step n - k from
version n - k - 1: k versions behind (the first k steps' batches are all from the first GRPO step's weights, fewer
behind). The thread only generates and takes the snapshot's log-probabilities of what it sampled, on its own model
and its own seeded generator, so the batches do not depend on when the thread runs: a run is deterministic for a
fixed seed. Everything collective (the weight refresh, scoring, advantages) stays on the trainer's thread."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from loom.rl.rollout import kept_mode, rows_to_batches, sample_checked, token_logps


@dataclass
class Sampled:
    """A queued step's batch: its prompt rows and ids, the completions, the snapshot's token log-probabilities of
    them per micro-batch (B, S) (cut as ``Rollouts.to_batches`` cuts), the policy version that sampled them and
    the thread's generation seconds."""

    rows: list[dict]
    prompts: list[list[int]]
    outs: list
    sampler_logps: list[torch.Tensor]
    version: int
    seconds: float


class AsyncSampler:
    """Step ``n``'s rollouts sampled ahead on a thread (``take(n)``), at most ``staleness`` versions behind."""

    def __init__(self, rollouts, staleness: int, last_step: int):
        from loom.infer.generator import Generator
        from loom.rl.sync import EngineWeights

        self.rollouts, self.k, self.last = rollouts, staleness, last_step
        engine = rollouts.engine
        self.device = sampler_device(engine, rollouts.g.sampler_device)
        self.weights = EngineWeights.build(engine, copy=True, device=self.device)
        with kept_mode(self.weights.model):
            self.generator = Generator.from_model(
                self.weights.model, rollouts.tokenizer, compile=False, max_batch=rollouts.rows
            )
        # on CUDA the thread's kernels go to a stream of their own, so they can run beside the trainer's (the
        # refresh ends with a device synchronize; the thread's results reach the host before it reports done)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-sampler")
        self.jobs: dict[int, Future] = {}
        self.version = 0  # the snapshot's: optimizer steps in the weights it holds
        self.wait_s = 0.0  # the trainer's last wait for its batch

    def take(self, step: int) -> Sampled:
        """Step ``step``'s batch (every rank calls it at each GRPO step, in order): the snapshot refreshed to the
        current weights and step + k queued, then this step's batch, waited for."""
        start = time.perf_counter()
        if self.jobs:
            self.jobs[max(self.jobs)].result()  # the thread is idle: the snapshot may change
        self.refresh(step - 1)
        for s in range(step, step + self.k + 1) if not self.jobs else (step + self.k,):
            if s <= self.last:
                self.jobs[s] = self.pool.submit(self.sample, s, self.version)
        sampled = self.jobs.pop(step).result()
        self.wait_s = time.perf_counter() - start - self.weights.seconds
        return sampled

    def refresh(self, version: int) -> None:
        """The snapshot := the policy's current weights (a collective under FSDP2); weights that are not finite
        stop the run first (loom.rl.rollout.check_policy_finite)."""
        from loom.rl.rollout import check_policy_finite

        check_policy_finite(self.rollouts.engine, self.rollouts.step)
        self.weights.sync()
        if self.device.type == "cuda":  # the copies into another GPU done before the thread reads them
            torch.cuda.synchronize(self.device)
        self.version = version

    def sample(self, step: int, version: int) -> Sampled:
        """On the thread: step ``step``'s prompts, their completions from the snapshot and its log-probabilities of
        them (no collective, nothing of the trainer's)."""
        cuda = self.stream is not None  # the thread's current device and stream: the snapshot's
        with (
            torch.no_grad(),
            torch.cuda.device(self.device) if cuda else contextlib.nullcontext(),
            torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext(),
        ):
            return self._sample(step, version)

    def _sample(self, step: int, version: int) -> Sampled:
        r = self.rollouts
        start = time.perf_counter()
        rows, prompts = r.prompts(step)
        outs = sample_checked(lambda p: r.generate(p, step, self.generator, self.weights), prompts, step)
        seconds = time.perf_counter() - start
        model, engine, cfg = self.weights.model, r.engine, r.cfg
        batches = rows_to_batches(
            prompts, [o.token_ids for o in outs], r.micro, r.pad_id, cfg.training.seq_len, cfg.parallel.tp
        )
        logps = []
        for mb in batches:
            with engine.autocast():
                logits = model(mb.inputs.to(self.device))
            logps.append(token_logps(logits, mb.labels.to(self.device), r.g.temperature).cpu())
        return Sampled(rows, prompts, outs, logps, version, seconds)

    def close(self) -> None:
        """Queued batches dropped, the thread ended (a run that stops early)."""
        for job in self.jobs.values():
            job.cancel()
        self.pool.shutdown(wait=True)
        self.jobs = {}


def sampler_device(engine, value: str) -> torch.device:
    """grpo.sampler_device resolved: '' = the training device; else a device of the training device's type (the
    step's autocast applies to it), a GPU that exists, in a one-process run (each rank would need one of its own)."""
    from loom.config.errors import ConfigError

    if not value:
        return engine.device
    device = torch.device(value)  # the rules checked the spelling
    if device.type != engine.device.type:
        raise ConfigError("grpo.sampler_device", value, f"a {engine.device.type} device, as the trainer's")
    if device.type == "cuda" and (device.index is None or device.index >= torch.cuda.device_count()):
        raise ConfigError("grpo.sampler_device", value, f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    if engine.env.world_size > 1:
        raise ConfigError(
            "grpo.sampler_device", value, "'' with more than one process (a run of one process)"
        )
    return device
