"""Asynchronous GRPO's sampler (grpo.max_staleness = k > 0): the rollouts of later steps are sampled on a thread,
or with grpo.sampler_process in a process of its own, on a snapshot of the policy (a plain copy, loom.rl.sync),
while the trainer trains the current step. At the start of step n the sampler has finished (the snapshot is free),
the snapshot is refreshed to the current weights (version n - 1: n - 1 optimizer steps) and step n + k's batch is
queued; step n takes its batch, queued at step n - k from version n - k - 1: k versions behind (the first k steps'
batches are all from the first GRPO step's weights, fewer behind). The sampler only generates and takes the
snapshot's log-probabilities of what it sampled (``sample_on``), on its own model and its own seeded generator, so
the batches do not depend on when it runs: a run is deterministic for a fixed seed, and the thread and the process
hand out the same batches. Everything collective (the weight refresh, scoring, advantages) stays on the trainer.

Both are kept: the thread (``AsyncSampler``) runs under every layout, each rank sampling its own rows; the process
(``ProcessSampler``, one-process runs) frees the trainer's Python thread from generation, which a small model's
host-bound steps need (on a thread the two fight over the GIL)."""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from loom.rl.rollout import kept_mode, rows_to_batches, sample_checked, token_logps


@dataclass
class Sampled:
    """A queued step's batch: its prompt rows and ids, the completions, the snapshot's token log-probabilities of
    them per micro-batch (B, S) (cut as ``Rollouts.to_batches`` cuts), the policy version that sampled them and
    the sampler's generation seconds."""

    rows: list[dict]
    prompts: list[list[int]]
    outs: list
    sampler_logps: list[torch.Tensor]
    version: int
    seconds: float


@dataclass(frozen=True)
class SampleSpec:
    """What sampling a step takes besides the model and its generator (it crosses to the sampler's process): the
    micro-batch cut, padding and length of the rows, the temperature of the log-probabilities, whether the
    generator keeps its caches, the step's autocast dtype (None: fp32), the snapshot's device and whether the
    sampler's process compiles its generator's blocks (training.compile: the synchronous engine runs the trainer's
    blocks, compiled as that says)."""

    micro: int
    pad_id: int
    seq_len: int
    tp: int
    temperature: float
    keep_cache: bool
    autocast: torch.dtype | None
    device: torch.device
    compile: bool


def sample_spec(rollouts, device: torch.device) -> SampleSpec:
    r = rollouts
    ctx = r.engine.autocast()
    return SampleSpec(
        r.micro,
        r.pad_id,
        r.cfg.training.seq_len,
        r.cfg.parallel.tp,
        r.g.temperature,
        r.g.keep_cache,
        ctx.fast_dtype if isinstance(ctx, torch.autocast) else None,
        device,
        r.cfg.training.compile,
    )


def _autocast(spec: SampleSpec):
    if spec.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=spec.device.type, dtype=spec.autocast)


def generate_on(spec: SampleSpec, model, generator, params):
    """The sampler process's ``Rollouts.generate`` (which the thread calls, and subclasses may replace): one
    completion per prompt from ``generator`` on the snapshot ``model``, seeded by ``params``, under the step's
    autocast; the caches parked or released after (the log-probabilities run the plain model)."""

    def generate(prompts):
        model.eval()
        try:
            with torch.no_grad(), _autocast(spec):
                return generator.generate_ids(prompts, params)
        finally:
            generator.engine.park() if spec.keep_cache else generator.engine.release()

    return generate


@torch.no_grad()
def sample_on(spec: SampleSpec, model, generate, step: int, version: int, rows, prompts) -> Sampled:
    """Step ``step``'s completions of ``prompts`` (``generate(prompts)``) and the snapshot ``model``'s
    log-probabilities of them (no collective, nothing of the trainer's: it runs on the sampler's thread or in its
    process)."""
    start = time.perf_counter()
    outs = sample_checked(generate, prompts, step)
    seconds = time.perf_counter() - start
    batches = rows_to_batches(
        prompts, [o.token_ids for o in outs], spec.micro, spec.pad_id, spec.seq_len, spec.tp
    )
    logps = []
    for mb in batches:
        with _autocast(spec):
            logits = model(mb.inputs.to(spec.device))
        logps.append(token_logps(logits, mb.labels.to(spec.device), spec.temperature).cpu())
    return Sampled(rows, prompts, outs, logps, version, seconds)


class AsyncSampler:
    """Step ``n``'s rollouts sampled ahead on a thread (``take(n)``), at most ``staleness`` versions behind."""

    def __init__(self, rollouts, staleness: int, last_step: int):
        from loom.rl.sync import EngineWeights

        self.rollouts, self.k, self.last = rollouts, staleness, last_step
        engine = rollouts.engine
        self.device = sampler_device(engine, rollouts.g.sampler_device)
        self.weights = EngineWeights.build(engine, copy=True, device=self.device)
        self.spec = sample_spec(rollouts, self.device)
        self.pending: set[int] = set()  # the steps requested and not yet taken
        self.version = 0  # the snapshot's: optimizer steps in the weights it holds
        self.wait_s = 0.0  # the trainer's last wait for its batch
        self.start()

    def start(self) -> None:
        from loom.infer.generator import Generator

        with kept_mode(self.weights.model):
            self.generator = Generator.from_model(
                self.weights.model, self.rollouts.tokenizer, compile=False, max_batch=self.rollouts.rows
            )
        # on CUDA the thread's kernels go to a stream of their own, so they can run beside the trainer's (the
        # refresh ends with a device synchronize; the thread's results reach the host before it reports done)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-sampler")
        self.jobs: dict[int, Future] = {}

    def take(self, step: int) -> Sampled:
        """Step ``step``'s batch (every rank calls it at each GRPO step, in order): the snapshot refreshed to the
        current weights and step + k queued, then this step's batch, waited for."""
        start = time.perf_counter()
        first = not self.pending
        self.wait_idle()  # the sampler is idle: the snapshot may change
        self.refresh(step - 1)
        for s in range(step, step + self.k + 1) if first else (step + self.k,):
            if s <= self.last:
                self.pending.add(s)
                self.submit(s, self.version)
        self.pending.discard(step)
        sampled = self.result(step)
        self.wait_s = time.perf_counter() - start - self.weights.seconds
        return sampled

    def refresh(self, version: int) -> None:
        """The snapshot := the policy's current weights (a collective under FSDP2); weights that are not finite
        stop the run first (loom.rl.rollout.check_policy_finite)."""
        from loom.rl.rollout import check_policy_finite

        check_policy_finite(self.rollouts.engine, self.rollouts.step)
        self.weights.sync()
        if self.device.type == "cuda":  # the copies into another GPU done before the sampler reads them
            torch.cuda.synchronize(self.device)
        self.version = version

    def prompts(self, step: int) -> tuple:
        """Step ``step``'s prompt rows, their ids and its seeded sampling (what a request to the process holds)."""
        rows, prompts = self.rollouts.prompts(step)
        return rows, prompts, self.rollouts.sampling_params(step)

    # ---- the thread ------------------------------------------------------------------------------------------
    def wait_idle(self) -> None:
        if self.jobs:
            self.jobs[max(self.jobs)].result()

    def submit(self, step: int, version: int) -> None:
        self.jobs[step] = self.pool.submit(self.sample, step, version)

    def result(self, step: int) -> Sampled:
        return self.jobs.pop(step).result()

    def sample(self, step: int, version: int) -> Sampled:
        """On the thread: step ``step``'s prompts, their completions from the snapshot and its log-probabilities of
        them."""
        cuda = self.stream is not None  # the thread's current device and stream: the snapshot's
        with (
            torch.no_grad(),
            torch.cuda.device(self.device) if cuda else contextlib.nullcontext(),
            torch.cuda.stream(self.stream) if cuda else contextlib.nullcontext(),
        ):
            r = self.rollouts
            rows, prompts = r.prompts(step)
            generate = lambda p: r.generate(p, step, self.generator, self.weights)
            return sample_on(self.spec, self.weights.model, generate, step, version, rows, prompts)

    def close(self) -> None:
        """Queued batches dropped, the thread ended (a run that stops early)."""
        for job in self.jobs.values():
            job.cancel()
        self.pool.shutdown(wait=True)
        self.jobs = {}


class SamplerError(RuntimeError):
    """The sampler's process failed (its traceback in the message) or died."""


class ProcessSampler(AsyncSampler):
    """The sampler in a child process (grpo.sampler_process; torch.multiprocessing, spawn), in one-process runs.
    The snapshot is allocated once here on the sampler's device and handed to the child once (CPU tensors in shared
    memory, CUDA tensors through CUDA IPC handles): each refresh writes it in place (a device-to-device copy and a
    synchronize) while the child is idle, and each request names the version it then holds. The child has its own
    Generator (its blocks compiled with training.compile; CUDA graphs on a GPU, as the engine chooses); requests (step, version, prompts,
    sampling) go over one queue, results (or the child's error with its traceback) come back over another, the
    wait checking that the child lives. The child samples with ``generate_on``, the engine's sampling as
    ``Rollouts.generate`` does it (a subclass's own ``generate`` applies on the thread only)."""

    POLL_S = 1.0  # the wait's liveness check

    def start(self) -> None:
        import torch.multiprocessing as mp

        model = self.weights.model
        if self.device.type == "cpu":
            model.share_memory()  # in place: the refreshes write what the child reads
        ctx = mp.get_context("spawn")
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.done: dict[int, Sampled] = {}
        self.proc = ctx.Process(
            target=serve,
            args=(
                model,
                self.rollouts.tokenizer,
                self.spec,
                self.rollouts.rows,
                torch.get_num_threads(),
                os.getpid(),
                self.requests,
                self.results,
            ),
            name="loom-sampler",
            daemon=True,
        )
        self.proc.start()
        self._finalizer = weakref.finalize(self, stop, self.proc, self.requests, self.results)

    def wait_idle(self) -> None:
        while self.pending - self.done.keys():
            self.receive()

    def submit(self, step: int, version: int) -> None:
        self.requests.put((step, version, *self.prompts(step)))

    def result(self, step: int) -> Sampled:
        while step not in self.done:
            self.receive()
        return self.done.pop(step)

    def receive(self) -> None:
        """The child's next answer: a batch, kept by its step, or its error raised here."""
        while True:
            try:
                kind, *payload = self.results.get(timeout=self.POLL_S)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise SamplerError(
                        f"the GRPO sampler's process (pid {self.proc.pid}) died with exit code "
                        f"{self.proc.exitcode} while the trainer waited for its rollouts"
                    ) from None
        if kind == "ok":
            sampled = payload[0].sampled
            sampled.sampler_logps = [torch.from_numpy(a) for a in sampled.sampler_logps]
            self.done[payload[0].step] = sampled
            return
        self.close()
        error, trace = rebuilt(*payload[:2]), payload[2]
        if error is None:
            raise SamplerError(f"the GRPO sampler's process failed:\n{trace}")
        raise error from SamplerError(f"in the GRPO sampler's process:\n{trace}")

    def close(self) -> None:
        """The child stopped (normal end, error, a run that stops early); queued batches dropped."""
        self._finalizer()
        self.done, self.pending = {}, set()


@dataclass
class _Answer:
    step: int
    sampled: Sampled


def serve(
    model, tokenizer, spec: SampleSpec, max_batch: int, threads: int, parent: int, requests, results
) -> None:
    """The sampler's process: a generator on the shared snapshot, then (step, version, rows, prompts, params)
    answered in order until None, or until the trainer's process is gone."""
    try:
        from loom.infer.generator import Generator

        torch.set_num_threads(threads)  # the thread's arithmetic: the same batches as the thread's
        if spec.device.type == "cuda":
            torch.cuda.set_device(spec.device)
        with kept_mode(model):
            generator = Generator.from_model(model, tokenizer, compile=spec.compile, max_batch=max_batch)
        while True:
            try:
                request = requests.get(timeout=5.0)
            except queue.Empty:
                if os.getppid() != parent:
                    return
                continue
            if request is None:  # the trainer reads no more: exit without flushing what it left unread
                results.cancel_join_thread()
                return
            step, version, rows, prompts, params = request
            generate = generate_on(spec, model, generator, params)
            sampled = sample_on(spec, model, generate, step, version, rows, prompts)
            if spec.device.type == "cuda":  # done reading the snapshot before the trainer may write it
                torch.cuda.synchronize(spec.device)
            # the log-probabilities by value (a tensor would travel as a shared-memory handle that the trainer could
            # not open once this process has ended, after an error in the next request)
            sampled.sampler_logps = [t.numpy() for t in sampled.sampler_logps]
            results.put(("ok", _Answer(step, sampled)))
    except BaseException as err:  # everything reaches the trainer, with its traceback
        results.put(("error", *_portable(err), traceback.format_exc()))


def _portable(err: BaseException) -> tuple[str, object]:
    """``err`` as it crosses to the trainer: loom's one-line errors keep their kind (a ConfigError by its fields:
    its own pickling loses them), others that pickle as themselves, the rest only as the traceback."""
    import pickle

    from loom.config.errors import ConfigError

    if isinstance(err, ConfigError):
        return "config", (err.field, err.value, err.allowed)
    try:
        return "pickled", pickle.loads(pickle.dumps(err))
    except Exception:  # any failure to pickle: the traceback says it
        return "text", None


def rebuilt(kind: str, data) -> BaseException | None:
    from loom.config.errors import ConfigError

    return ConfigError(*data) if kind == "config" else data


def stop(proc, requests, results) -> None:
    """The child ended: asked to when idle, else terminated; its queues closed."""
    if proc.is_alive():
        with contextlib.suppress(Exception):
            requests.put(None)
        proc.join(timeout=10)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    for q in (requests, results):
        q.cancel_join_thread()
        q.close()


def check_layout(engine, g) -> None:
    """grpo.sampler_device and grpo.sampler_process against this run's processes: checked when the run starts, not
    at its first GRPO step (after the warm-up)."""
    from loom.config.errors import ConfigError

    sampler_device(engine, g.sampler_device)
    if g.sampler_process and engine.env.world_size > 1:
        raise ConfigError(
            "grpo.sampler_process", True, "false with more than one process (a run of one process)"
        )


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
