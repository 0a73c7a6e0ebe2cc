"""``loom plan``: what a configuration needs on N GPUs of a kind, and which layout would run fastest,
computed on this machine (no GPU) before any is rented. Model: loom.plan; accuracy: docs/planner.md."""

from __future__ import annotations

import json
import os
import sys
import time

from loom.config import ConfigError, build_config, parse_overrides
from loom.config.errors import require
from loom.config.load import read_toml
from loom.config.paths import check_file_writable

USAGE = """usage: loom plan [--config FILE.toml] [--gpus N] [--gpu KIND] [--search] [--top K] [--margin GIB | PCT%]
                 [--roofline [--metrics FILE.jsonl]] [--json FILE] [--plot FILE.png] [--section.field VALUE ...]
       loom plan --generate --prompt-len P --output-len N [--batch B] [--dtype DTYPE] [--kv-dtype DTYPE]
                 [--config FILE.toml] [--gpus N] [--gpu KIND] [--margin GIB | PCT%] [--json FILE]
                 [--section.field VALUE ...]
       loom plan (--flops C | --params N | --tokens D) [--noise-scale B] [--gpus N --gpu KIND [--search]]
                 [--config FILE.toml] [--json FILE] [--section.field VALUE ...]

Estimates peak memory per GPU and step time of the configuration on N GPUs (default 1) of KIND
(default H100; known: {kinds}). With --search, ranks every layout loom accepts for the model and
global batch (tp, pp, cp, replicate x shard, pipeline schedule, micro-batch, activation checkpointing)
and prints the K fastest that fit (default 10), with its progress on stderr. A layout fits when its
peak leaves --margin free: GiB (--margin 2) or a share of the GPU's memory (default 5%).
--plot FILE.png draws memory per GPU by component and, with --search, the ranked layouts
(pip install 'loom-train[report]'). Nothing is trained, nothing needs a GPU.
--roofline adds, for the configured layout, every op of the step on its busiest rank (each matmul, attention,
the norms, the SwiGLU gate, cross-entropy, AdamW, each collective): FLOPs, HBM bytes, communicated bytes,
arithmetic and communication intensity, the bound (compute, HBM, network) and the ceiling on KIND
(docs/planner.md, "Roofline"; MoE blocks: the router, experts and ep all-to-alls); with --plot, a roofline
panel too. --metrics FILE.jsonl (a run's metrics.jsonl, of this config on --gpus) adds the step's measured
point: its median step time, the FLOP/s the busiest rank reached and the share of the no-overlap bound.

With --generate, plans sampling B sequences (default 1) of P prompt and N output tokens with a KV cache,
tensor-parallel over the --gpus: memory per GPU (weights, KV cache, prefill activations), time to first
token, decode time per step at the first and last output token and on average (HBM roofline), decode
tokens/s and the tensor-parallel all-reduce time. --dtype: the weights (default bfloat16; float16,
float32; bf16 / fp16 / fp32 too), --kv-dtype: the cache (default: --dtype); --training.compile true
times the prefill at the compiled efficiency. Model: docs/planner.md, "Generation".

With --flops, --params or --tokens (one of them; 5.76e23, 70B, 1.4T), the compute-optimal size (Chinchilla:
C = 6 N D FLOPs with D = 20 N tokens): parameters, tokens, FLOPs and loom's nearest flavor; with --gpus or --gpu
also the GPU-hours to train that flavor on those tokens at the planner's throughput for the configured layout
(--search: the fastest layout that fits). --noise-scale B (tokens: a run's logged noise_scale, metrics.noise_scale)
adds a recommended training.global_batch_size of about B tokens. docs/algorithms.md."""

_OPTIONS = {
    "--gpus": "gpus",
    "--gpu": "gpu",
    "--top": "top",
    "--margin": "margin",
    "--json": "json",
    "--plot": "plot",
    "--config": "config",
    "-c": "config",
    "--batch": "batch",
    "--prompt-len": "prompt_len",
    "--output-len": "output_len",
    "--dtype": "dtype",
    "--kv-dtype": "kv_dtype",
    "--flops": "flops",
    "--params": "params",
    "--tokens": "tokens",
    "--noise-scale": "noise_scale",
    "--metrics": "metrics",
}
BUDGET = ("flops", "params", "tokens")  # compute-optimal sizing (loom.plan.compute_optimal)
# --generate's own options (given without it, an error) and the training plan's (given with it, an error)
GENERATE_ONLY = ("batch", "prompt_len", "output_len", "dtype", "kv_dtype")
TRAINING_ONLY = ("search", "top", "plot", "roofline", "metrics")
DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
}
# Files a plan writes (option -> a file name to suggest): each is checked writable before the plan is computed
# and written once it is (``write_outputs``).
OUTPUT_FILES = {"json": "plan.json", "plot": "plan.png"}


def parse_args(argv: list[str]) -> tuple[dict, list[str]]:
    """(planner options, --section.field overrides)."""
    opts = {
        "gpus": "1",
        "gpu": "H100",
        "top": None,
        "margin": None,
        "config": None,
        "search": False,
        "generate": False,
        "roofline": False,
        **{name: None for name in GENERATE_ONLY + BUDGET},
        "noise_scale": None,
        "metrics": None,
        **{name: "" for name in OUTPUT_FILES},
    }
    opts["cluster"] = any(a.partition("=")[0] in ("--gpus", "--gpu") for a in argv)  # GPU-hours asked for
    rest, i = [], 0
    while i < len(argv):
        name, eq, val = argv[i].partition("=")
        if name in ("--search", "--generate", "--roofline"):
            opts[name[2:]] = True
        elif name in _OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(name, None, "missing value after the option", show_value=False)
                val, i = argv[i + 1], i + 1
            opts[_OPTIONS[name]] = val
        else:
            rest.append(argv[i])
        i += 1
    check_mode(opts)
    defaults = {"top": "10", "batch": "1"} if not opts["generate"] else {"batch": "1"}
    for key, default in defaults.items():
        opts[key] = default if opts[key] is None else opts[key]
    for key in ("gpus", "top", "batch", "prompt_len", "output_len"):
        if opts.get(key) is not None:
            opts[key] = positive_int(f"--{key.replace('_', '-')}", opts[key])
    if opts["margin"] is not None:
        opts["margin"] = parse_margin(opts["margin"])
    if opts["generate"]:
        opts["dtype"] = dtype_name("--dtype", opts["dtype"] or "bfloat16")
        opts["kv_dtype"] = dtype_name("--kv-dtype", opts["kv_dtype"] or opts["dtype"])
    return opts, rest


def check_mode(opts: dict) -> None:
    """--generate's options only with it, the training plan's only without it; --generate needs both lengths."""

    def flag(key: str) -> str:
        return f"--{key.replace('_', '-')}"

    if opts["noise_scale"] is not None and all(opts[key] is None for key in BUDGET):
        raise ConfigError("--noise-scale", opts["noise_scale"], "only with --flops, --params or --tokens")
    if opts["generate"] and any(opts[key] is not None for key in BUDGET):
        raise ConfigError("--generate", None, "not with --flops / --params / --tokens", show_value=False)
    if opts["metrics"] is not None and not opts["roofline"]:
        raise ConfigError(
            "--metrics", opts["metrics"], "only with --roofline (it places the run's step on it)"
        )
    if opts["roofline"] and any(opts[key] is not None for key in BUDGET):
        raise ConfigError(
            "--roofline",
            None,
            "not with --flops / --params / --tokens (it places the configured layout's ops)",
            show_value=False,
        )
    if opts["generate"]:
        for key in TRAINING_ONLY:
            if opts[key] not in (None, False, ""):
                raise ConfigError(
                    flag(key),
                    None,
                    "not with --generate (a generation plan has one layout: tensor parallel over --gpus)",
                    show_value=False,
                )
        for key in ("prompt_len", "output_len"):
            if opts[key] is None:
                raise ConfigError(
                    flag(key),
                    None,
                    "required with --generate (a number of tokens per sequence)",
                    show_value=False,
                )
    else:
        for key in GENERATE_ONLY:
            if opts[key] is not None:
                raise ConfigError(flag(key), opts[key], "only with --generate")


def positive_int(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(flag, text, "expected a positive integer") from None
    if value < 1:
        raise ConfigError(flag, value, "expected a positive integer")
    return value


def dtype_name(flag: str, text: str) -> str:
    """A dtype's loom name (loom.numerics.DTYPES) from it or its short form."""
    try:
        return DTYPE_NAMES[text.strip().lower()]
    except KeyError:
        raise ConfigError(
            flag, text, "allowed: bfloat16 | float16 | float32 (or bf16 | fp16 | fp32)"
        ) from None


def parse_margin(text: str) -> tuple[float, bool]:
    """--margin as (GiB, False) from '2' or (share of the GPU's memory, True) from '5%'."""
    share = text.strip().endswith("%")
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        value = -1.0
    if not 0 <= value < (100 if share else float("inf")):
        raise ConfigError(
            "--margin",
            text,
            "expected GiB to leave free per GPU (e.g. 2) or a share of its memory "
            "(e.g. 5%), at least 0 and under 100%",
        )
    return (value / 100, True) if share else (value, False)


def margin_gib(margin: tuple[float, bool] | None, gpu) -> float:
    """The GiB a fitting layout leaves free on ``gpu``: --margin, else the planner's default share."""
    from loom.plan.planner import MARGIN

    value, share = margin if margin is not None else (MARGIN, True)
    gib = value * gpu.memory_gib if share else value
    if gib >= gpu.memory_gib:
        raise ConfigError(
            "--margin", f"{value:g}", f"leaves nothing of the {gpu.name}'s {gpu.memory_gib:.1f} GiB"
        )
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
        line = (
            f"loom plan: searched {done:,}/{total:,} layouts ({100 * done // total}%), {valid:,} valid, "
            f"{now - self.started:.0f} s"
        )
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
    return (
        f"{gpu.name}: {gpu.memory_gib:.1f} GiB, {gpu.peak(dtype) / 1e12:.0f} TFLOP/s {dtype}, HBM "
        f"{gpu.hbm_tbps} TB/s, NVLink {gpu.link_gbps:.0f} GB/s bus, network {gpu.network_gbps:.0f} GB/s per GPU, "
        f"{gpu.gpus_per_node} GPUs per node"
    )


def breakdown(est) -> str:
    mem = est.memory.gib()
    time = est.time.ms()
    lines = [
        f"layout: {est.describe()} (accumulation {est.layout['accumulation']})",
        f"parameters: {est.params:,.0f} in the model, {est.rank_params:,.0f} on the busiest rank before "
        "data-parallel sharding",
        "memory per GPU, GiB (busiest rank): "
        + ", ".join(f"{k} {v:.1f}" for k, v in mem.items() if v or k != "kv_cache")
        + f" -> {'fits' if est.fits else 'does NOT fit'} in {limit_text(est.capacity_gib, est.margin_gib)}",
        "step time, ms (slowest rank): "
        + ", ".join(f"{k} {v:.1f}" for k, v in time.items() if v or k == "total"),
        f"throughput: {est.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {100 * est.mfu:.1f}%",
    ]
    return "\n".join(lines + [f"note: {n}" for n in est.notes])


def table(ests) -> str:
    head = "| # | layout | tokens/s per GPU | MFU | peak GiB | step ms |"
    rows = [head, "|---|---|---|---|---|---|"]
    for i, e in enumerate(ests, 1):
        rows.append(
            f"| {i} | {e.describe()} | {e.tokens_per_s_per_gpu:,.0f} | {100 * e.mfu:.1f}% | "
            f"{e.memory.total / 2**30:.1f} | {1e3 * e.time.total:.0f} |"
        )
    return "\n".join(rows)


def as_json(est) -> dict:
    return {
        "layout": est.layout,
        "memory_gib": est.memory.gib(),
        "params": est.params,
        "rank_params": est.rank_params,
        "step_ms": est.time.ms(),
        "fits": est.fits,
        "limit_gib": est.limit_gib,
        "tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
        "mfu": est.mfu,
        "notes": est.notes,
    }


def lora_note(cfg, modes: list[str]) -> str | None:
    """The estimate and the search model LoRA (a frozen base, trained adapters); of the other ``modes`` asked for
    (--roofline, a compute budget) none does: said in one line, not left silent."""
    if not cfg.lora.rank or not modes:
        return None
    return (
        f"loom plan: lora.rank {cfg.lora.rank} is not modelled by {' or '.join(modes)}: those figures are full "
        "fine-tuning's (every weight with gradients and optimizer state), an upper bound for the LoRA run"
    )


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
    overrides = parse_overrides(rest)
    cfg = build_config(opts["config"], overrides)
    unmodelled = ["--roofline"] * bool(opts["roofline"]) + [
        "the compute budget" for key in BUDGET if opts[key] is not None
    ][:1]
    if lora_note(cfg, unmodelled):
        print(lora_note(cfg, unmodelled), file=sys.stderr, flush=True)
    if "training.global_batch_size" not in {
        **(read_toml(opts["config"]) if opts["config"] else {}),
        **overrides,
    }:
        fit_default_global_batch(cfg, opts["gpus"])
    margin = margin_gib(opts["margin"], gpu)
    if opts["generate"]:
        return main_generate(opts, cfg, gpu, margin)
    if any(opts[key] is not None for key in BUDGET):
        return main_compute_optimal(opts, cfg, gpu, margin)
    from loom.plan.planner import estimate, search

    print(
        f"loom plan: {cfg.model.flavor}, seq {cfg.training.seq_len}, global batch {cfg.training.global_batch_size}, "
        f"{cfg.training.dtype}, compile {str(cfg.training.compile).lower()}, on {opts['gpus']} x {opts['gpu']}"
    )
    print("assumed: " + assumptions(gpu, cfg.training.dtype))
    report: dict = {"gpus": opts["gpus"], "gpu": gpu.__dict__, "margin_gib": margin}
    est, best, roof = None, [], None
    try:
        est = estimate(cfg, opts["gpus"], gpu, margin_gib=margin)
        print(breakdown(est))
        report["config"] = as_json(est)
        if opts["roofline"]:
            report["roofline"], roof = print_roofline(cfg, opts["gpus"], gpu, opts["metrics"])
    except ConfigError as err:
        if not opts["search"]:
            raise
        print(f"the configured layout is not valid on {opts['gpus']} GPUs ({err}); searching")
    if opts["search"]:
        best, valid = search(
            cfg, opts["gpus"], gpu, top=opts["top"], margin_gib=margin, progress=SearchProgress()
        )
        limit = limit_text(gpu.memory_gib, margin)
        print(
            f"\n{valid} valid layouts, {len(best)} fastest that fit in {limit} per GPU:"
            if best
            else f"\n{valid} valid layouts, none fits in {limit} per GPU"
        )
        if best:
            print(table(best))
        report["search"] = {"valid": valid, "best": [as_json(e) for e in best]}
    write_outputs(opts, report)
    if opts["plot"]:
        from loom.plan.plot import plot_plan

        plot_plan(est, opts["plot"], ranked=best, roofline=roof)
    return 0


def fit_default_global_batch(cfg, gpus: int) -> None:
    """The default training.global_batch_size (16 sequences: the debug run's) rounded up to a multiple of
    micro_batch_size x the layout's data-parallel size on ``gpus`` GPUs, said in one line: a plan of a big layout
    then runs without the user first working out a valid batch. A global batch the user set is never changed."""
    from loom.parallel.dims import ParallelDims
    from loom.runtime.fault_tolerance import replica_groups

    try:
        dp = ParallelDims.from_config(cfg.parallel, gpus).dp_size * replica_groups(cfg.parallel)
    except ConfigError:  # an invalid layout is reported by the estimate, naming its field
        return
    t = cfg.training
    unit = t.micro_batch_size * dp
    if t.global_batch_size % unit:
        planned = -(-t.global_batch_size // unit) * unit
        print(
            f"loom plan: the default training.global_batch_size {t.global_batch_size} is not a multiple of "
            f"micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp} on {gpus} GPUs: planned with "
            f"{planned} (set --training.global_batch_size to choose)"
        )
        t.global_batch_size = planned


def print_roofline(cfg, gpus: int, gpu, metrics: str | None = None) -> tuple[dict, tuple]:
    """``--roofline``: the configured layout's ops on the roofline, printed, and with ``metrics`` (--metrics) the
    run's measured step; returns them for --json, and (ops, gpu, dtype, measured or None) for --plot."""
    from loom.plan.roofline import measured_step, roofline, table

    ops, what = roofline(cfg, gpus, gpu)
    dtype = cfg.training.dtype
    print(
        f"\nroofline of one step on the busiest rank ({what['blocks']} blocks x {what['micro_batches']} "
        f"micro-batches of {what['tokens_per_micro_batch']:,.0f} tokens); machine balance "
        f"{what['machine_balance']:.0f} FLOP/B ({gpu.peak(dtype) / 1e12:.0f} TFLOP/s {dtype} / {gpu.hbm_tbps} TB/s):"
    )
    print(table(ops, gpu, dtype))
    if cfg.training.float8 != "none":
        print(
            f"training.float8 {cfg.training.float8}: the block linears' matmuls run on float8 tensor cores (twice "
            f"{dtype}'s peak, and their casts on top: the step time models both); this table draws them at {dtype}'s"
        )
    rows = [
        {
            "op": op.name,
            "calls": op.count,
            "flops": op.flops,
            "hbm_bytes": op.hbm_bytes,
            "comm_bytes": op.comm_bytes,
            "comm_gbps": op.comm_gbps,
            "intensity": None if op.intensity == float("inf") else op.intensity,
            "comm_intensity": None if op.comm_intensity == float("inf") else op.comm_intensity,
            "bound": op.bound(gpu, dtype),
            "ceiling_flops": op.ceiling(gpu, dtype),
            "seconds_at_roof": op.seconds(gpu, dtype),
        }
        for op in ops
    ]
    measured = None
    if metrics:
        t = cfg.training
        measured = measured_step(metrics, ops, t.global_batch_size * t.seq_len, gpu, dtype)
        mfu = f", MFU {measured['mfu']:.1%}" if measured["mfu"] is not None else ""
        print(
            f"measured ({metrics}: median of {measured['records']} logged steps{mfu}): step "
            f"{measured['step_s'] * 1e3:.1f} ms, {measured['flops_per_s'] / 1e12:.1f} TFLOP/s on the busiest rank "
            f"at {measured['intensity']:.0f} FLOP/B; the roofline's no-overlap bound "
            f"{measured['roofline_bound_s'] * 1e3:.1f} ms is {measured['of_bound']:.0%} of it"
        )
    return {**what, "ops": rows, **({"measured": measured} if measured else {})}, (ops, gpu, dtype, measured)


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


# -------------------------------------------------------------------------------- --flops / --params / --tokens
def main_compute_optimal(opts: dict, cfg, gpu, margin: float) -> int:
    """Chinchilla's compute-optimal budget, loom's nearest flavor and, on a cluster, the GPU-hours."""
    import copy

    from loom.plan.compute_optimal import (
        compute_optimal,
        dense_flavors,
        gpu_hours,
        nearest_flavor,
        parse_count,
        recommended_batch,
        si,
    )
    from loom.plan.planner import estimate, model_args, search

    given = {k: parse_count(f"--{k}", opts[k]) for k in BUDGET if opts[k] is not None}
    budget = compute_optimal(**given)
    flavor, n = nearest_flavor(budget.params, dense_flavors(model_args(cfg).vocab_size))
    print(
        f"loom plan: compute-optimal for {', '.join(f'--{k} {v:.3g}' for k, v in given.items())} (Chinchilla: "
        f"C = 6 N D, D = 20 N)"
    )
    print(f"parameters {si(budget.params)}, tokens {si(budget.tokens)}, FLOPs {budget.flops:.3g}")
    print(
        f"nearest flavor: {flavor} ({si(n)} parameters; on {si(budget.tokens)} tokens: "
        f"{6 * n * budget.tokens:.3g} FLOPs)"
    )
    report: dict = {"compute_optimal": {**budget.__dict__, "flavor": flavor, "flavor_params": n}}
    if opts["noise_scale"] is not None:
        noise = parse_count("--noise-scale", opts["noise_scale"])
        batch = recommended_batch(noise, cfg.training.seq_len)
        print(
            f"global batch: about {noise:,.0f} tokens = {batch} sequences of {cfg.training.seq_len} (the measured "
            "noise scale estimates the critical batch: beyond it, more tokens per step save few steps)"
        )
        report["compute_optimal"].update(noise_scale=noise, recommended_global_batch_size=batch)
    if opts["cluster"]:
        fcfg = copy.deepcopy(cfg)
        fcfg.model.flavor = flavor
        if opts["search"]:
            best, _ = search(fcfg, opts["gpus"], gpu, top=1, margin_gib=margin, progress=SearchProgress())
            if not best:
                raise ConfigError(
                    "--search",
                    None,
                    f"no layout of {flavor} fits on {opts['gpus']} x {gpu.name}",
                    show_value=False,
                )
            est = best[0]
        else:
            est = estimate(fcfg, opts["gpus"], gpu, margin_gib=margin)
        hours = gpu_hours(budget.tokens, est.tokens_per_s_per_gpu)
        print(
            f"on {opts['gpus']} x {gpu.name}, {est.describe()}, seq {cfg.training.seq_len}, global batch "
            f"{cfg.training.global_batch_size}: {est.tokens_per_s_per_gpu:,.0f} tokens/s per GPU (MFU "
            f"{100 * est.mfu:.1f}%) -> {hours:,.0f} GPU-hours ({hours / opts['gpus'] / 24:,.1f} days)"
            + (
                ""
                if est.fits
                else f"; this layout does NOT fit in {limit_text(est.capacity_gib, est.margin_gib)} "
                "(--search finds one that does)"
            )
        )
        report["compute_optimal"].update(
            gpus=opts["gpus"],
            gpu=gpu.name,
            layout=est.layout,
            fits=est.fits,
            tokens_per_s_per_gpu=est.tokens_per_s_per_gpu,
            gpu_hours=hours,
        )
    write_outputs(opts, report)
    return 0


# ------------------------------------------------------------------------------------------------- --generate
def main_generate(opts: dict, cfg, gpu, margin: float) -> int:
    from loom.plan.generate import generation_args, plan_generation

    tp, batch, prompt, output = opts["gpus"], opts["batch"], opts["prompt_len"], opts["output_len"]
    args = generation_args(cfg, tp, opts["dtype"], prompt + output)
    plan = plan_generation(
        args,
        batch,
        prompt,
        output,
        gpu,
        tp,
        opts["dtype"],
        opts["kv_dtype"],
        compiled=cfg.training.compile,
        margin_gib=margin,
    )
    print(
        f"loom plan --generate: {cfg.model.init_from or cfg.model.flavor}, batch {batch}, prompt {prompt:,} + "
        f"output {output:,} tokens, {plan.dtype} weights, {plan.kv_dtype} KV cache, on {tp} x {opts['gpu']}"
        + (f" (tensor parallel {tp})" if tp > 1 else "")
    )
    print("assumed: " + assumptions(gpu, plan.dtype) + generate_assumptions(args, gpu, tp))
    print(generation_text(plan, args))
    write_outputs(
        opts, {"gpus": tp, "gpu": gpu.__dict__, "margin_gib": margin, "generate": generation_json(plan)}
    )
    return 0


def generate_assumptions(args, gpu, tp: int) -> str:
    from loom.plan.timing import COLLECTIVE_LATENCY_S, DECODE_HBM_SHARE, DECODE_HBM_SHARE_BATCHED, efficiency

    text = (
        f"; decode reads at {100 * DECODE_HBM_SHARE:.0f}% of HBM bandwidth at batch 1, "
        f"{100 * DECODE_HBM_SHARE_BATCHED:.0f}% above, and computes at "
        f"{100 * efficiency(args.dim, compiled=True):.0f}% of peak"
    )
    if tp > 1:
        text += f"; each tensor-parallel collective {1e6 * COLLECTIVE_LATENCY_S:.0f} us + its bytes"
    return text


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}" if unit == "GiB" else f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def generation_text(plan, args) -> str:
    mem, pre, first, last = plan.memory.gib(), plan.prefill, plan.first, plan.last
    fit = "fits" if plan.fits else "does NOT fit"
    tokens = plan.prompt_len + plan.output_len
    lines = [
        "memory per GPU, GiB: "
        + ", ".join(f"{k} {v:.2f}" for k, v in mem.items())
        + f" -> {fit} in {limit_text(plan.capacity_gib, plan.margin_gib)}; the largest batch that fits "
        f"{tokens:,} positions: {plan.max_batch:,}",
        f"KV cache ({plan.attention}): {_size(plan.kv_bytes_per_token)} per token of a sequence"
        + (
            f" ({_size(plan.kv_bytes_per_token / plan.tp)} per GPU)"
            if plan.tp > 1 and plan.attention == "gqa"
            else ""
        )
        + f", {_size(plan.memory.kv_cache)} per GPU for {plan.batch} x {tokens:,} positions",
        f"time to first token: {1e3 * pre.seconds:.1f} ms (prefill of {plan.batch} x {plan.prompt_len:,} tokens, "
        f"{pre.flops / 1e12:.2f} TFLOP per GPU, {pre.bound}-bound"
        + (f"; tensor-parallel all-reduces {1e3 * pre.tp_s:.2f} ms" if plan.tp > 1 else "")
        + ")",
        f"decode, ms per step (a token for each sequence): first {1e3 * first.seconds:.2f}, last "
        f"{1e3 * last.seconds:.2f}, mean {1e3 * plan.mean_step_s:.2f} ({first.bound}-bound at the first; "
        f"{first.bytes / 1e9:.2f} GB read per GPU at the first step, {last.bytes / 1e9:.2f} at the last)",
        f"HBM roofline (the datasheet's bandwidth): {1e3 * first.roofline_s:.2f} ms at the first step, "
        f"{plan.batch / first.roofline_s:,.0f} tokens/s",
        f"decode: {plan.decode_tokens_per_s:,.0f} tokens/s at batch {plan.batch} "
        f"({plan.decode_tokens_per_s / plan.batch:,.1f} per sequence)",
    ]
    if plan.tp > 1:
        lines.append(
            f"tensor-parallel collectives per decode step: {1e3 * first.tp_s:.3f} ms "
            f"({2 * args.n_layers + 1} all-reduces and the logits' all-gather)"
        )
    if plan.steps == 0:
        lines.append(
            "no decode step: the prefill gives the only output token (the step figures are the next one's)"
        )
    took = f"{plan.total_s:.2f} s" if plan.total_s >= 1 else f"{1e3 * plan.total_s:.1f} ms"
    lines.append(
        f"the whole request: {took} for {plan.batch * plan.output_len:,} output tokens "
        f"({plan.batch * plan.output_len / plan.total_s:,.0f} tokens/s)"
    )
    return "\n".join(lines + [f"note: {n}" for n in plan.notes])


def generation_json(plan) -> dict:
    def step(s) -> dict:
        return {
            "context": s.context,
            "ms": 1e3 * s.seconds,
            "bound": s.bound,
            "weight_bytes": s.weight_bytes,
            "kv_bytes": s.kv_bytes,
            "flops": s.flops,
            "memory_ms": 1e3 * s.memory_s,
            "compute_ms": 1e3 * s.compute_s,
            "tp_ms": 1e3 * s.tp_s,
            "roofline_ms": 1e3 * s.roofline_s,
        }

    return {
        "batch": plan.batch,
        "prompt_len": plan.prompt_len,
        "output_len": plan.output_len,
        "tp": plan.tp,
        "dtype": plan.dtype,
        "kv_dtype": plan.kv_dtype,
        "attention": plan.attention,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "memory_gib": plan.memory.gib(),
        "fits": plan.fits,
        "limit_gib": plan.limit_gib,
        "max_batch": plan.max_batch,
        "prefill": {
            "ms": 1e3 * plan.prefill.seconds,
            "bound": plan.prefill.bound,
            "flops": plan.prefill.flops,
            "compute_ms": 1e3 * plan.prefill.compute_s,
            "memory_ms": 1e3 * plan.prefill.memory_s,
            "tp_ms": 1e3 * plan.prefill.tp_s,
        },
        "decode_first": step(plan.first),
        "decode_last": step(plan.last),
        "decode_mean_ms": 1e3 * plan.mean_step_s,
        "decode_tokens_per_s": plan.decode_tokens_per_s,
        "total_s": plan.total_s,
        "notes": plan.notes,
    }
