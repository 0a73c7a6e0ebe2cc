"""``loom report``: one PNG and one self-contained HTML page of one or more runs' metrics.jsonl
(content: loom.metrics.report; this file adds the arguments and each pipeline run's theoretical bubble)."""

from __future__ import annotations

import os
import tomllib
from types import SimpleNamespace

from loom.config.errors import ConfigError, UserError, require
from loom.config.paths import check_file_writable

USAGE = """usage: loom report RUN_DIR [RUN_DIR ...] [--out PREFIX]

Plots loss and validation loss, learning rate, tokens/s, MFU, memory and gradient norm over steps from each
RUN_DIR/metrics.jsonl, the runs overlaid and labelled by their dirs; for pipeline runs also each stage's
measured idle fraction against the schedule's theoretical bubble. Writes PREFIX.png and PREFIX.html (the PNG
inline and a table of the final figures; no external assets). Default PREFIX: RUN_DIR/report of the first run.
Needs matplotlib (pip install 'loom-train[report]')."""


def parse_args(argv: list[str]) -> tuple[list[str], str | None]:
    """(run dirs, --out prefix or None)."""
    dirs, out, i = [], None, 0
    while i < len(argv):
        name, eq, val = argv[i].partition("=")
        if name == "--out":
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError("--out", None, "missing value after the option", show_value=False)
                val, i = argv[i + 1], i + 1
            out = val
        elif argv[i].startswith("-"):
            raise ConfigError(argv[i], None, "unknown option; allowed: --out PREFIX (see `loom report --help`)",
                              show_value=False)
        else:
            dirs.append(argv[i])
        i += 1
    if not dirs:
        raise UserError("loom report needs at least one run dir (see `loom report --help`)")
    return dirs, out


def output_paths(dirs: list[str], out: str | None) -> tuple[str, str]:
    """PREFIX.png and PREFIX.html; a PREFIX ending in .png or .html loses that ending first."""
    prefix = out if out else os.path.join(dirs[0], "report")
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
    from loom.parallel.pipeline import stages_per_rank, theoretical_bubble as bubble
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
        return bubble(parallel.pp_schedule, parallel.pp, accum, stages_per_rank(parallel))
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError, tomllib.TOMLDecodeError, RuntimeError,
            ImportError, AttributeError) as err:
        print(f"loom report: {run_dir}: no theoretical bubble ({type(err).__name__}: {err})")
        return None


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    dirs, out = parse_args(argv)
    png_path, html_path = output_paths(dirs, out)
    for path in (png_path, html_path):
        check_file_writable("--out", path, "report.png")
    from loom.metrics.report import load_run, write_report

    runs = [load_run(d) for d in dirs]  # a missing metrics.jsonl stops before any plotting
    require("matplotlib", "report", purpose="loom report")
    for d, run in zip(dirs, runs):
        run.bubble = theoretical_bubble(d, run.records)
    write_report(runs, png_path, html_path)
    print(f"loom report: {png_path} and {html_path} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0
