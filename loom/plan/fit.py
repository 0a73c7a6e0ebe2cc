"""Does a run fit this machine? ``loom train`` compares the planner's per-rank needs (``rank_needs``: parameters
from the shape, activations traced on fake tensors) with the memory free here, before anything is allocated, so
that a model or batch far too large is one line instead of minutes of silence and an out-of-memory kill.

On a GPU the threshold is the estimate less its allowance for the caching allocator's fragmentation (the tensors
and the libraries' workspace) against what is free: near the card's capacity the allocator frees its cached
blocks and retries before it fails, so a step the full estimate puts over the free memory by no more than that
allowance starts, with a note. On the CPU a process holds more than the planner's tensors (the margin
below), and every local process draws on the same host memory.
"""

from __future__ import annotations

import copy
import os

from loom.config.errors import ConfigError
from loom.config.sections import Config
from loom.plan.memory import FRAGMENTATION, GIB, WORKSPACE_BYTES
from loom.plan.planner import rank_needs

# Host memory a CPU process holds beyond the planner's tensors: Python and PyTorch's libraries, the data loader,
# the allocator's fragmentation, and the estimate's own error (docs/planner.md, loom train's memory check). Going
# over is the kernel's OOM killer, no message.
HOST_RESERVE_BYTES = 1.0 * GIB  # per process
HOST_MARGIN = 0.10  # of the estimate


def host_room() -> tuple[float, str] | None:
    """(bytes the host can still give, what limits them): MemAvailable, or a container's (cgroup's) remaining
    limit where that is lower; None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    room = _cgroup_room()
    if room is not None and room < avail:
        return room, "the container's memory limit"
    return avail, "host memory"


def _cgroup_room() -> float | None:
    """What the memory cgroup (v2, else v1) still allows, None without a limit."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as fh:
                limit = fh.read().strip()
            with open(usage_file) as fh:
                usage = float(fh.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or float(limit) >= 2**60:  # v1 writes "no limit" as a huge number
            continue
        return max(0.0, float(limit) - usage)
    return None


def gpu_room(count: int, own_process: bool) -> tuple[float, str] | None:
    """(free bytes on the emptiest-looking of the first ``count`` CUDA devices, what was read). NVML reads free
    memory without creating a CUDA context; without NVML, ``mem_get_info`` where this process trains on the GPU
    itself (its context is made anyway), else the device's total (a launcher would hold a context for the
    whole run otherwise)."""
    import torch

    count = max(1, min(count, torch.cuda.device_count()))
    free = _nvml_free(count)
    if free is not None:
        return free, "free GPU memory"
    if own_process:
        return min(float(torch.cuda.mem_get_info(i)[0]) for i in range(count)), "free GPU memory"
    return min(float(torch.cuda.get_device_properties(i).total_memory) for i in range(count)), "GPU memory"


def _nvml_free(count: int) -> float | None:
    import torch

    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        free = []
        for i in range(count):
            uuid = str(
                torch.cuda.get_device_properties(i).uuid
            )  # the same device whatever CUDA_VISIBLE_DEVICES says
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            free.append(float(pynvml.nvmlDeviceGetMemoryInfo(handle).free))
        return min(free)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def model_field(cfg: Config) -> tuple[str, object]:
    """The setting that made the model this big, to name in the error."""
    m = cfg.model
    if m.n_layers:
        return "model.n_layers", m.n_layers
    if m.init_from:
        return "model.init_from", m.init_from
    return "model.flavor", m.flavor


def tensor_need(peak: float, gpu: bool) -> float:
    """What a step needs by the planner's ``peak`` estimate without its fragmentation allowance (on a GPU:
    loom.plan.memory.with_workspace adds ``FRAGMENTATION`` of the rest to a fixed workspace). Measured: the 8B
    CP2 pair at 64k tokens on 2 H200s (ring, all-gather), estimated at 139.6 and 142.5 GiB, ran with 135.9 and
    136.3 GiB reserved of the 139.8 GiB free (116.5 and 130.4 allocated)."""
    if not gpu:
        return peak
    return WORKSPACE_BYTES + (peak - WORKSPACE_BYTES) / (1 + FRAGMENTATION)


def check_fits(cfg: Config, dims, args, device: str, local_ranks: int) -> str:
    """ConfigError when the model state, or a training step, of one rank needs more memory than this machine has
    free: on the CPU every local rank draws on the host (with the margin above), on CUDA each rank has its own
    GPU (the tensors and workspace against the free memory). Returns a one-line note where a GPU step fits only
    without the estimate's fragmentation allowance, else ''."""
    t, p = cfg.training, cfg.parallel
    needs = rank_needs(cfg, dims, args, device, peak=False)  # analytic: checked before any tracing
    offloaded = p.cpu_offload  # the state lives on the host (FSDP2 offloads on one rank too)
    shard = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    state = needs.host_bytes if offloaded else needs.state_bytes
    gpu = device == "cuda"
    step_room = (
        _room(gpu_room(local_ranks, local_ranks == 1), 1) if gpu else _host_room(host_room(), local_ranks)
    )
    state_room = _host_room(host_room(), local_ranks) if offloaded else step_room
    if state_room and state > state_room[0]:
        field, value = model_field(cfg)
        sharded = f" / {shard} FSDP shards" if shard > 1 else ""
        hint = _layers_hint(cfg, dims, args, device, state_room[0], offloaded)
        fewer = "fewer processes on this machine, " if local_ranks > 1 and shard == 1 else ""
        more = (
            "or more ranks to shard it over (parallel.dp_shard)"
            if gpu
            else f"{fewer}or a GPU (processes on one host share its memory)"
        )
        if gpu and not offloaded:
            more += ", or parallel.cpu_offload true (the state in host memory)"
        per = (
            f"a frozen {cfg.lora.base_dtype} base and fp32 adapters with their gradients and AdamW moments"
            if cfg.lora.rank
            else "x 16 bytes"
        )
        raise ConfigError(
            field,
            value,
            f"model needs ~{state / GIB:,.1f} GiB for weights, gradients and optimizer "
            f"state per rank; {state_room[1]}: {needs.params / 1e9:,.3g}B parameters {per}"
            f"{sharded}; use a smaller model{hint}, {more}",
        )
    if step_room is None or (args.moe and t.dtype != "bfloat16") or args.attention == "flex":
        # no FlexAttention in the activation tracer (as loom plan); fp32 MoE: its ~9 traces (seconds) are left
        # to loom plan, since fp32 MoE runs are the debug-sized recipes
        return ""
    needs = rank_needs(cfg, dims, args, device)
    if needs.peak_bytes is None or needs.peak_bytes <= step_room[0]:
        return ""
    need = tensor_need(needs.peak_bytes, gpu)
    # on a GPU every figure below is the tensors and workspace, the estimate less its fragmentation allowance
    counted = " of its tensors and workspace" if gpu else ""
    frag = f"~{needs.peak_bytes / GIB:,.1f} with the caching allocator's fragmentation"
    with_frag = f"; {frag}" if gpu else ""
    if need <= step_room[0]:
        return (
            f"loom: note: a training step needs ~{need / GIB:,.1f} GiB per rank by the planner's estimate"
            f"{counted} ({frag}); {step_room[1]}: it starts near the GPU's capacity, where the allocator frees "
            f"its cache and retries: slower steps, or out of memory where the estimate is low"
        )
    step = (
        f"a training step needs ~{need / GIB:,.1f} GiB per rank by the planner's estimate{counted} "
        f"({needs.activation_bytes / GIB:,.1f} GiB of it activations of {t.micro_batch_size} x {t.seq_len} "
        f"tokens{with_frag})"
    )
    grows = need - needs.fixed_bytes
    fit = int(t.micro_batch_size * (step_room[0] - needs.fixed_bytes) / grows) if grows > 0 else 0
    if fit >= 1:
        raise ConfigError(
            "training.micro_batch_size",
            t.micro_batch_size,
            f"{step}; {step_room[1]}: lower training.micro_batch_size (about {fit} fit; "
            f"global_batch_size stays, with more accumulation)",
        )
    least = tensor_need(_smallest_step(cfg, dims, args, device), gpu)
    if least <= step_room[0]:
        # op-level recomputation reruns less than full (matmuls less than op): the one that reruns least and fits
        # micro-batch 1 is named first
        lighter = f"full (with micro_batch_size 1: ~{least / GIB:,.1f} GiB)"
        for mode in lighter_op_level(cfg, args):
            need = tensor_need(_smallest_step(cfg, dims, args, device, mode), gpu)
            if need <= step_room[0]:
                lighter = f"{mode} (~{need / GIB:,.1f} GiB) or full (~{least / GIB:,.1f} GiB), with micro_batch_size 1"
                break
        raise ConfigError(
            "training.micro_batch_size",
            t.micro_batch_size,
            f"{step}; {step_room[1]}: even micro_batch_size 1 does not fit: set "
            f"training.activation_checkpointing {lighter} or lower training.seq_len",
        )
    field, value = model_field(cfg)
    fewer = "fewer processes on this machine, " if local_ranks > 1 else ""
    todo = (
        "a smaller model, or more GPUs to shard it over (parallel.dp_shard)"
        if gpu
        else f"a smaller model (model.flavor debug runs anywhere), {fewer}or a GPU"
    )
    lightest = t.micro_batch_size == 1 and t.activation_checkpointing == "full"
    step += (
        ""
        if lightest
        else (f", and even micro_batch_size 1 with activation_checkpointing full ~{least / GIB:,.1f} GiB")
    )
    raise ConfigError(field, value, f"{step}; {step_room[1]}: use {todo}")


def lighter_op_level(cfg: Config, args) -> tuple[str, ...]:
    """The op-level checkpointing modes that keep less than the run's, the one that reruns least first: matmuls
    then op from none, op from matmuls; not matmuls where it is refused (compiled MoE blocks under expert
    parallelism: loom.resolve.check_moe)."""
    t = cfg.training
    modes = {"none": ("matmuls", "op"), "matmuls": ("op",)}.get(t.activation_checkpointing, ())
    if t.compile and cfg.parallel.ep > 1 and args.moe:
        modes = tuple(m for m in modes if m != "matmuls")
    return modes


def _smallest_step(cfg: Config, dims, args, device: str, ac: str = "full") -> float:
    """The planner's peak of a step of this model and layout at micro-batch 1 under checkpointing ``ac`` (full:
    the lightest step there is)."""
    small = copy.deepcopy(cfg)
    small.training.micro_batch_size, small.training.activation_checkpointing = 1, ac
    return rank_needs(small, dims, args, device).peak_bytes


def _room(room: tuple[float, str] | None, ranks: int) -> tuple[float, str] | None:
    """(bytes one rank may use, 'this machine has ... available (...)') from a room that ``ranks`` ranks share."""
    if room is None:
        return None
    avail, what = room
    shared = f", shared by {ranks} ranks" if ranks > 1 else ""
    return avail / ranks, f"this machine has {avail / GIB:,.1f} GiB available ({what}{shared})"


def _host_room(room: tuple[float, str] | None, ranks: int) -> tuple[float, str] | None:
    """``_room`` of host memory less the margin: what one of ``ranks`` processes may hold by the estimate."""
    shared = _room(room, ranks)
    if shared is None:
        return None
    usable = max(0.0, (shared[0] - HOST_RESERVE_BYTES) / (1 + HOST_MARGIN))
    each = " each" if ranks > 1 else ""
    return usable, (
        f"{shared[1]}, room for ~{usable / GIB:,.1f} GiB{each} after a margin of "
        f"{HOST_RESERVE_BYTES / GIB:g} GiB + {100 * HOST_MARGIN:g}% per process"
    )


def _layers_hint(cfg: Config, dims, args, device: str, avail: float, offloaded: bool) -> str:
    """' (about K layers fit)' when model.n_layers was set, from the state of 1 and of n layers (linear in between)."""
    if not cfg.model.n_layers or dims.pp > 1 or args.n_layers < 2:
        return ""
    one = rank_needs(cfg, dims, args.with_(n_layers=1), device, peak=False)
    full = rank_needs(cfg, dims, args, device, peak=False)
    state = (lambda n: n.host_bytes) if offloaded else (lambda n: n.state_bytes)
    per_layer = (state(full) - state(one)) / (args.n_layers - 1)
    fit = int((avail - (state(one) - per_layer)) / per_layer) if per_layer > 0 else 0
    return f" (about {fit:,} layers fit)" if fit >= 1 else ""
