"""Every backend choice of loom's kernels, in one module (the reasons and figures: docs/kernels.md):

- ``resolve_kernels``: the model's attention backend and fused ops from the config, ``auto`` resolved per device,
  compile mode, data layout and parallelism; ``kernel_choice``: that for a run's config, with what its device,
  Triton and the model's latent attention refuse;
- ``attention_candidates``, ``measure_attention``, ``fastest``: ``model.attention = auto`` on CUDA times the
  candidate backends (loom's kernel, SDPA pinned to cuDNN and to FlashAttention-2, FlashAttention-4 where it is
  installed, Flex for packed documents) on the run's shape at start-up, once per shape in a process, and takes the
  fastest; ``sdpa_refusal`` / ``check_fixed_attention``: where SDPA pinned to one backend, or FA4, cannot run;
- ``forward_kernel``, ``backward_kernels``: which kernels compute one ``loom::flash_attn`` call (the reference
  where Triton does not run, the Gluon Hopper kernels where they take the call and win, the Triton kernels
  otherwise).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from loom.config.errors import ConfigError
from loom.config.sections import SELECTIVE_AC
from loom.kernels.attention import fa4
from loom.kernels.triton_support import has_gluon_hopper, has_triton, interpreting, triton_runs_on


# ------------------------------------------------------------------------------------ the model's kernels
@dataclass(frozen=True)
class KernelChoice:
    attention: str  # "sdpa" | "sdpa_cudnn" | "sdpa_flash" | "fa4" | "flash" | "flex"
    fused_norm: bool
    fused_rope: bool
    fused_swiglu: bool
    fused_loss: bool

    def as_args(self) -> dict:
        return dict(
            attention=self.attention,
            fused_norm=self.fused_norm,
            fused_rope=self.fused_rope,
            fused_swiglu=self.fused_swiglu,
            fused_loss=self.fused_loss,
        )

    def describe(self) -> str:
        fused = [n for n in ("norm", "rope", "swiglu", "loss") if getattr(self, f"fused_{n}")]
        return f"attention={self.attention}, fused={'+'.join(fused) or 'none'}"


def _flag(value: str, auto: bool) -> bool:
    return auto if value == "auto" else value == "true"


def resolve_kernels(
    model_cfg,
    device_type: str,
    *,
    compile: bool,
    documents: bool,
    tp: bool = False,
    pp: bool = False,
    measure_attention: Callable[[], str] | None = None,
    triton: bool | None = None,
    window: bool = False,
    fp32: bool = False,
    float8: str = "none",
) -> KernelChoice:
    """``model_cfg``: the ``model`` config section; ``tp`` / ``pp``: tensor / pipeline parallelism on;
    ``measure_attention``: times the backends and names the faster (called only when ``auto`` needs it);
    ``triton``: whether Triton is installed (None = look; the planner assumes a GPU machine that has it);
    ``window``: the model attends through a sliding window; ``fp32``: the run computes in float32; ``float8``:
    training.float8.

    ``auto``: attention measured on CUDA (untimed: ours for documents or a sliding window, whose masked blocks it
    skips where SDPA would compute them under a dense mask, else SDPA; in fp32, a checking dtype whose full-precision
    Triton dots compile for minutes per autotuned block, not timed either; CPU: SDPA); the fused norm,
    RoPE and SwiGLU on CUDA without torch.compile (Inductor fuses them itself), the norm not under tensor
    parallelism (its inputs are DTensors); the norm also under compile with tensorwise float8, where Inductor fuses
    the recomputed norm with the float8 casts of its output into one slow kernel (3B on one H200: the fused norm
    1.036x, in bf16 0.974x; docs/kernels.md); the fused loss on CUDA without tensor or pipeline parallelism."""
    triton_gpu = device_type == "cuda" and (has_triton() if triton is None else triton)
    attention = model_cfg.attention
    if attention == "auto":
        if triton_gpu and measure_attention is not None and not fp32:
            attention = measure_attention()
        elif triton_gpu and (documents or window):
            attention = "flash"
        else:
            attention = "sdpa"
    eager_gpu = triton_gpu and not compile
    return KernelChoice(
        attention=attention,
        fused_norm=_flag(
            model_cfg.fused_norm, triton_gpu and not tp and (not compile or float8 == "tensorwise")
        ),
        fused_rope=_flag(model_cfg.fused_rope, eager_gpu),
        fused_swiglu=_flag(model_cfg.fused_swiglu, eager_gpu),
        fused_loss=_flag(model_cfg.fused_loss, triton_gpu and not (tp or pp)),
    )


# --------------------------------------------------------------------- timing the attention backends
# ------------------------------------------------------------------------------------ a run's kernel choice
def flex_unsupported(cfg) -> bool:
    """FlexAttention inside compiled blocks under op-level checkpointing (op, matmuls: the same placement), where
    its backward failed under op (docs/kernels.md). Full and every-k recomputation avoid it by checkpointing outside
    the compiled block (``parallelize_llama``)."""
    return cfg.training.compile and cfg.training.activation_checkpointing in SELECTIVE_AC


def kernel_choice(
    cfg,
    device: str,
    measure_attention: Callable[[], str] | None = None,
    triton: bool | None = None,
    window: Callable[[], int] = lambda: 0,
    attention_width: Callable[[], int] = lambda: 0,
    head_dim: Callable[[], int] = lambda: 0,
) -> KernelChoice:
    """model.attention / model.fused_* of a ``Config`` with ``auto`` resolved for ``device`` (``resolve_kernels``);
    ``measure_attention`` times the attention backends on this run's shape (the trainer's); ``triton``: whether
    Triton is there (None: look; the planner assumes a GPU machine that has it); ``window()``: the model's sliding
    window, ``attention_width()``: its latent attention's head width (0: not latent), ``head_dim()``: the head dim
    its attention call sees (0: unknown), each asked only when needed (loom.resolve.model_kernels reads them from
    the model's shape)."""
    if cfg.model.attention in FIXED_KERNEL:
        why = sdpa_refusal(
            cfg.model.attention,
            device,
            cfg.training.dtype,
            head_dim(),
            masked=cfg.data.document_positions or window() > 0,
            deterministic=cfg.run.deterministic,
        )
        if why:
            raise ConfigError(
                "model.attention", cfg.model.attention, f"{why}: allowed {ALLOWED_WITHOUT_PINNED}"
            )
    if cfg.model.attention == "fa4" and cfg.parallel.cp > 1:
        raise ConfigError(
            "model.attention",
            "fa4",
            "context parallelism (parallel.cp > 1) runs loom's kernel on the exchanged K/V, not FlashAttention-4: "
            "allowed auto | sdpa | flash there",
        )
    if cfg.model.attention == "flex" and device != "cuda":
        raise ConfigError(
            "model.attention",
            "flex",
            "needs CUDA (PyTorch's FlexAttention has no backward on CPU): allowed auto | sdpa | flash",
        )
    if cfg.model.attention == "flex" and flex_unsupported(cfg):
        raise ConfigError(
            "model.attention",
            "flex",
            f"under training.compile with training.activation_checkpointing {cfg.training.activation_checkpointing} "
            "(op-level: under op its backward crashed, CUDA illegal address; torch 2.11, H100): allowed auto | sdpa | "
            "sdpa_cudnn | sdpa_flash | fa4 | flash there (or flex without compile, or with none | full | every_k checkpointing)",
        )
    triton = has_triton() if triton is None else triton
    if (
        device == "cuda"
        and not triton
        and (
            cfg.model.attention in ("flash", "flex")
            or "true"
            in (cfg.model.fused_norm, cfg.model.fused_rope, cfg.model.fused_swiglu, cfg.model.fused_loss)
        )
    ):
        raise ConfigError(
            "model.attention / model.fused_*",
            cfg.model.attention if cfg.model.attention in ("flash", "flex") else "true",
            "needs Triton on CUDA (pip install triton); allowed auto | sdpa | sdpa_cudnn | sdpa_flash | fa4 | false "
            "without it",
        )
    kernels = resolve_kernels(
        cfg.model,
        device,
        compile=cfg.training.compile,
        documents=cfg.data.document_positions,
        tp=cfg.parallel.tp > 1,
        pp=cfg.parallel.pp > 1,
        measure_attention=measure_attention,
        triton=triton,
        fp32=cfg.training.dtype == "float32",
        window=window() > 0,
        float8=cfg.training.float8,
    )
    return mla_kernels(cfg, kernels, device, attention_width)


# loom.kernels.attention.triton.HEAD_DIMS, which imports Triton (the planner resolves CUDA kernels without it; a test
# keeps the two equal)
FLASH_HEAD_DIMS = (16, 32, 64, 128)


def mla_kernels(cfg, kernels: KernelChoice, device: str, attention_width: Callable[[], int]) -> KernelChoice:
    """Multi-head latent attention through loom's kernel on CUDA: its queries / keys and (zero-padded) values share
    one head dim (``attention_width()``, 0: not latent attention), which the Triton kernel must take; ``auto`` falls
    back to SDPA where it does not."""
    if kernels.attention != "flash" or device != "cuda":
        return kernels
    width = attention_width()
    if not width or width in FLASH_HEAD_DIMS:
        return kernels
    if cfg.model.attention == "flash":
        dims = ", ".join(map(str, FLASH_HEAD_DIMS))
        raise ConfigError(
            "model.attention",
            "flash",
            f"loom's kernel takes head dims {dims} and this model's latent "
            f"attention needs {width}: allowed auto | sdpa | sdpa_cudnn | sdpa_flash | fa4",
        )
    return replace(kernels, attention="sdpa")


# SDPA pinned to one of PyTorch's backends (``torch.nn.attention.sdpa_kernel``): the name -> SDPBackend's member
PINNED_SDPA = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION"}
# kernels of plain causal attention on CUDA for 16-bit inputs: the pinned SDPA backends and FlashAttention-4
FIXED_KERNEL = (*PINNED_SDPA, "fa4")
ALLOWED_WITHOUT_PINNED = "auto | sdpa | flash | flex"
# the largest head dim PyTorch's checks let each pinned backend take (torch 2.11, sdp_utils.cpp: FlashAttention-2 up
# to 256; cuDNN multiples of 8 up to 128, up to 256 on sm_90 / sm_100 with cuDNN > 9.22: only the device can tell,
# so the static rule allows 256 and torch's own check decides on the device, ``check_fixed_attention``); FA4 takes
# multiples of 8 up to 256 on Hopper, fewer on Blackwell (``loom.kernels.attention.fa4.head_dims_allowed``)
PINNED_MAX_HEAD_DIM = {"sdpa_cudnn": 256, "sdpa_flash": 256, "fa4": 256}
MULTIPLE_OF_8 = ("sdpa_cudnn", "fa4")
KERNEL_NAMES = {
    "sdpa_cudnn": "SDPA's cudnn backend",
    "sdpa_flash": "SDPA's flash backend",
    "fa4": "FlashAttention-4",
}


def sdpa_refusal(
    backend: str,
    device: str,
    dtype: str,
    head_dim: int = 0,
    masked: bool = False,
    deterministic: bool = False,
) -> str | None:
    """Why ``backend`` of ``FIXED_KERNEL`` (SDPA pinned to cuDNN or FlashAttention-2, or FlashAttention-4) cannot
    run this run's attention, or None: all are CUDA kernels for 16-bit inputs (``dtype``: training.dtype) of plain
    causal attention (``masked``: packed documents or a sliding window, which need a dense mask: FlashAttention-2
    takes none, and cuDNN's masked path computes every block), within their head dims (``head_dim``, 0: unknown);
    cuDNN and FA4 are refused under ``run.deterministic`` (PyTorch does not select cuDNN when deterministic
    algorithms are on; FA4 has a deterministic backward, which loom neither calls nor has measured)."""
    if device != "cuda":
        return f"{KERNEL_NAMES[backend]} needs CUDA (device {device})"
    if dtype not in ("bfloat16", "float16"):
        return f"runs bfloat16 / float16 only (training.dtype {dtype})"
    if masked and backend == "fa4":
        return "runs plain causal attention only in loom (not packed documents, data.document_positions, or a sliding window)"
    if masked:
        return (
            "runs plain causal attention only (packed documents, data.document_positions, or a sliding window "
            "need a dense mask)"
        )
    limit = PINNED_MAX_HEAD_DIM[backend]
    if head_dim and (head_dim > limit or (backend in MULTIPLE_OF_8 and head_dim % 8)):
        eight = " and a multiple of 8" if backend in MULTIPLE_OF_8 else ""
        return f"takes head dims up to {limit}{eight}; this model's attention has {head_dim}"
    if backend in ("sdpa_cudnn", "fa4") and deterministic:
        return "is not deterministic (run.deterministic = true)"
    return None


def attention_candidates(
    documents: bool, device: str = "cuda", dtype: str = "bfloat16", head_dim: int = 0, fa4: bool = False
) -> tuple[str, ...]:
    """The backends ``auto`` times: ours and FlexAttention for packed documents (both skip the masked blocks;
    SDPA would need a dense mask); else ours, SDPA pinned to cuDNN and to FlashAttention-2, and FlashAttention-4
    where ``fa4`` (installed, and this GPU takes the head dim: ``loom.kernels.attention.fa4.refusal``), those
    that can run here (``sdpa_refusal``), or PyTorch's own SDPA choice where none can (fp32: memory-efficient)."""
    if documents:
        return ("flash", "flex")
    names = (*PINNED_SDPA, "fa4") if fa4 else tuple(PINNED_SDPA)
    pinned = tuple(n for n in names if sdpa_refusal(n, device, dtype, head_dim) is None)
    return ("flash", *pinned) if pinned else ("flash", "sdpa")


def torch_takes(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether PyTorch's own check lets SDPA pinned to ``backend`` run causal attention on these q, k, v (its GPU,
    cuDNN version, head dims and layout; what ``sdpa_refusal`` cannot know before the device is there)."""
    check = {
        "sdpa_cudnn": torch.backends.cuda.can_use_cudnn_attention,
        "sdpa_flash": torch.backends.cuda.can_use_flash_attention,
    }[backend]
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, q.shape[1] != k.shape[1])
    return bool(check(params, False))


def check_fixed_attention(backend: str, shape: AttentionShape, device: torch.device) -> None:
    """A run that picked SDPA pinned to one backend or FlashAttention-4 by hand: the device's own check on the run's
    attention shape (PyTorch's on one sample; FA4's package, GPU and head dims), a ConfigError where it refuses
    (instead of "No available kernel" or an assertion at the first step)."""
    if backend == "fa4":
        why = fa4.refusal(device, shape.head_dim)
        if why:
            raise ConfigError(
                "model.attention",
                backend,
                f"FlashAttention-4 {why}: allowed auto | sdpa | sdpa_cudnn | sdpa_flash | flash | flex",
            )
        return
    if backend not in PINNED_SDPA or device.type != "cuda":
        return
    one = replace(shape, batch=1)
    q, k, v = attention_inputs(one, device)
    if not torch_takes(backend, q, k, v):
        raise ConfigError(
            "model.attention",
            backend,
            f"PyTorch's {backend.removeprefix('sdpa_')} SDPA backend does not take attention of {one.describe()} "
            f"on {torch.cuda.get_device_name(device)}: allowed {ALLOWED_WITHOUT_PINNED}",
        )


@dataclass(frozen=True)
class AttentionShape:
    """What one rank's attention call sees: q (batch, heads, seq, head_dim), k/v with kv_heads."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    dtype: torch.dtype

    def describe(self) -> str:
        return (
            f"{self.batch}x{self.heads}/{self.kv_heads}x{self.seq}x{self.head_dim} "
            f"{str(self.dtype).removeprefix('torch.')}"
        )


def attention_inputs(shape: AttentionShape, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """Random q, k, v (B, H, S, D) leaves that need gradients, laid out as the model's attention call gets them:
    (B, S, H, D) transposed (the heads of a token side by side), so a backend is timed on the strides it runs on."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randn(
            shape.batch, shape.seq, h, shape.head_dim, device=device, dtype=shape.dtype, generator=gen
        )
        .transpose(1, 2)
        .requires_grad_()
        for h in (shape.heads, shape.kv_heads, shape.kv_heads)
    ]


@functools.cache
def sleep_cycles_per_ms(device: int) -> float:
    """GPU cycles of ``torch.cuda._sleep`` per millisecond on CUDA device ``device`` (measured once per device)."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


@dataclass(frozen=True)
class QueuedTiming:
    gpu_ms: float  # GPU time per call
    cpu_issue_ms: float  # CPU time to issue one call
    cpu_ahead: bool  # whether the CPU had issued every call before the GPU reached the first


def queued_timing(step: Callable[[], None], iters: int, sleep_ms: float) -> QueuedTiming:
    """``iters`` calls of ``step`` queued behind a GPU sleep of ``sleep_ms``: while the CPU issues them the GPU
    sleeps, so the events around them time the GPU's execution alone (if the CPU got ahead)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(sleep_ms * sleep_cycles_per_ms(torch.cuda.current_device())) + 1000)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    issue_ms = (time.perf_counter() - t0) * 1e3 / iters
    ahead = not start.query()  # the start event still pending: the GPU had not reached the first call yet
    end.record()
    torch.cuda.synchronize()
    return QueuedTiming(start.elapsed_time(end) / iters, issue_ms, ahead)


def fwd_bwd_step(fn: Callable, inputs: list[torch.Tensor]) -> Callable[[], None]:
    """One forward + backward of ``fn(*inputs)`` with gradients reset first."""
    grad = torch.ones_like(fn(*inputs))

    def step():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)

    return step


def time_fwd_bwd(fn: Callable, inputs: list[torch.Tensor], warmup: int = 3, iters: int = 10) -> float:
    """GPU milliseconds per forward + backward of ``fn(*inputs)`` on CUDA, after ``warmup`` calls (which may
    compile or autotune). The timed calls queue behind a GPU sleep, so launch overhead is not counted: in a
    training step the CPU runs ahead of the GPU and a call costs its GPU time."""
    step = fwd_bwd_step(fn, inputs)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    sleep_ms = 2 * iters * (time.perf_counter() - t0) * 1e3  # the calls' issue time is below their wall time
    timing = queued_timing(step, iters, sleep_ms)
    for _ in range(2):  # a CPU slower than the estimate (another process, a page fault): longer sleeps
        if timing.cpu_ahead:
            break
        sleep_ms *= 4
        timing = queued_timing(step, iters, sleep_ms)
    return timing.gpu_ms


def measure(
    candidates: dict[str, Callable], inputs: list[torch.Tensor], timer=time_fwd_bwd
) -> dict[str, float]:
    """Milliseconds per call of each candidate; one that fails (unsupported shape, out of memory, a kernel
    that does not compile for this GPU) gets inf, so it is never chosen, and the others are still measured."""
    times = {}
    for name, fn in candidates.items():
        try:
            times[name] = timer(fn, inputs)
        except Exception as e:
            print(
                f"kernels: {name} not usable here ({type(e).__name__}: {str(e).splitlines()[0][:120]})",
                flush=True,
            )
            times[name] = math.inf
        for t in inputs:
            t.grad = None
    return times


def fastest(times: dict[str, float]) -> str:
    """The name with the smallest time; ties go to the first listed."""
    if not times or all(math.isinf(t) for t in times.values()):
        raise RuntimeError(f"no candidate ran: {times}")
    return min(times, key=lambda name: times[name])


# ``measure_attention``'s figures per (attention call, device, shape, candidates, documents): a shape is timed once
# per process
_TIMED: dict[tuple, dict[str, float]] = {}


def measure_attention(
    attend: Callable,
    shape: AttentionShape,
    device: torch.device,
    positions: torch.Tensor | None = None,
    timer=time_fwd_bwd,
    candidates: tuple[str, ...] | None = None,
) -> dict[str, float]:
    """Milliseconds per forward + backward of each candidate through ``attend(q, k, v, backend, positions)`` (the
    model's attention call) on ``shape``; ``positions``: packed documents' (B, S) positions; ``candidates``: None =
    ``attention_candidates`` for the shape's dtype and head dim (FlashAttention-4 where it runs here), less the
    pinned SDPA backends PyTorch's own check refuses on this device (not timed, not listed). Cached per call, device, shape, candidates and documents: a second
    call on the same shape (another model in the process, a restarted engine) times nothing."""
    dtype = str(shape.dtype).removeprefix("torch.")
    if candidates is None:
        runs_fa4 = fa4.refusal(device, shape.head_dim) is None
        candidates = attention_candidates(positions is not None, device.type, dtype, shape.head_dim, runs_fa4)
    if device.type == "cuda":  # PyTorch's check on one sample of the shape
        sample = attention_inputs(replace(shape, batch=1), device)
        candidates = tuple(n for n in candidates if n not in PINNED_SDPA or torch_takes(n, *sample))
    docs = None if positions is None else hash(positions.cpu().numpy().tobytes())
    key = (attend, str(device), shape, candidates, docs)
    if key not in _TIMED:
        fns = {name: (lambda q, k, v, name=name: attend(q, k, v, name, positions)) for name in candidates}
        _TIMED[key] = measure(fns, attention_inputs(shape, device), timer)
    return dict(_TIMED[key])


def describe_choice(times: dict[str, float]) -> str:
    """Which backend won a timing and by how much: 'sdpa_cudnn won, 1.06x flash (the next)' (each the time of the
    next fastest over the winner's), or that it was the only one that ran."""
    best = fastest(times)
    rest = sorted((t, n) for n, t in times.items() if n != best and not math.isinf(t))
    if not rest:
        return f"{best} won (the only candidate that ran)"
    return f"{best} won, {rest[0][0] / times[best]:.2f}x {rest[0][1]} (the next)"


# ------------------------------------------------------------------------- one loom::flash_attn call
def _hopper_takes(tensors: tuple[torch.Tensor, ...], window: int, key_bounds) -> bool:
    """Whether the Gluon Hopper kernels compute a call on ``tensors`` (q, k, v[, dout]): sm_90, 16-bit, head dim
    64/128, no window, documents only within one sequence (no ``key_bounds``), TMA-compatible (16-byte aligned)
    bases and strides, and Triton's Gluon present (not in the CPU interpreter)."""
    q = tensors[0]
    if key_bounds is not None or window or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if q.shape[-1] not in (64, 128):
        return False
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if interpreting() or not has_gluon_hopper():
        return False
    return all(t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:3]) for t in tensors)


def forward_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bounds, window: int) -> str:
    """The forward's kernel: "reference" (no Triton on this device), "hopper" (the Gluon forward, wherever it
    takes the call: faster than the Triton forward on every shape measured) or "triton"."""
    if not triton_runs_on(q.device):
        return "reference"
    return "hopper" if _hopper_takes((q, k, v), window, key_bounds) else "triton"


def backward_kernels(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, bounds, key_bounds, window: int
) -> tuple[str, str]:
    """The backward's (dK/dV kernel, dQ kernel). dK/dV: "reference", "triton", "hopper" or "hopper_persistent"
    (the persistent Gluon dK/dV wins on head dim 128 MHA packed documents only); dQ: "reference", "triton" or
    "hopper" (the Gluon dQ wins at head dim 128, loses at 64). ``dout`` as the kernels read it (stride 1 in the
    head dim)."""
    if not triton_runs_on(q.device):
        return "reference", "reference"
    if not _hopper_takes((q, k, v, dout), window, key_bounds):
        return "triton", "triton"
    dim = q.shape[-1]
    persistent = dim == 128 and q.shape[1] == k.shape[1] and bounds is not None
    return "hopper_persistent" if persistent else "hopper", "hopper" if dim == 128 else "triton"
