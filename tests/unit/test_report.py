"""``loom report`` draws exactly what metrics.jsonl holds (the extracted series and the figure's lines), writes a
PNG and a self-contained HTML page, and overlays runs; ``plot_plan`` draws the planner's memory and ranking."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import sys

import pytest

from loom.cli.errors import user_errors_exit
from loom.cli.report import main as report_main
from loom.cli.report import output_paths
from loom.config.errors import UserError
from loom.metrics.report import PANELS, SERIES, figure, final_figures, load_run
from tests.distributed.harness import run_jobs, run_one
from tests.tiny import tiny_overrides

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A single-device tiny run with validation, and a 2-stage pipeline (1f1b, 4 micro-batches) one."""
    root = tmp_path_factory.mktemp("report")
    run_one(tiny_overrides(root / "single", root / "cache", **{"training.eval_every": 2}))
    run_jobs(
        2,
        [tiny_overrides(root / "pp", root / "cache", **{"parallel.pp": 2, "parallel.dp_shard": 1})],
        str(root),
    )
    return root


def jsonl(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def expected_series(records, key):
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def figure_lines(fig) -> dict[str, tuple[list, list]]:
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for ax in fig.axes
        for line in ax.get_lines()
    }


def test_the_plotted_series_are_the_records(runs):
    records = jsonl(runs / "single")
    run = load_run(str(runs / "single"))
    assert run.label == str(runs / "single") and not run.idle
    for key in SERIES:
        assert run.series[key] == expected_series(records, key), key
    assert run.series["val_loss"][0] == [2, 4] and run.series["mfu"] == ([], [])  # CPU: no MFU
    lines = figure_lines(figure([run]))
    plotted = {key for _, keys, _ in PANELS for key in keys if run.series[key][0]}
    assert set(lines) == {f"{run.label}: {key}" for key in plotted}
    for key in plotted:
        assert lines[f"{run.label}: {key}"] == expected_series(records, key), key
    figures = final_figures(run)
    assert figures["loss"] == records[-1]["loss"] and figures["val_loss"] == records[-1]["val_loss"]
    assert figures["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in records[1:]) / 3)
    assert figures["mem_gib"] == max(r["mem_gib"] for r in records) and figures["mfu"] is None


def test_pipeline_idle_per_stage_against_the_theoretical_bubble(runs):
    from loom.cli.report import theoretical_bubble as bubble_of
    from loom.parallel.pipeline import theoretical_bubble

    records = jsonl(runs / "pp")
    assert all(len(r["pp_idle"]) == 2 for r in records)
    bubble = bubble_of(str(runs / "pp"), records)
    assert bubble == theoretical_bubble(
        "1f1b", 2, 4, 1
    )  # global batch 8 / micro-batch 2 / 1 data-parallel rank
    run = load_run(str(runs / "pp"), bubble=bubble)
    for rank in (0, 1):
        assert run.idle[rank] == ([r["step"] for r in records], [r["pp_idle"][rank] for r in records])
    lines = figure_lines(figure([run]))
    for rank in (0, 1):
        assert lines[f"{run.label}: pp rank {rank} idle"] == run.idle[rank]
    assert lines[f"{run.label}: theoretical bubble"][1] == [bubble, bubble]
    assert final_figures(run)["pp_idle/1"] == pytest.approx(sum(r["pp_idle"][1] for r in records[1:]) / 3)
    assert bubble_of(str(runs / "single"), jsonl(runs / "single")) is None  # no pipeline


def test_report_writes_a_png_and_a_self_contained_page(runs, capsys):
    assert report_main([str(runs / "single"), str(runs / "pp")]) == 0
    png_path, html_path = runs / "single" / "report.png", runs / "single" / "report.html"
    assert capsys.readouterr().out.strip() == f"loom report: {png_path} and {html_path} (2 runs)"
    png = png_path.read_bytes()
    assert png.startswith(PNG)
    page = html_path.read_text()
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [base64.b64decode(e) for e in embedded] == [png]
    assert not re.search(r'(src|href)="(?!data:)', page) and "<link" not in page and "<script" not in page
    cells = re.findall(r"<tr>(.*?)</tr>", page)
    rows = [re.findall(r"<td>(.*?)</td>", c) for c in cells[1:]]
    assert [row[0] for row in rows] == [str(runs / "single"), str(runs / "pp")]
    assert rows[0][2] == f"{jsonl(runs / 'single')[-1]['loss']:.4f}"
    assert rows[1][-1] == "20.0%"  # 1f1b, 2 stages, 4 micro-batches: (p-1)/(m+p-1)


def rl_run_dir(folder, objective="grpo"):
    """A run dir as a GRPO run leaves it (its config.toml's objective, records with its fields), written by hand: the
    report draws what metrics.jsonl holds, whatever wrote it."""
    os.makedirs(folder)
    with open(os.path.join(folder, "config.toml"), "w") as fh:
        fh.write(f'[training]\nobjective = "{objective}"\n')
    recs = [
        {
            "step": s,
            "loss": 0.1,
            "val_loss": None,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "tokens_per_s": 10.0,
            "tokens_per_s_per_device": 10.0,
            "mfu": None,
            "mem_gib": 1.0,
            "reward": 0.1 * s,
            "rewards/exact_answer": 0.05 * s,
            "rewards/digit_match": 0.1 * s,
            "rewards/digit_match_std": 0.3,
            "completion_length": 3.0 + s,
            **({"eval/accuracy": 0.5} if s == 4 else {}),
        }
        for s in (1, 2, 3, 4)
    ]
    with open(os.path.join(folder, "metrics.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in recs)
    return recs


def test_a_grpo_run_has_its_reward_and_accuracy_panels_and_metrics_adds_any_field(tmp_path, capsys):
    from loom.cli.report import method_panels
    from loom.metrics.report import extra_panels

    recs = rl_run_dir(str(tmp_path / "grpo"))
    run = load_run(str(tmp_path / "grpo"))
    extra = extra_panels([run], method_panels(str(tmp_path / "grpo")), ("completion_length",))
    assert [title for title, _, _ in extra] == [
        "reward",
        "accuracy",
        "completion_length",
    ]  # no KL logged: no panel
    fig = figure([run], extra)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles[len(PANELS) :] == ["reward", "accuracy", "completion_length"]
    lines = figure_lines(fig)
    label = run.label
    for key in (
        "reward",
        "rewards/exact_answer",
        "rewards/digit_match",
        "eval/accuracy",
        "completion_length",
    ):
        assert lines[f"{label}: {key}"] == expected_series(recs, key), key
    assert f"{label}: rewards/digit_match_std" not in lines
    assert report_main([str(tmp_path / "grpo"), "--metrics", "completion_length"]) == 0
    with pytest.raises(SystemExit) as exit_info:
        user_errors_exit(report_main)([str(tmp_path / "grpo"), "--metrics", "nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'nope'" in err and "completion_length" in err


def test_out_prefix(tmp_path):
    assert output_paths(["a", "b"], None) == (
        os.path.join("a", "report.png"),
        os.path.join("a", "report.html"),
    )
    assert output_paths(["a"], "x/cmp") == ("x/cmp.png", "x/cmp.html")
    assert output_paths(["a"], "x/cmp.png") == ("x/cmp.png", "x/cmp.html")
    # a folder gets report.png in it (`--out ./` wrote ./.png)
    assert output_paths(["a"], "./") == (os.path.join(".", "report.png"), os.path.join(".", "report.html"))
    assert output_paths(["a"], str(tmp_path))[0] == str(tmp_path / "report.png")


def test_lines_that_are_not_records_are_counted_in_one_warning(tmp_path, capsys):
    from loom.metrics.report import read_records

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2)]
    path.write_text("\n".join([good[0], "not json", "", json.dumps([1]), good[1], '{"step": 3, "lo']) + "\n")
    assert [r["step"] for r in read_records(str(path))] == [1, 2]
    err = capsys.readouterr().err
    assert err == f"warning: {path}: 3 lines not a metrics record (line 2, 4, 6), skipped\n", err
    path.write_text("\n".join(good) + "\n")
    read_records(str(path))
    assert capsys.readouterr().err == ""


def test_a_missing_metrics_file_is_one_line_and_exit_2(tmp_path, capsys):
    missing = tmp_path / "nothing"
    missing.mkdir()
    with pytest.raises(SystemExit) as exit_:
        user_errors_exit(report_main)([str(missing)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert (
        err == f"loom: error: {missing / 'metrics.jsonl'}: no such file (the run dir of a `loom train` run "
        "has one)\n"
    )
    assert not os.path.exists(missing / "report.png")


def test_without_matplotlib_report_says_which_extra(runs, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(
        UserError,
        match=r"^loom report needs the 'matplotlib' package "
        r"\(pip install 'loom-train\[report\]'\)$",
    ):
        report_main([str(runs / "single"), "--out", str(runs / "no-matplotlib")])


def test_plot_plan_draws_the_estimates(tmp_path):
    from loom.config import build_config
    from loom.plan.hardware import gpu_named
    from loom.plan.planner import estimate
    from loom.plan.plot import COMPONENTS, memory_stacks, plan_figure, plan_layouts, plot_plan

    gpu = gpu_named("H100")
    base = {"training.seq_len": "64", "training.global_batch_size": "8", "training.micro_batch_size": "1"}
    configured = estimate(build_config(None, base), 2, gpu)
    other = estimate(build_config(None, {**base, "parallel.pp": "2", "parallel.dp_shard": "1"}), 2, gpu)
    plot_plan(configured, str(tmp_path / "plan.png"), ranked=[other, configured])
    plot_plan(configured, str(tmp_path / "alone.png"))
    assert (tmp_path / "plan.png").read_bytes().startswith(PNG)
    assert (tmp_path / "alone.png").read_bytes().startswith(PNG)

    layouts = plan_layouts(configured, [other, configured])
    assert [label for label, _ in layouts] == [
        f"configured: {configured.describe()}",
        f"#1 {other.describe()}",
        f"#2 {configured.describe()}",
    ]
    stacks = memory_stacks(layouts)
    for i, (_, est) in enumerate(layouts):
        assert sum(stacks[c][i] for c in COMPONENTS) == pytest.approx(est.memory.total / 2**30)
    memory_ax, speed_ax = plan_figure(configured, [other, configured]).axes
    bars = {c: [p.get_height() for p in container] for c, container in zip(COMPONENTS, memory_ax.containers)}
    assert bars == stacks
    assert [line.get_ydata()[0] for line in memory_ax.get_lines()] == [
        configured.capacity_gib,
        configured.limit_gib,
    ]
    assert configured.limit_gib < configured.capacity_gib  # the default margin
    assert [p.get_height() for p in speed_ax.containers[0]] == [e.tokens_per_s_per_gpu for _, e in layouts]
    assert all(math.isfinite(e.mfu) for _, e in layouts)
    with pytest.raises(UserError, match="^--plot: nothing to draw"):
        plot_plan(None, str(tmp_path / "nothing.png"))
