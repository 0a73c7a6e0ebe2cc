"""``loom plan``: what a configuration needs on N GPUs of a kind, and which layout would run fastest,
computed on this machine (no GPU) before any is rented. Model: loom.plan; accuracy: docs/planner.md."""

from __future__ import annotations

import json
import os
import sys
import time

from loom.config import ConfigError, build_config, parse_overrides
from loom.config.errors import require
from loom.config.paths import check_file_writable

USAGE = """usage: loom plan [--config FILE.toml] [--gpus N] [--gpu KIND] [--search] [--top K] [--margin GIB | PCT%]
                 [--json FILE] [--plot FILE.png] [--section.field VALUE ...]

Estimates peak memory per GPU and step time of the configuration on N GPUs (default 1) of KIND
(default H100; known: {kinds}). With --search, ranks every layout loom accepts for the model and
global batch (tp, pp, cp, replicate x shard, pipeline schedule, micro-batch, activation checkpointing)
and prints the K fastest that fit (default 10), with its progress on stderr. A layout fits when its
peak leaves --margin free: GiB (--margin 2) or a share of the GPU's memory (default 5%).
--plot FILE.png draws memory per GPU by component and, with --search, the ranked layouts
(pip install 'loom-train[report]'). Nothing is trained, nothing needs a GPU."""

_OPTIONS = {"--gpus": "gpus", "--gpu": "gpu", "--top": "top", "--margin": "margin", "--json": "json",
            "--plot": "plot", "--config": "config", "-c": "config"}
# Files a plan writes (option -> a file name to suggest): each is checked writable before the plan is computed
# and written once it is (``write_outputs``).
OUTPUT_FILES = {"json": "plan.json", "plot": "plan.png"}


def parse_args(argv: list[str]) -> tuple[dict, list[str]]:
    """(planner options, --section.field overrides)."""
    opts = {"gpus": "1", "gpu": "H100", "top": "10", "margin": None, "config": None, "search": False,
            **{name: "" for name in OUTPUT_FILES}}
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
    if opts["margin"] is not None:
        opts["margin"] = parse_margin(opts["margin"])
    return opts, rest


def parse_margin(text: str) -> tuple[float, bool]:
    """--margin as (GiB, False) from '2' or (share of the GPU's memory, True) from '5%'."""
    share = text.strip().endswith("%")
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        value = -1.0
    if not 0 <= value < (100 if share else float("inf")):
        raise ConfigError("--margin", text, "expected GiB to leave free per GPU (e.g. 2) or a share of its memory "
                          "(e.g. 5%), at least 0 and under 100%")
    return (value / 100, True) if share else (value, False)


def margin_gib(margin: tuple[float, bool] | None, gpu) -> float:
    """The GiB a fitting layout leaves free on ``gpu``: --margin, else the planner's default share."""
    from loom.plan.planner import MARGIN

    value, share = margin if margin is not None else (MARGIN, True)
    gib = value * gpu.memory_gib if share else value
    if gib >= gpu.memory_gib:
        raise ConfigError("--margin", f"{value:g}", f"leaves nothing of the {gpu.name}'s {gpu.memory_gib:.1f} GiB")
    return gib


def limit_text(capacity_gib: float, margin: float) -> str:
    """'75.2 GiB (79.2 less a 4.0 GiB margin)': what a fitting layout may use, and why not all of it."""
    if not margin:
        return f"{capacity_gib:.1f} GiB"
    return f"{capacity_gib - margin:.1f} GiB ({capacity_gib:.1f} less a {margin:.1f} GiB margin)"


class SearchProgress:
    """``search``'s progress on stderr: on a terminal one line rewritten at most twice a second; otherwise (a log)
    a line per tenth of the candidates, eleven in all."""

    def __init__(self, stream=None, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.clock = clock
        self.started = clock()
        self.shown = -1.0  # the tenth (log) or the time (terminal) of the last line

    def __call__(self, done: int, total: int, valid: int) -> None:
        now = self.clock()
        mark = now if self.tty else float(10 * done // total)
        if done < total and (now - self.shown < 0.5 if self.tty else mark == self.shown):
            return
        self.shown = mark
        line = (f"loom plan: searched {done:,}/{total:,} layouts ({100 * done // total}%), {valid:,} valid, "
                f"{now - self.started:.0f} s")
        if self.tty:  # rewritten in place; the last one stays
            line = "\r" + line + ("\n" if done == total else "")
        else:
            line += "\n"
        self.stream.write(line)
        self.stream.flush()


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
             + f" -> {'fits' if est.fits else 'does NOT fit'} in {limit_text(est.capacity_gib, est.margin_gib)}",
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
            "limit_gib": est.limit_gib,
            "tokens_per_s_per_gpu": est.tokens_per_s_per_gpu, "mfu": est.mfu, "notes": est.notes}


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        from loom.plan.hardware import GPUS

        print(USAGE.format(kinds=", ".join(GPUS)))
        return 0
    opts, rest = parse_args(argv)
    for name, example in OUTPUT_FILES.items():
        if opts[name]:
            check_file_writable(f"--{name}", opts[name], example)  # before minutes of search
    if opts["plot"]:
        require("matplotlib", "report", purpose="loom plan --plot")
    gpu = gpu_kind(opts["gpu"])
    cfg = build_config(opts["config"], parse_overrides(rest))
    margin = margin_gib(opts["margin"], gpu)
    from loom.plan.planner import estimate, search

    print(f"loom plan: {cfg.model.flavor}, seq {cfg.training.seq_len}, global batch {cfg.training.global_batch_size}, "
          f"{cfg.training.dtype}, compile {str(cfg.training.compile).lower()}, on {opts['gpus']} x {opts['gpu']}")
    print("assumed: " + assumptions(gpu, cfg.training.dtype))
    report: dict = {"gpus": opts["gpus"], "gpu": gpu.__dict__, "margin_gib": margin}
    est, best = None, []
    try:
        est = estimate(cfg, opts["gpus"], gpu, margin_gib=margin)
        print(breakdown(est))
        report["config"] = as_json(est)
    except ConfigError as err:
        if not opts["search"]:
            raise
        print(f"the configured layout is not valid on {opts['gpus']} GPUs ({err}); searching")
    if opts["search"]:
        best, valid = search(cfg, opts["gpus"], gpu, top=opts["top"], margin_gib=margin, progress=SearchProgress())
        limit = limit_text(gpu.memory_gib, margin)
        print(f"\n{valid} valid layouts, {len(best)} fastest that fit in {limit} per GPU:" if best else
              f"\n{valid} valid layouts, none fits in {limit} per GPU")
        if best:
            print(table(best))
        report["search"] = {"valid": valid, "best": [as_json(e) for e in best]}
    write_outputs(opts, report)
    if opts["plot"]:
        from loom.plan.plot import plot_plan

        plot_plan(est, opts["plot"], ranked=best)
    return 0


def write_outputs(opts: dict, report: dict) -> None:
    """The files of ``OUTPUT_FILES`` that were asked for."""
    if opts["json"]:
        write_json(opts["json"], report)


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
