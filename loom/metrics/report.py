"""``loom report``'s content: the series of one or more runs' metrics.jsonl (plain functions, no plotting), and
a PNG of them (matplotlib, Agg) with a self-contained HTML page around it (the PNG inline, a table of the final
figures). Anything that needs another layer (the theoretical pipeline bubble) is passed in by the caller."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field

from loom.config.errors import UserError, require

# (title, the record fields drawn in it, y axis label); a field's first panel is where it is drawn. A field ending in
# "/*" stands for every recorded field under that prefix ("_std" spreads left out). Every run gets these; a method's
# own panels (its objective's ``panels``, e.g. GRPO's reward, accuracy and KL) and `--metrics a,b,c` come after.
Panel = tuple[str, tuple[str, ...], str]
PANELS = (
    ("loss", ("loss", "val_loss"), "cross-entropy"),
    ("learning rate", ("lr",), "lr"),
    ("throughput", ("tokens_per_s",), "tokens/s, all devices"),
    ("MFU", ("mfu",), "share of the device's peak"),
    ("memory", ("mem_gib", "mem_gib_max_rank"), "peak GiB"),
    ("gradient norm", ("grad_norm",), "L2 norm before clipping"),
)
SERIES = tuple(key for _, keys, _ in PANELS for key in keys)
STYLE = {"val_loss": dict(linestyle="--", marker="o", markersize=3), "mem_gib_max_rank": dict(linestyle=":")}
IDLE = "pp_idle"
MARKERS = "os^vD<>p*h"  # one per pp rank


@dataclass
class RunSeries:
    """One run's plotted data: ``series[field] = (steps, values)`` with the steps where the field is a number,
    ``idle[rank] = (steps, idle fractions)`` for pipeline runs, the theoretical bubble when known."""

    label: str
    path: str
    records: list[dict]
    series: dict[str, tuple[list[int], list[float]]]
    idle: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    bubble: float | None = None


def metrics_path(run_dir: str) -> str:
    return os.path.join(run_dir, "metrics.jsonl")


def read_records(path: str) -> list[dict]:
    """The records of a metrics.jsonl in file order; a line that is not a record (cut short by a kill, edited by
    hand) is skipped, all of them counted in one warning. A missing file (or one without records) is the user's
    one-line error naming it."""
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file (the run dir of a `loom train` run has one)") from None
    except OSError as err:
        raise UserError(f"{path}: cannot be read ({err.strerror or err})") from None
    records, malformed = [], []
    for number, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            records.append(rec)
        elif line.strip():
            malformed.append(number)
    if not records:
        raise UserError(f"{path}: no records yet (the first is written at step metrics.every)")
    if malformed:  # one warning with the count: a hand-edited or damaged file is not read as whole
        shown = ", ".join(map(str, malformed[:5])) + (", ..." if len(malformed) > 5 else "")
        print(
            f"warning: {path}: {len(malformed):,} line{'s' if len(malformed) > 1 else ''} not a metrics record "
            f"(line {shown}), skipped",
            file=sys.stderr,
        )
    return records


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records where it is a finite number (null, absent and non-finite are
    gaps: validation loss on its steps only, MFU not at all on a device without a peak)."""
    points = [(r["step"], float(r[key])) for r in records if _number(r.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def idle_series(records: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    """Per pp rank, (steps, measured idle fraction) from the records' ``pp_idle`` lists ({} without pipeline)."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for r in records:
        for rank, v in enumerate(r.get(IDLE) or []):
            if _number(v):
                steps, values = out.setdefault(rank, ([], []))
                steps.append(r["step"])
                values.append(float(v))
    return out


def recorded_keys(records: list[dict]) -> list[str]:
    """Every field that is a number in some record, in first-seen order (what `--metrics` may name)."""
    return list(dict.fromkeys(k for r in records for k, v in r.items() if k != "step" and _number(v)))


def load_run(run_dir: str, label: str | None = None, bubble: float | None = None) -> RunSeries:
    """A run dir's series (of the common panels' fields and every other field recorded as a number), labelled by
    the dir as given unless ``label`` is."""
    path = metrics_path(run_dir)
    records = read_records(path)
    keys = dict.fromkeys([*SERIES, *recorded_keys(records)])
    return RunSeries(
        label or os.path.normpath(run_dir),
        path,
        records,
        {k: series(records, k) for k in keys},
        idle_series(records),
        bubble,
    )


def panel_keys(keys: tuple[str, ...], run: RunSeries) -> list[str]:
    """A panel's fields for ``run``: each "prefix/*" expanded to the run's recorded fields under it."""
    out = []
    for key in keys:
        if key.endswith("/*"):
            out += [k for k in run.series if k.startswith(key[:-1]) and not k.endswith("_std")]
        else:
            out.append(key)
    return list(dict.fromkeys(out))


def extra_panels(
    runs: list[RunSeries], method_panels: tuple[Panel, ...] = (), metrics: tuple[str, ...] = ()
) -> tuple[Panel, ...]:
    """The panels after the common ones: the methods' own that any run has data for, then one per ``metrics``
    field (a field no run recorded is the user's one-line error naming the fields they did)."""

    def drawn(keys):
        return any(run.series.get(k, ((), ()))[0] for run in runs for k in panel_keys(keys, run))

    out = [p for p in dict.fromkeys(method_panels) if drawn(p[1])]
    for key in metrics:
        if not drawn((key,)):
            known = sorted({k for run in runs for k, (steps, _) in run.series.items() if steps})
            raise UserError(
                f"--metrics: {key!r} is not a number in any record of "
                f"{', '.join(r.path for r in runs)}; recorded: {', '.join(known)}"
            )
        out.append((key, (key,), key))
    return tuple(out)


def steady(values: list[float]) -> list[float]:
    """The values after the first record, which carries start-up (compilation, allocator, autotuning)."""
    return values[1:] if len(values) > 1 else values


def final_figures(run: RunSeries) -> dict[str, float | int | None]:
    """The table row: last step, last loss / validation loss / LR / gradient norm, mean throughput and MFU after
    the first record, peak memory, and for pipelines each rank's mean idle fraction and the theoretical bubble."""

    def last(key):
        values = run.series[key][1]
        return values[-1] if values else None

    def mean(key):
        values = steady(run.series[key][1])
        return sum(values) / len(values) if values else None

    memory = run.series["mem_gib_max_rank"][1] or run.series["mem_gib"][1]
    out = {
        "step": run.records[-1]["step"],
        "loss": last("loss"),
        "val_loss": last("val_loss"),
        "lr": last("lr"),
        "tokens_per_s": mean("tokens_per_s"),
        "mfu": mean("mfu"),
        "mem_gib": max(memory) if memory else None,
        "grad_norm": last("grad_norm"),
    }
    for rank, (_, values) in sorted(run.idle.items()):
        kept = steady(values)
        out[f"{IDLE}/{rank}"] = sum(kept) / len(kept)
    if run.idle:
        out["bubble"] = run.bubble
    return out


# ---- plotting -------------------------------------------------------------------------------------------


def new_figure(purpose: str, **kwargs):
    """A matplotlib Figure on the Agg canvas (no pyplot, no display, no global state), or the one-line error
    naming the 'report' extra."""
    require("matplotlib", "report", purpose=purpose)
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def figure(runs: list[RunSeries], extra: tuple[Panel, ...] = ()):
    """The report's figure: one panel per entry of PANELS, then ``extra`` (``extra_panels``: the methods' own and
    `--metrics`), plus measured idle per pp rank against the theoretical bubble when a run is a pipeline run; runs
    overlaid, one color each, labelled by run dir."""
    from matplotlib.ticker import PercentFormatter

    pipeline = any(r.idle for r in runs)
    drawn = PANELS + tuple(extra)
    panels = len(drawn) + pipeline
    cols = 3
    rows = -(-panels // cols)
    fig = new_figure("loom report", figsize=(6 * cols, 4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (title, keys, ylabel) in zip(axes, drawn):
        for i, run in enumerate(runs):
            for key in panel_keys(keys, run):
                steps, values = run.series.get(key, ([], []))
                if steps:
                    ax.plot(steps, values, color=f"C{i}", label=f"{run.label}: {key}", **STYLE.get(key, {}))
        _finish(ax, title, ylabel)
        if "mfu" in keys:
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
    if pipeline:
        ax = axes[len(drawn)]
        for i, run in enumerate(runs):
            for rank, (steps, values) in sorted(run.idle.items()):
                ax.plot(
                    steps,
                    values,
                    color=f"C{i}",
                    marker=MARKERS[rank % len(MARKERS)],
                    markersize=4,
                    label=f"{run.label}: pp rank {rank} idle",
                )
            if run.idle and run.bubble is not None:
                ax.axhline(
                    run.bubble, color=f"C{i}", linestyle="--", label=f"{run.label}: theoretical bubble"
                )
        _finish(ax, "pipeline idle per stage", "idle / step time")
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1))
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig


def _finish(ax, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


COLUMNS = (
    ("step", "steps", "{:d}"),
    ("loss", "loss", "{:.4f}"),
    ("val_loss", "val loss", "{:.4f}"),
    ("lr", "LR", "{:.2e}"),
    ("tokens_per_s", "tokens/s*", "{:,.0f}"),
    ("mfu", "MFU*", "{:.1%}"),
    ("mem_gib", "peak GiB", "{:.2f}"),
    ("grad_norm", "grad norm", "{:.3f}"),
)


def table_rows(runs: list[RunSeries]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the final figures, formatted; '-' where a run has no value."""
    figures = [final_figures(r) for r in runs]
    idle_keys = sorted(
        {k for f in figures for k in f if k.startswith(IDLE)}, key=lambda k: int(k.split("/")[1])
    )
    columns = list(COLUMNS) + [(k, f"idle rank {k.split('/')[1]}*", "{:.1%}") for k in idle_keys]
    if idle_keys:
        columns.append(("bubble", "theoretical bubble", "{:.1%}"))
    header = ["run"] + [name for _, name, _ in columns]
    rows = [
        [r.label] + ["-" if f.get(k) is None else fmt.format(f[k]) for k, _, fmt in columns]
        for r, f in zip(runs, figures)
    ]
    return header, rows


def html_page(runs: list[RunSeries], png: bytes) -> str:
    """A page with no external assets: the PNG as a data: URI and the table of final figures."""
    header, rows = table_rows(runs)
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    image = base64.b64encode(png).decode("ascii")
    sources = ", ".join(html.escape(r.path) for r in runs)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>loom report</title>
<style>body{{font-family:sans-serif;margin:1.5em}} table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:0.25em 0.6em;text-align:right}} td:first-child,th:first-child{{text-align:left}}
img{{max-width:100%}}</style></head>
<body><h1>loom report</h1>
<table><thead><tr>{cells}</tr></thead><tbody>
{body}
</tbody></table>
<p>Last logged values; * = mean over the records after the first (which includes start-up). From {sources}.</p>
<img alt="loss, validation loss, LR, tokens/s, MFU, memory, gradient norm over steps" src="data:image/png;base64,{image}">
</body></html>
"""


def write_report(runs: list[RunSeries], png_path: str, html_path: str, extra: tuple[Panel, ...] = ()) -> None:
    """The PNG and the HTML page (which embeds the same PNG); ``extra``: panels after the common ones."""
    png = png_bytes(figure(runs, extra))
    for path, data, mode in ((png_path, png, "wb"), (html_path, html_page(runs, png), "w")):
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, mode) as fh:
            fh.write(data)
