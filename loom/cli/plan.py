"""``loom plan``: what a configuration needs on N GPUs of a kind, and which layout would run fastest,
computed on this machine (no GPU) before any is rented. Model: loom.plan; accuracy: docs/planner.md."""

from __future__ import annotations

import json
import os

from loom.config import ConfigError, build_config, parse_overrides
from loom.config.paths import check_file_writable

USAGE = """usage: loom plan [--config FILE.toml] [--gpus N] [--gpu KIND] [--search] [--top K] [--json FILE]
                 [--section.field VALUE ...]

Estimates peak memory per GPU and step time of the configuration on N GPUs (default 1) of KIND
(default H100; known: {kinds}). With --search, ranks every layout loom accepts for the model and
global batch (tp, pp, cp, replicate x shard, pipeline schedule, micro-batch, activation checkpointing)
and prints the K fastest that fit (default 10). Nothing is trained, nothing needs a GPU."""

_OPTIONS = {"--gpus": "gpus", "--gpu": "gpu", "--top": "top", "--json": "json", "--config": "config", "-c": "config"}


def parse_args(argv: list[str]) -> tuple[dict, list[str]]:
    """(planner options, --section.field overrides)."""
    opts = {"gpus": "1", "gpu": "H100", "top": "10", "json": "", "config": None, "search": False}
    rest, i = [], 0
    while i < len(argv):
        name, eq, val = argv[i].partition("=")
        if name == "--search":
            opts["search"] = True
        elif name in _OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(name, None, "missing value after the option", show_value=False)
                val, i = argv[i + 1], i + 1
            opts[_OPTIONS[name]] = val
        else:
            rest.append(argv[i])
        i += 1
    for key in ("gpus", "top"):
        try:
            opts[key] = int(opts[key])
        except ValueError:
            raise ConfigError(f"--{key}", opts[key], "expected a positive integer") from None
        if opts[key] < 1:
            raise ConfigError(f"--{key}", opts[key], "expected a positive integer")
    return opts, rest


def gpu_kind(name: str):
    from loom.plan.hardware import GPUS, gpu_named

    try:
        return gpu_named(name)
    except KeyError:
        raise ConfigError("--gpu", name, "unknown GPU kind; allowed: " + " | ".join(GPUS)) from None


def assumptions(gpu, dtype: str) -> str:
    return (f"{gpu.name}: {gpu.memory_gib:.1f} GiB, {gpu.peak(dtype) / 1e12:.0f} TFLOP/s {dtype}, HBM "
            f"{gpu.hbm_tbps} TB/s, NVLink {gpu.link_gbps:.0f} GB/s bus, network {gpu.network_gbps:.0f} GB/s per GPU, "
            f"{gpu.gpus_per_node} GPUs per node")


def breakdown(est) -> str:
    mem = est.memory.gib()
    time = est.time.ms()
    lines = [f"layout: {est.describe()} (accumulation {est.layout['accumulation']})",
             "memory per GPU, GiB (busiest rank): " + ", ".join(f"{k} {v:.1f}" for k, v in mem.items())
             + f" -> {'fits' if est.fits else 'does NOT fit'} in {est.capacity_gib:.1f}",
             "step time, ms (slowest rank): " + ", ".join(f"{k} {v:.1f}" for k, v in time.items() if v or k == "total"),
             f"throughput: {est.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {100 * est.mfu:.1f}%"]
    return "\n".join(lines + [f"note: {n}" for n in est.notes])


def table(ests) -> str:
    head = "| # | layout | tokens/s per GPU | MFU | peak GiB | step ms |"
    rows = [head, "|---|---|---|---|---|---|"]
    for i, e in enumerate(ests, 1):
        rows.append(f"| {i} | {e.describe()} | {e.tokens_per_s_per_gpu:,.0f} | {100 * e.mfu:.1f}% | "
                    f"{e.memory.total / 2**30:.1f} | {1e3 * e.time.total:.0f} |")
    return "\n".join(rows)


def as_json(est) -> dict:
    return {"layout": est.layout, "memory_gib": est.memory.gib(), "step_ms": est.time.ms(), "fits": est.fits,
            "tokens_per_s_per_gpu": est.tokens_per_s_per_gpu, "mfu": est.mfu, "notes": est.notes}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        from loom.plan.hardware import GPUS

        print(USAGE.format(kinds=", ".join(GPUS)))
        return 0
    opts, rest = parse_args(argv)
    if opts["json"]:
        check_file_writable("--json", opts["json"], "plan.json")  # before the plan is computed
    gpu = gpu_kind(opts["gpu"])
    cfg = build_config(opts["config"], parse_overrides(rest))
    from loom.plan.planner import estimate, search

    print(f"loom plan: {cfg.model.flavor}, seq {cfg.training.seq_len}, global batch {cfg.training.global_batch_size}, "
          f"{cfg.training.dtype}, compile {str(cfg.training.compile).lower()}, on {opts['gpus']} x {opts['gpu']}")
    print("assumed: " + assumptions(gpu, cfg.training.dtype))
    report: dict = {"gpus": opts["gpus"], "gpu": gpu.__dict__}
    try:
        est = estimate(cfg, opts["gpus"], gpu)
        print(breakdown(est))
        report["config"] = as_json(est)
    except ConfigError as err:
        if not opts["search"]:
            raise
        print(f"the configured layout is not valid on {opts['gpus']} GPUs ({err}); searching")
    if opts["search"]:
        best, valid = search(cfg, opts["gpus"], gpu, top=opts["top"])
        print(f"\n{valid} valid layouts, {len(best)} fastest that fit:" if best else
              f"\n{valid} valid layouts, none fits in {gpu.memory_gib:.1f} GiB per GPU")
        if best:
            print(table(best))
        report["search"] = {"valid": valid, "best": [as_json(e) for e in best]}
    if opts["json"]:
        write_json(opts["json"], report)
    return 0


def write_json(path: str, report: dict) -> None:
    """Written beside ``path`` and renamed into place: a failure leaves no half-written file."""
    tmp = f"{path}.loom-tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, path)
    except OSError as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ConfigError("--json", path, f"could not be written ({err.strerror or err})") from None
