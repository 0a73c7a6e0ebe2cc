"""``loom report``: one PNG and one self-contained HTML page of one or more runs' metrics.jsonl
(content: loom.metrics.report; this file adds the arguments and each pipeline run's theoretical bubble)."""

from __future__ import annotations

import os
import tomllib
from types import SimpleNamespace

from loom.config.errors import ConfigError, UserError, require
from loom.config.paths import check_file_writable

USAGE = """usage: loom report RUN_DIR [RUN_DIR ...] [--out PREFIX] [--metrics a,b,c]

Plots loss and validation loss, learning rate, tokens/s, MFU, memory and gradient norm over steps from each
RUN_DIR/metrics.jsonl, the runs overlaid and labelled by their dirs; then each run's method's own panels
(training.objective in its config.toml: DPO and the reward model their accuracy and chosen / rejected rewards,
GRPO and PPO their reward and its parts, accuracy and KL to the reference); for pipeline runs also each stage's
measured idle fraction against the schedule's theoretical bubble. --metrics adds a panel per named field of
metrics.jsonl (any field logged as a number, e.g. --metrics reward_std,completion_length). Writes PREFIX.png and
PREFIX.html (the PNG inline and a table of the final figures; no external assets). Default PREFIX:
RUN_DIR/report of the first run. Needs matplotlib (pip install 'loom-train[report]')."""


def parse_args(argv: list[str]) -> tuple[list[str], str | None, tuple[str, ...]]:
    """(run dirs, --out prefix or None, --metrics fields)."""
    dirs, out, metrics, i = [], None, (), 0
    while i < len(argv):
        name, eq, val = argv[i].partition("=")
        if name in ("--out", "--metrics"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(name, None, "missing value after the option", show_value=False)
                val, i = argv[i + 1], i + 1
            if name == "--out":
                out = val
            else:
                metrics = tuple(dict.fromkeys(k.strip() for k in val.split(",") if k.strip()))
                if not metrics:
                    raise ConfigError("--metrics", val, "expected a comma list of metrics.jsonl fields")
        elif argv[i].startswith("-"):
            raise ConfigError(
                argv[i],
                None,
                "unknown option; allowed: --out PREFIX, --metrics a,b,c (see `loom report --help`)",
                show_value=False,
            )
        else:
            dirs.append(argv[i])
        i += 1
    if not dirs:
        raise UserError("loom report needs at least one run dir (see `loom report --help`)")
    return dirs, out, metrics


def method_panels(run_dir: str) -> tuple:
    """The panels of the run's method (its objective class's ``panels``), from training.objective in its
    config.toml; none where the config cannot say (a hand-made metrics.jsonl)."""
    from loom.methods import METHODS, method

    try:
        with open(os.path.join(run_dir, "config.toml"), "rb") as fh:
            name = tomllib.load(fh).get("training", {}).get("objective", "lm")
    except (OSError, tomllib.TOMLDecodeError):
        return ()
    return tuple(method(name).objective_class.panels) if name in METHODS else ()


def output_paths(dirs: list[str], out: str | None) -> tuple[str, str]:
    """PREFIX.png and PREFIX.html; a PREFIX ending in .png or .html loses that ending first; a folder (an existing
    one, or a PREFIX ending in a separator) gets report.png and report.html in it (``--out ./`` wrote ./.png)."""
    prefix = out if out else os.path.join(dirs[0], "report")
    if out and (out.endswith(("/", os.sep)) or os.path.isdir(out)):
        prefix = os.path.join(out, "report")
    root, ext = os.path.splitext(prefix)
    if ext.lower() in (".png", ".html", ".htm"):
        prefix = root
    return prefix + ".png", prefix + ".html"


def theoretical_bubble(run_dir: str, records: list[dict]) -> float | None:
    """The run's schedule's bubble (idle / total, forward 1, backward 2; loom.parallel.pipeline) from its
    config.toml, with the world size its records imply (tokens/s over tokens/s per device); None when the run
    has no pipeline or its config cannot say (an older or hand-edited config.toml)."""
    if not any(r.get("pp_idle") for r in records):
        return None
    from loom.config.sections import ParallelConfig
    from loom.parallel.dims import ParallelDims
    from loom.parallel.pipeline import stages_per_rank
    from loom.parallel.pipeline import theoretical_bubble as bubble
    from loom.resolve import accumulation_steps

    try:
        with open(os.path.join(run_dir, "config.toml"), "rb") as fh:
            conf = tomllib.load(fh)
        known = ParallelConfig.__dataclass_fields__
        parallel = ParallelConfig(**{k: v for k, v in conf["parallel"].items() if k in known})
        last = records[-1]
        world = round(last["tokens_per_s"] / last["tokens_per_s_per_device"])
        dims = ParallelDims.from_config(parallel, world)
        accum = accumulation_steps(SimpleNamespace(**conf["training"]), dims.dp_size)
        steps = int(conf["training"].get("steps", 1))  # pipedream_2bw fills and drains once per run
        return bubble(parallel.pp_schedule, parallel.pp, accum, stages_per_rank(parallel), steps)
    except (
        OSError,
        KeyError,
        TypeError,
        ValueError,
        ZeroDivisionError,
        tomllib.TOMLDecodeError,
        RuntimeError,
        ImportError,
        AttributeError,
    ) as err:
        print(f"loom report: {run_dir}: no theoretical bubble ({type(err).__name__}: {err})")
        return None


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    dirs, out, metrics = parse_args(argv)
    png_path, html_path = output_paths(dirs, out)
    for path in (png_path, html_path):
        check_file_writable("--out", path, "report.png")
    from loom.metrics.report import extra_panels, load_run, write_report

    runs = [load_run(d) for d in dirs]  # a missing metrics.jsonl stops before any plotting
    extra = extra_panels(
        runs, tuple(p for d in dirs for p in method_panels(d)), metrics
    )  # an unknown field too
    require("matplotlib", "report", purpose="loom report")
    for d, run in zip(dirs, runs):
        run.bubble = theoretical_bubble(d, run.records)
    write_report(runs, png_path, html_path, extra)
    print(f"loom report: {png_path} and {html_path} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0
