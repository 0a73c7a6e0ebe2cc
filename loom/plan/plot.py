"""``loom plan --plot FILE``: a PNG of the plan. The configured layout's memory per GPU as one bar stacked by
component against the GPU's memory and the limit a fitting layout stays under and, with ``--search``, the ranked layouts next to it (memory, and
throughput per GPU). The data are plain functions of the planner's ``Estimate``s; matplotlib only draws them."""

from __future__ import annotations

import os
from collections.abc import Sequence

from loom.config.errors import ConfigError, UserError
from loom.metrics.report import new_figure
from loom.plan.planner import Estimate

COMPONENTS = ("weights", "gradients", "optimizer", "gathered", "activations", "backward", "workspace")


def plan_layouts(result: Estimate | None, ranked: Sequence[Estimate] = ()) -> list[tuple[str, Estimate]]:
    """(label, estimate) in plotting order: the configured layout first (when valid), then the ranked ones."""
    out = [(f"configured: {result.describe()}", result)] if result is not None else []
    return out + [(f"#{i} {e.describe()}", e) for i, e in enumerate(ranked, 1)]


def memory_stacks(layouts: list[tuple[str, Estimate]]) -> dict[str, list[float]]:
    """GiB per component (COMPONENTS order), one value per layout: the heights of the stacked bars."""
    return {c: [e.memory.gib()[c] for _, e in layouts] for c in COMPONENTS}


def throughputs(layouts: list[tuple[str, Estimate]]) -> list[float]:
    return [e.tokens_per_s_per_gpu for _, e in layouts]


def roofline_points(ops, gpu, dtype: str, measured: dict | None = None) -> list[tuple[str, float, float]]:
    """(op, arithmetic intensity, ceiling FLOP/s) of the ops that compute (collectives have no FLOPs), and the
    step's own point: its FLOPs over its HBM bytes, at the FLOP/s its ops' roof times allow (no overlap); with
    ``measured`` (loom.plan.roofline.measured_step), the run's point at the FLOP/s it reached."""
    points = [(op.name, op.intensity, op.ceiling(gpu, dtype)) for op in ops if op.flops and op.hbm_bytes]
    flops, hbm = sum(op.flops for op in ops), sum(op.hbm_bytes for op in ops)
    seconds = sum(op.seconds(gpu, dtype) for op in ops)
    points.append(("step", flops / hbm, flops / seconds))
    if measured:
        points.append(("measured", measured["intensity"], measured["flops_per_s"]))
    return points


def _roofline_panel(ax, roofline) -> None:
    """Log-log roofline: FLOP/s against FLOP per HBM byte, the roof min(peak, intensity x HBM), each op at its
    ceiling and the step's point."""
    ops, gpu, dtype, *measured = roofline
    points = roofline_points(ops, gpu, dtype, measured[0] if measured else None)
    peak, hbm = gpu.peak(dtype), gpu.hbm_tbps * 1e12
    lo = min(0.1, min(i for _, i, _ in points) / 2)
    hi = max(10 * peak / hbm, max(i for _, i, _ in points) * 2)
    xs = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    ax.plot(
        xs,
        [min(peak, x * hbm) / 1e12 for x in xs],
        color="black",
        label=f"roof: {peak / 1e12:.0f} TFLOP/s, {gpu.hbm_tbps} TB/s",
    )
    for i, (name, intensity, ceiling) in enumerate(points):
        step = name in ("step", "measured")
        ax.scatter(
            [intensity],
            [ceiling / 1e12],
            marker=("*" if name == "step" else "X") if step else "o",
            s=120 if step else 30,
            color=("red" if name == "step" else "black") if step else f"C{i % 10}",
            zorder=3,
        )
        ax.annotate(
            name, (intensity, ceiling / 1e12), fontsize="x-small", xytext=(3, 3), textcoords="offset points"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity, FLOP per HBM byte")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"roofline of one step ({gpu.name}, {dtype}; ops at their ceilings)")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize="small")


def plan_figure(result: Estimate | None, ranked: Sequence[Estimate] = (), roofline=None):
    """Memory per GPU stacked by component (one bar per layout) against the capacity; with ranked layouts, a
    second panel of their throughput per GPU (MFU on each bar); with ``roofline`` (ops, gpu, dtype and the
    measured step or None: ``loom plan --roofline [--metrics]``), a roofline panel."""
    layouts = plan_layouts(result, ranked)
    if not layouts:
        raise UserError("--plot: nothing to draw (the configured layout is not valid and no layout fits)")
    labels = [label for label, _ in layouts]
    x = list(range(len(layouts)))
    panels = 1 + bool(ranked) + bool(roofline)
    fig = new_figure(
        "loom plan --plot", figsize=(max(6.0, 1.1 * len(layouts) + 3) * panels, 5.5), layout="constrained"
    )
    axes = fig.subplots(1, panels, squeeze=False).ravel()
    ax = axes[0]
    bottom = [0.0] * len(layouts)
    for i, (component, heights) in enumerate(memory_stacks(layouts).items()):
        bars = ax.bar(x, heights, width=0.6, bottom=bottom, label=component, color=f"C{i}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.bar_label(bars, labels=[f"{total:.1f}" for total in bottom], fontsize="small")  # the totals, on top
    pad = 1.0 if len(layouts) == 1 else 0.6  # a lone bar stays a bar, not the whole width
    ax.set_xlim(-pad, len(layouts) - 1 + pad)
    first = layouts[0][1]  # every layout is on the same GPU kind, with the same margin
    ax.axhline(first.capacity_gib, color="black", label=f"GPU memory {first.capacity_gib:.1f} GiB")
    if first.margin_gib:
        ax.axhline(
            first.limit_gib,
            color="black",
            linestyle="--",
            label=f"fits below {first.limit_gib:.1f} GiB ({first.margin_gib:.1f} GiB margin)",
        )
    ax.set_title("memory per GPU (busiest rank)")
    ax.set_ylabel("GiB")
    _labels(ax, x, labels)
    ax.legend(fontsize="small")
    if ranked:
        ax = axes[1]
        values = throughputs(layouts)
        bars = ax.bar(
            x,
            values,
            width=0.6,
            color=["gray" if label.startswith("configured") else "C0" for label in labels],
        )
        ax.bar_label(bars, labels=[f"MFU {100 * e.mfu:.0f}%" for _, e in layouts], fontsize="small")
        ax.set_title("throughput per GPU (fastest that fit first)")
        ax.set_ylabel("tokens/s per GPU")
        _labels(ax, x, labels)
    if roofline:
        _roofline_panel(axes[-1], roofline)
    return fig


def _labels(ax, x: list[int], labels: list[str]) -> None:
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize="small")
    ax.grid(axis="y", alpha=0.3)


def plot_plan(result: Estimate | None, path: str, ranked: Sequence[Estimate] = (), roofline=None) -> None:
    """Write the plan's PNG to ``path``: ``result`` is the configured layout's estimate (None where it is not
    valid), ``ranked`` the layouts ``--search`` found, fastest first, ``roofline`` (ops, gpu, dtype, measured) or None."""
    fig = plan_figure(result, ranked, roofline)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, format="png", dpi=100)
    except OSError as err:
        raise ConfigError("--plot", path, f"could not be written ({err.strerror or err})") from None
