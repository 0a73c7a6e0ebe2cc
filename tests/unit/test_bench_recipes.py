"""bench.recipes, the standard benchmark table: the shipped config list covers what the issue asks for (1B, 3B,
8B dense and both MoE families on 1-8 GPUs), each row's layout columns are loom's resolution of its config, and on
a CPU the tool prints (and writes) the prediction columns, the measured ones left empty."""

from __future__ import annotations

import json

import pytest

from bench import recipes
from loom.models.registry import spec_of


def test_the_list_covers_dense_and_moe_flavors_on_1_to_8_gpus():
    from loom.models.registry import all_flavors

    flavors = all_flavors()
    assert {"1B", "3B", "8B"} <= {r.flavor for r in recipes.RECIPES}
    families = {spec_of(flavors[r.flavor]).name for r in recipes.RECIPES}
    assert {"llama", "qwen3_moe", "deepseek_v3"} <= families
    assert {r.gpus for r in recipes.RECIPES} == {1, 2, 4, 8}
    assert len(recipes.BY_NAME) == len(recipes.RECIPES)  # names are unique


def test_layout_columns_are_the_resolved_config():
    pp = recipes.layout(recipes.BY_NAME["8b_pp2_vp2"])
    # 64 sequences over dp 8 / pp 2 = 4 ranks of micro-batch 1: 16 micro-batches a step
    assert (pp["GA"], pp["PP"], pp["VP"], pp["TP"], pp["CP"], pp["precision"]) == (16, 2, 2, 1, 1, "bf16")
    moe = recipes.layout(recipes.BY_NAME["qwen3_moe_30b_a3b_ep8"])
    assert (moe["EP"], moe["ETP"], moe["GA"], moe["#GPUs"], moe["seq len"]) == (8, 1, 4, 8, 4096)


def test_the_table_puts_the_measured_row_next_to_the_prediction():
    row = {
        "layout": recipes.layout(recipes.BY_NAME["8b_tp2"]),
        "measured": {"time/step s": 7.5, "tokens/s/GPU": 8738.1, "MFU": 0.512, "peak GiB": 35.04},
        "predicted": {
            "time/step s": 7.06,
            "tokens/s/GPU": 9285.9,
            "MFU": 0.54,
            "peak GiB": 33.2,
            "fits": True,
        },
    }
    lines = recipes.table([row], "H100").splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = dict(zip(head, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert head[:13] == recipes.COLUMNS
    assert (cells["TP"], cells["GA"], cells["precision"]) == ("2", "16", "bf16")
    assert cells["tokens/s/GPU (measured)"] == "8,738" and cells["tokens/s/GPU (plan, H100)"] == "9,286"
    assert cells["MFU (measured)"] == "51.2%" and cells["peak GiB (plan, H100)"] == "33.2"
    assert cells["time/step s (measured)"] == "7.50"


def test_a_jobs_figures_are_medians_after_the_first_interval():
    recipe = recipes.BY_NAME["1b_fsdp2"]  # 16 x 8192 tokens a step on 2 GPUs
    records = [
        {"step": 5, "tokens_per_s": 1000.0, "mfu": 0.01, "mem_gib": 30.0, "mem_gib_max_rank": 31.0},
        {"step": 10, "tokens_per_s": 65536.0, "mfu": 0.4, "mem_gib": 30.0, "mem_gib_max_rank": 33.5},
        {"step": 10, "val_loss": 2.0},  # not a training interval
        {"step": 15, "tokens_per_s": 131072.0, "mfu": 0.6, "mem_gib": 30.0, "mem_gib_max_rank": 32.0},
        {"step": 20, "tokens_per_s": 32768.0, "mfu": 0.2, "mem_gib": 30.0, "mem_gib_max_rank": 32.0},
    ]
    got = recipes.summarize(records, recipe)
    assert got["intervals"] == 3 and got["time/step s"] == pytest.approx(16 * 8192 / 65536)
    assert got["tokens/s/GPU"] == pytest.approx(65536 / 2) and got["MFU"] == pytest.approx(0.4)
    assert got["peak GiB"] == 33.5


def test_a_short_job_logs_often_enough_for_five_timed_intervals():
    for steps in (12, 30, 100):
        every = recipes.config(recipes.BY_NAME["1b_1gpu"], steps=steps)["metrics.every"]
        assert steps // every - 1 >= 5 and every <= 5  # intervals after the first, at most every 5 steps


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="on a GPU machine the tool measures (minutes)"
)
def test_on_a_cpu_it_prints_and_writes_the_prediction_columns(tmp_path, capsys):
    out = tmp_path / "recipes.json"
    assert recipes.main(["--only", "1b_fsdp2", "--out", str(out), "--run-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "prediction only (no CUDA GPU here)" in text
    row = json.loads(out.read_text())["rows"][0]
    assert row["layout"]["GA"] == 4 and "measured" not in row  # 16 / (micro-batch 2 x dp 2)
    pred = row["predicted"]
    assert pred["fits"] and 0 < pred["MFU"] < 1 and pred["time/step s"] > 0
    # tokens/s per GPU is the step's tokens over its time on 2 GPUs
    assert pred["tokens/s/GPU"] == pytest.approx(16 * 8192 / pred["time/step s"] / 2)
    line = next(ln for ln in text.splitlines() if ln.startswith("| 1B |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[13:17] == ["-"] * 4 and cells[17:21] != ["-"] * 4  # measured empty, predicted filled
    assert (tmp_path / "recipes.md").read_text().count("| 1B |") == 1
    assert recipes.main(["--only", "nope"]) == 2


@pytest.mark.slow
def test_every_recipe_fits_an_h100_by_the_plan():
    """Minutes on a CPU (the planner traces each model's activations): by hand."""
    for r in recipes.RECIPES:
        assert recipes.predict(r, "H100")["fits"], r.name
