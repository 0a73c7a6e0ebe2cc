"""CPU offload on one GPU (``parallel.cpu_offload``): the Llama-3 8B shape trained with FSDP2 on a 1-rank mesh, its
weights, gradients and AdamW state in host memory, measured against ``loom plan``'s estimate of the same config.

Host memory decides the shape. The offloaded state is 16 bytes a parameter (fp32 weights, fp32 gradients, two fp32
AdamW moments): 128 GB for the whole 8B model (8.03B parameters), as much as the device machine's 128 GiB of RAM
holds in all. ZeRO-Offload's split does not get under it either (fp16 weights on the GPU, but fp32 master weights,
moments and fp16 gradients on the host: 14 bytes a parameter, 112 GB). So the default keeps every dimension of the
8B model (width 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary 128256: each block and the embeddings are the 8B's)
and 18 of its 32 blocks (``--layers``): 4.98B parameters, 74 GiB of host state, with room for the process and the
pinned allocator's rounding. Without offload the same shape does not fit one H100 (the planner: 81.6 GiB at the
step's peak, its state alone 74 GiB); ``--layers 32`` is the whole model, for a host with ~160 GiB or more. Weights
are randomly initialized; nothing is downloaded.

Measured: tokens/s over the steps after ``--warmup``, the time in the optimizer step (on the host) and the global
norm, the GPU's peak memory, the process's peak RSS; and the planner's two offload assumptions, measured apart
before the model is built: pinned host <-> GPU copy bandwidth (1 GiB each way) and PyTorch's fused CPU AdamW
throughput (GB/s at 28 bytes a parameter, on 256M parameters).

    python -m bench.offload --out bench/results/offload_8b_h100.json      # ~3-5 minutes on one H100

Two more variants, each run twice (without, then with the offload) on the same config, report what the offload
saves and costs and whether the losses stay equal:

- ``--variant activation`` (training.activation_offload all; on its own, no CPU offload): GPU peak memory saved and
  tokens/s lost. The 8B shape's state must fit the GPU: ``--layers 4 --ac none --micro-batch 2`` (0.9B parameters of
  blocks and 1B of embeddings: 30 GiB of state on an H200).
- ``--variant nvme`` (optimizer.offload nvme, the moments in files under ``--nvme-path``, the machine's local disk):
  the optimizer step's time and the tokens/s lost; host RSS against the run without.

    python -m bench.offload --variant activation --layers 4 --ac none --micro-batch 2 --global-batch 4
    python -m bench.offload --variant nvme --layers 4 --nvme-path /tmp

``--tiny`` runs any variant on the CPU with the debug model in seconds (the script's own check; its figures mean
nothing).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import tempfile
import time

from bench.common import command, default_commit, environment, write_result


def copy_gbps(nbytes: int = 2**30) -> dict:
    """Pinned host <-> GPU copy bandwidth (GB/s), each direction, best of 5."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out[name] = nbytes / best / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return out


def host_adamw_gbps(n: int = 256 * 2**20) -> float:
    """PyTorch's fused CPU AdamW on ``n`` fp32 parameters: GB/s at 28 bytes a parameter (the planner's count)."""
    import torch

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()  # the moments are allocated here
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t)
    return 28 * n / best / 1e9


def config(args, root: str, **extra):
    from loom.config import build_config

    over = {
        "run.dir": os.path.join(root, "run"),
        "run.device": "cuda",
        "run.seed": 0,
        "data.cache_dir": os.path.join(root, "cache"),
        "model.flavor": "8B",
        "model.n_layers": args.layers,
        "training.dtype": "bfloat16",
        "training.seq_len": args.seq,
        "training.global_batch_size": args.global_batch,
        "training.micro_batch_size": args.micro_batch,
        "training.activation_checkpointing": args.ac,
        "training.compile": str(args.compile).lower(),
        "training.steps": args.steps,
        "optimizer.warmup_steps": 1,
        "optimizer.lr": 1e-4,
        "metrics.every": 1,
        "metrics.tensorboard": "false",
        "metrics.progress": "false",
        "checkpoint.at_end": "false",
        # no validation: the end-of-run one fell in the last timed step and made the step a third of its speed
        "training.eval_every": 0,
        "training.eval_at_end": "false",
    }
    if args.tiny:  # the debug model on the CPU
        over.update({"run.device": "cpu", "model.flavor": "debug", "training.dtype": "float32"})
        over.pop("model.n_layers")
    over.update(extra)
    return build_config(None, {k: str(v) for k, v in over.items()})


VARIANTS = {  # (the run without, the run with the offload)
    "cpu": (None, {"parallel.cpu_offload": "true"}),
    "activation": ({}, {"training.activation_offload": "all"}),
    "nvme": ({}, {"optimizer.offload": "nvme"}),
}


def timed(fn, spent: list[float]):
    """``fn`` that appends its seconds (the GPU synchronized before and after) to ``spent``."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)

    def wrapped(*a, **kw):
        sync()
        t = time.perf_counter()
        out = fn(*a, **kw)
        sync()
        spent.append(time.perf_counter() - t)
        return out

    return wrapped


def plan(cfg, gpu_name: str) -> dict:
    from loom.config.errors import ConfigError
    from loom.plan.hardware import gpu_named
    from loom.plan.planner import estimate

    c = cfg
    try:
        est = estimate(c, 1, gpu_named(gpu_name))
    except ConfigError as err:
        return {"error": str(err)}
    return {
        "tokens_per_s": est.tokens_per_s_per_gpu,
        "step_ms": est.time.ms(),
        "memory_gib": est.memory.gib(),
        "fits": est.fits,
        "host_gib": est.host_gib,
        "disk_gib": est.disk_gib,
        "notes": est.notes,
    }


def measure(cfg, args, cuda: bool) -> dict:
    """One run of ``cfg``: the median step's tokens/s after the warmup, the optimizer step's and the norm's seconds,
    peak memory."""
    import torch

    from loom.train.trainer import Trainer

    if cuda:  # the peak is this run's: above what an earlier run left allocated
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - t0
    optimizer_s, norm_s = [], []
    trainer.optimizer.step = timed(trainer.optimizer.step, optimizer_s)
    trainer.steps.grad_norm = timed(trainer.steps.grad_norm, norm_s)
    records = trainer.fit()
    kept = records[args.warmup :]
    tokens = args.global_batch * args.seq
    seconds = [tokens / r["tokens_per_s"] for r in kept]
    out = {
        "parameters": sum(p.numel() for p in trainer.params),
        "build_s": build_s,
        "tokens_per_s": tokens / statistics.median(seconds),  # the median step: one slow step moves a mean
        "step_s": statistics.median(seconds),
        "optimizer_s": sum(optimizer_s[args.warmup :]) / len(kept),
        "grad_norm_s": sum(norm_s[args.warmup :]) / len(kept),
        "gpu_peak_allocated_gib": (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None,
        "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "gpu_allocated_before_gib": before / 2**30 if cuda else None,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "losses": [r["loss"] for r in records],
    }
    offload = getattr(trainer.parts[0], "activation_offload", None)
    if offload is not None:
        out["activation_offload_bytes_per_step"] = offload.packed_bytes / len(records)  # copied to the host
        out["activation_resident_bytes_per_step"] = offload.resident_bytes / len(
            records
        )  # kept without offload
    del trainer, records, kept
    gc.collect()  # the trainer's reference cycles: without it the next run's peak counted this one's state
    if cuda:
        torch.cuda.empty_cache()
    return out


def compare(args, root: str, gpu: str, cuda: bool) -> dict:
    """``--variant activation`` / ``nvme``: the config without, then with the offload (host RSS is the process's
    peak so far: the second run's figure is at least the first's)."""
    without, with_ = VARIANTS[args.variant]
    if args.variant == "nvme":
        with_ = {**with_, "optimizer.offload_path": args.nvme_path or root}
    runs, planned = {}, {}
    for name, extra in (("without", without), ("with", with_)):
        cfg = config(args, os.path.join(root, name), **extra)
        planned[name] = plan(cfg, gpu)
        print(f"planned {name}:", planned[name], flush=True)
        runs[name] = measure(cfg, args, cuda)
    a, b = runs["without"], runs["with"]
    summary = {
        "tokens_per_s_ratio": b["tokens_per_s"] / a["tokens_per_s"],
        "optimizer_s_ratio": b["optimizer_s"] / a["optimizer_s"] if a["optimizer_s"] else None,
        "losses_equal": a["losses"] == b["losses"],
        "max_loss_rel_diff": max(abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"])),
    }
    if cuda:
        summary["gpu_peak_saved_gib"] = a["gpu_peak_allocated_gib"] - b["gpu_peak_allocated_gib"]
    print("summary:", summary, flush=True)
    return {"measured": runs, "planned": planned, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variant", choices=tuple(VARIANTS), default="cpu", help="which offload (module docstring)"
    )
    p.add_argument("--layers", type=int, default=18, help="blocks of the 8B shape (32: the whole model)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--ac", default="full", help="training.activation_checkpointing")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput")
    p.add_argument(
        "--nvme-path", default="", help="--variant nvme: optimizer.offload_path (default: a temp folder)"
    )
    p.add_argument("--tiny", action="store_true", help="the debug model on the CPU: checks the script runs")
    p.add_argument(
        "--gpu", default="", help="the planner's GPU kind (default: H200 if the device says so, else H100)"
    )
    p.add_argument("--commit", default=default_commit())
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.tiny:
        args.seq, args.global_batch, args.micro_batch, args.steps, args.warmup = 32, 4, 2, 3, 1
    import torch

    if args.steps <= args.warmup:
        p.error("--steps must be more than --warmup")
    cuda = not args.tiny
    out = (
        args.out
        or f"bench/results/offload_{'8b' if args.variant == 'cpu' else args.variant + '_8b'}_h100.json"
    )
    gpu = args.gpu or ("H200" if cuda and "H200" in torch.cuda.get_device_name() else "H100")
    if args.variant != "cpu":
        with tempfile.TemporaryDirectory() as root:
            doc = compare(args, root, gpu, cuda)
        doc = {
            "environment": environment(args.commit, command()),
            "settings": {**vars(args), "gpu_kind": gpu},
            **doc,
        }
        write_result(out, doc)
        print(f"wrote {out}")
        return
    assumptions = {
        "copy_gbps": copy_gbps() if cuda else None,
        "host_adamw_gbps": host_adamw_gbps(2**20 if args.tiny else 256 * 2**20),
    }
    print("measured assumptions:", assumptions, flush=True)
    with tempfile.TemporaryDirectory() as root:
        cfg = config(args, root, **VARIANTS["cpu"][1])
        planned = plan(cfg, gpu)
        without = plan(config(args, root), gpu)
        print("planned:", planned, flush=True)
        measured = measure(cfg, args, cuda)
    doc = {
        "environment": environment(args.commit, command()),
        "settings": {**vars(args), "gpu_kind": gpu},
        "measured": measured,
        "measured_assumptions": assumptions,
        "planned": planned,
        "planned_without_offload": without,
        "measured_vs_planned": {
            "tokens_per_s": measured["tokens_per_s"] / planned["tokens_per_s"]
            if "error" not in planned
            else None,
            "gpu_peak": measured["gpu_peak_reserved_gib"] / planned["memory_gib"]["total"]
            if "error" not in planned and cuda
            else None,
            "host": measured["host_peak_rss_gib"] / planned["host_gib"] if "error" not in planned else None,
        },
    }
    write_result(out, doc)
    gpu_peak = f"{measured['gpu_peak_reserved_gib']:.1f} GiB reserved" if cuda else "n/a"
    print(
        f"measured: {measured['tokens_per_s']:,.0f} tokens/s, step {measured['step_s']:.2f} s (optimizer "
        f"{measured['optimizer_s']:.2f} s, norm {measured['grad_norm_s']:.2f} s), GPU peak "
        f"{gpu_peak}, host RSS {measured['host_peak_rss_gib']:.1f} GiB"
    )
    if "error" not in planned:
        print(
            f"planned:  {planned['tokens_per_s']:,.0f} tokens/s, step {planned['step_ms']['total'] / 1e3:.2f} s "
            f"(optimizer {planned['step_ms']['optimizer'] / 1e3:.2f} s), GPU {planned['memory_gib']['total']:.1f} "
            f"GiB, host {planned['host_gib']:.1f} GiB"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
