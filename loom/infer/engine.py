"""The engine: a model with a KV cache in every attention layer (``loom.infer.cache``), a prefill of right-padded
prompts, extension steps of S tokens at per-sequence positions (a decode step is S = 1), CUDA graphs of those steps,
and the decode loop.

Graphs: on CUDA each step shape (batch, S) is captured once as a ``torch.cuda.CUDAGraph`` of the whole forward
(embedding, every block, norm, head) and replayed with its static token and position buffers refilled; with
``compile`` the blocks are compiled first (``nn.Module.compile`` per block, one graph shared by every block, as
training compiles them), so the captured kernels are Inductor's fused ones. A capture runs the step a few times:
those writes land in ``SCRATCH`` slots past the longest sequence, which no query ever sees. On the CPU the steps
run eagerly; nothing else differs.

The prefill runs eagerly (its shapes change with every batch of prompts) through the model's own attention kernels,
and only each row's last prompt position reaches the output head (a forward hook on the final norm picks it), so
a long prompt never makes a (B, S, V) logits tensor."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from loom.config.errors import ConfigError
from loom.infer.cache import install, reinstall, uninstall
from loom.infer.pack import pack as packed_groups
from loom.infer.pack import unpack
from loom.infer.sampling import SamplingParams, mark_seen, new_generator, sample
from loom.parallel.compile import graph_free, graph_free_blocks
from loom.parallel.shards import local_tensor

SCRATCH = (
    16  # slots past the longest sequence: where a graph capture's warm-up writes land (and the longest S)
)
ALIGN = 64  # cache lengths are rounded up to this: fewer re-allocations and captures across calls
# Inductor's options for the blocks on CUDA. With coordinate-descent tuning Inductor lowers a matmul with one row
# (a batch-1 decode step's projections) to its own Triton reduction instead of a cuBLAS call, which it can fuse with
# the RMSNorm before it and the RoPE and residual after it, and tunes the block sizes of every Triton kernel for the
# shapes it sees; other matmuls stay cuBLAS's. It lengthens the first compilation only.
COMPILE_OPTIONS = {"coordinate_descent_tuning": True}


@dataclass
class Stats:
    """What one ``generate`` call did: prompts, tokens in and out, seconds (prefill: until the first tokens were
    sampled), and for speculative decoding the tokens proposed and accepted and the target's forwards."""

    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    proposed: int = 0
    accepted: int = 0
    target_steps: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def add(self, other: Stats) -> None:
        for name in (
            "prompts",
            "prompt_tokens",
            "new_tokens",
            "seconds",
            "prefill_seconds",
            "proposed",
            "accepted",
            "target_steps",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        out = {
            k: getattr(self, k)
            for k in ("prompts", "prompt_tokens", "new_tokens", "seconds", "prefill_seconds")
        }
        out["tokens_per_s"] = self.tokens_per_s
        if self.proposed:
            out.update(
                proposed=self.proposed,
                accepted=self.accepted,
                acceptance=self.acceptance,
                target_steps=self.target_steps,
            )
        return {**out, **self.extra}


def _uncached_autocast():
    """The caller's CUDA autocast with its weight-cast cache off: a capture must cast the weights inside the graph,
    not read a cached copy made from the weights of that moment (freed when the caller's autocast ends, and stale
    once training updates the weights while the graph is kept)."""
    return torch.autocast(
        "cuda",
        dtype=torch.get_autocast_dtype("cuda"),
        enabled=torch.is_autocast_enabled("cuda"),
        cache_enabled=False,
    )


@contextlib.contextmanager
def _own_blas_workspace():
    """cuBLAS's cached workspaces dropped before and after a capture: the capture then allocates the workspace its
    matmuls use in the graph's own memory pool, which lives as long as the graph. A workspace cached before the
    capture would be baked into the graph yet freed by whoever next clears the cache (torch.compile's CUDA graph
    trees clear it around each warm-up and recording: a training job's ``training.cuda_graphs`` steps between two
    rollouts made the kept decode graphs write freed memory, an illegal address on an H200)."""
    torch._C._cuda_clearCublasWorkspaces()
    try:
        yield
    finally:
        torch._C._cuda_clearCublasWorkspaces()


class _Graph:
    """One captured step: static inputs, the captured graph, its static output."""

    def __init__(self, fn, tokens: torch.Tensor, positions: torch.Tensor):
        self.tokens, self.positions = tokens, positions
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), _uncached_autocast():  # warm-up (and compilation) outside the capture
            for _ in range(3):
                fn(tokens, positions)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the NCCL watchdog's event queries on another thread (a training job's collectives enqueued
        # before the capture) must not invalidate it, as under the default "global" mode they may. stream: one on
        # this device (torch.cuda.graph's default is one stream for the process, made on the device of the first
        # capture: async GRPO's sampler captures on a second GPU after the trainer captured on the first)
        with (
            _own_blas_workspace(),
            torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"),
            _uncached_autocast(),
        ):
            self.out = fn(tokens, positions)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.out  # overwritten by the next replay


class Engine:
    """``model`` (a loom Llama: plain, or split by ``loom.infer.tp``) with caches, steps and graphs.

    ``compile`` / ``cuda_graphs`` None: on for CUDA, off on the CPU (graphs also off under tensor parallelism).
    ``group``: the tensor-parallel process group
    (sampled tokens are broadcast from its first rank, so every rank continues with the same ones). ``pack``: the
    projections that read one input as one matmul (``loom.infer.pack``; for a model the engine owns: a training
    job's model stays as it is)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        group=None,
        pack: bool = False,
    ):
        self.model = model.eval()
        weight = next(iter(model.parameters()))
        weight = local_tensor(weight)
        self.device, self.dtype = weight.device, weight.dtype
        cuda = self.device.type == "cuda"
        self.compile = cuda if compile is None else compile
        # under tensor parallelism the steps run NCCL collectives, whose capture failed on the GPU (the stream capture
        # was invalidated): there the steps run compiled, without graphs
        self.cuda_graphs = (cuda and group is None) if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not cuda:
            raise ConfigError(
                "cuda_graphs", True, f"CUDA graphs need a CUDA device (the model is on {self.device})"
            )
        if self.cuda_graphs and group is not None:
            raise ConfigError(
                "cuda_graphs",
                True,
                "not under tensor parallelism (its collectives are not captured yet): allowed false",
            )
        self.group = group
        self.vocab_size = model.args.vocab_size
        self.caches: list[nn.Module] = []
        self.batch = self.length = 0
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._parked = False  # caches kept but out of the model (``park``)
        self._select: torch.Tensor | None = None
        self._hook = model.norm.register_forward_hook(self._last_positions)
        # before compiling: the blocks trace the packed matmuls
        self._packed = pack and packed_groups(model) > 0
        self._compiled = []
        # blocks a training job compiled with CUDA graphs (training.cuda_graphs): the engine's forwards run their
        # compile without graphs, so no prefill or decode shape records a graph of training's
        self._graph_free = graph_free_blocks(model)
        if self.compile:
            for block in model.layers.values():
                if getattr(block, "_compiled_call_impl", None) is None:
                    block.compile(fullgraph=True, options=COMPILE_OPTIONS if cuda else None)
                    self._compiled.append(block)

    # ---- cache -------------------------------------------------------------------------------------------------
    def allocate(self, batch: int, length: int) -> None:
        """Caches for ``batch`` rows of at least ``length`` positions each (kept when they already fit)."""
        if self.caches and batch == self.batch and length + SCRATCH <= self.length:
            if self._parked:  # back into the model they were captured with: the graphs stay valid
                reinstall(self.model, self.caches)
                self._parked = False
            return
        self.release()
        size = -(-(length + SCRATCH) // ALIGN) * ALIGN
        if self.model.rope.shape[1] < size:  # positions past the table built for training: extend it
            self.model.args = self.model.args.with_(max_seq_len=size)
            self.model.init_buffers(self.device)
        self.caches = install(self.model, batch, size, self.dtype, self.device)
        self.batch, self.length = batch, size

    def release(self) -> None:
        """Drop the caches and graphs (the model attends as in training again)."""
        self._graphs.clear()
        if self.caches:
            uninstall(self.model)
            self.caches, self.batch, self.length = [], 0, 0
        self._parked = False

    def park(self) -> None:
        """Take the caches out of the model (it attends as in training again) but keep them and the captured graphs
        for the next ``allocate`` that fits (rollouts between training steps): no re-allocation or re-capture. The
        graphs stay valid because the weights are updated in place and the caches' memory stays where it was."""
        if self.caches and not self._parked:
            uninstall(self.model)
            self._parked = True

    def close(self) -> None:
        """Release everything and give the model back as it came (hook removed, blocks no longer compiled)."""
        self.release()
        self._hook.remove()
        for block in self._compiled:
            block._compiled_call_impl = None
        self._compiled = []
        if self._packed:
            unpack(self.model)
            self._packed = False

    @property
    def cache_bytes_per_token(self) -> int:
        """Cache bytes one token takes on this rank, all layers."""
        return sum(c.bytes_per_token for c in self.caches)

    # ---- forwards ----------------------------------------------------------------------------------------------
    def _last_positions(self, module, args, out: torch.Tensor):
        """Forward hook on the final norm: during a prefill only each row's last prompt position goes on."""
        if self._select is None:
            return None
        return out[torch.arange(out.shape[0], device=out.device), self._select][:, None]  # (B, 1, E)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Right-padded prompts tokens (B, S) into the cache's slots 0..S-1; returns the logits (B, V) at each row's
        last prompt position ``last`` (B,)."""
        self._select = last
        try:
            with self._plain_blocks():
                return self.model(tokens)[:, 0]
        finally:
            self._select = None

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) at positions (B, S) (their slots) -> logits (B, S, V); replayed from a CUDA graph where
        graphs are on (the result is then overwritten by the next step of that shape)."""
        if self.cuda_graphs and tokens.shape[1] <= SCRATCH:
            graph = self._graphs.get(tuple(tokens.shape))
            if graph is None:
                graph = self._graphs[tuple(tokens.shape)] = self._capture(*tokens.shape)
            return graph(tokens, positions)
        with self._plain_blocks():
            return self.model(tokens, positions)

    def _capture(self, batch: int, seq: int) -> _Graph:
        tokens = torch.zeros(batch, seq, dtype=torch.long, device=self.device)
        scratch = self.length - SCRATCH + torch.arange(seq, device=self.device)  # past every real position
        with self._plain_blocks():
            return _Graph(self.model, tokens, scratch.expand(batch, seq).contiguous())

    def _plain_blocks(self):
        """Where the model's blocks replay training's CUDA graphs, their compile without graphs meanwhile."""
        return graph_free(self._graph_free) if self._graph_free else contextlib.nullcontext()

    def share(self, tokens: torch.Tensor) -> torch.Tensor:
        """Under tensor parallelism, the first rank's tokens on every rank (in place)."""
        if self.group is not None:
            import torch.distributed as dist

            dist.broadcast(tokens, src=dist.get_global_rank(self.group, 0), group=self.group)
        return tokens

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- the decode loop ---------------------------------------------------------------------------------------
    def start(
        self, prompts: list[list[int]], reserve: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Allocate for ``prompts`` plus ``reserve`` positions each and prefill them: (logits (B, V) at each last
        prompt position, the prompts right-padded (B, S), their lengths (B,)) on the device."""
        lengths = [len(p) for p in prompts]
        if min(lengths) == 0:
            raise ConfigError("prompt", "", "an empty prompt (no tokens): give at least one token")
        width = max(lengths)
        self.allocate(len(prompts), width + reserve)
        # pads repeat each row's last token: harmless in the cache (past the row's end) and in the penalty's set
        rows = [p + [p[-1]] * (width - len(p)) for p in prompts]
        tokens = torch.tensor(rows, dtype=torch.long, device=self.device)  # (B, S)
        lens = torch.tensor(lengths, dtype=torch.long, device=self.device)  # (B,)
        return self.prefill(tokens, lens - 1), tokens, lens

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, sequences: list) -> Stats:
        """Decode every prompt until its sequence says it is done (``sequences[i].add(token) -> done``) or the
        token budget is spent. One forward per step for the whole batch: finished rows are computed and ignored.

        The host never waits for a step: each step's tokens go to the host by an asynchronous copy queued before
        the next step, so the stop checks and streaming of step i run while step i + 1 computes (a batch whose
        every row ended early computes one step too many). Every row advances one position per step, finished or
        not: at most ``max_new_tokens`` - 1 positions, which the cache reserves."""
        t0 = time.perf_counter()
        logits, tokens, lens = self.start(prompts, params.max_new_tokens)
        generator = new_generator(params.seed, self.device)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(len(prompts), logits.shape[-1], dtype=torch.bool, device=self.device)
            mark_seen(seen, tokens)
        pos = lens[:, None].clone()  # (B, 1) the position of the token about to be sampled
        stats = Stats(prompts=len(prompts), prompt_tokens=int(sum(len(p) for p in prompts)))
        reader = _HostReader(len(prompts), self.device)
        for i in range(params.max_new_tokens):
            nxt = self.share(sample(logits, params, generator, seen))  # (B,)
            mark_seen(seen, nxt)
            reader.queue(nxt)
            if i < params.max_new_tokens - 1:
                logits = self.step(nxt[:, None], pos)[:, 0]  # (B, V), queued before the host waits for nxt
                pos += 1
            host = reader.get()
            if i == 0:
                stats.prefill_seconds = time.perf_counter() - t0
            for seq, token in zip(sequences, host):
                if not seq.done:
                    seq.add(token)
                    stats.new_tokens += 1
            if all(seq.done for seq in sequences):
                break
        self.sync()
        stats.seconds = time.perf_counter() - t0
        return stats


class _HostReader:
    """Tokens (B,) to the host without waiting for the work queued after them: on CUDA a non-blocking copy to
    pinned memory and an event (the host then waits for the copy, not for the stream); elsewhere ``tolist``."""

    def __init__(self, batch: int, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.buffer = torch.empty(batch, dtype=torch.long, pin_memory=True)
            self.event = torch.cuda.Event()
        self.tokens: torch.Tensor | None = None

    def queue(self, tokens: torch.Tensor) -> None:
        if self.cuda:
            self.buffer.copy_(tokens, non_blocking=True)
            self.event.record()
        else:
            self.tokens = tokens

    def get(self) -> list[int]:
        if self.cuda:
            self.event.synchronize()
            return self.buffer.tolist()
        return self.tokens.tolist()
