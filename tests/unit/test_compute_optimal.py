"""Compute-optimal sizing (loom.plan.compute_optimal, ``loom plan --flops``): Chinchilla's example, 5.76e23 FLOPs
-> about 70B parameters and 1.4T tokens, the nearest flavor, GPU-hours from the planner, and one-line errors."""

from __future__ import annotations

import json
import subprocess

import pytest

from loom.config.errors import ConfigError
from loom.plan.compute_optimal import (
    compute_optimal,
    gpu_hours,
    nearest_flavor,
    parse_count,
    recommended_batch,
)

LOOM = "loom"


def test_chinchilla_example():
    b = compute_optimal(flops=5.76e23)
    assert b.params == pytest.approx(70e9, rel=0.02) and b.tokens == pytest.approx(1.4e12, rel=0.02)
    assert b.tokens == pytest.approx(20 * b.params) and b.flops == pytest.approx(5.76e23)


@pytest.mark.parametrize("given", [{"params": 69.28e9}, {"tokens": 1.3856e12}])
def test_any_one_gives_the_others(given):
    b = compute_optimal(**given)
    assert b.flops == pytest.approx(5.76e23, rel=1e-3) and b.params == pytest.approx(69.28e9, rel=1e-3)


def test_nearest_by_ratio():
    flavors = {"small": 1e8, "big": 1e10}
    assert nearest_flavor(0.9e9, flavors)[0] == "small" and nearest_flavor(1.1e9, flavors)[0] == "big"


def test_counts_and_hours():
    assert parse_count("--params", "70B") == 70e9 and parse_count("--tokens", "1.4T") == 1.4e12
    assert parse_count("--flops", "5.76e23") == 5.76e23
    assert gpu_hours(3.6e9, 1000.0) == pytest.approx(1000.0)
    assert recommended_batch(1e6, 4096) == 244 and recommended_batch(100, 4096) == 1
    with pytest.raises(ConfigError, match="exactly one"):
        compute_optimal(flops=1e20, params=1e9)


def _plan(*args):
    return subprocess.run([LOOM, "plan", *args], capture_output=True, text=True, timeout=300)


def test_cli_prints_the_budget_flavor_and_gpu_hours(tmp_path):
    out = tmp_path / "plan.json"
    r = _plan(
        "--flops",
        "5.76e23",
        "--gpus",
        "64",
        "--gpu",
        "H100",
        "--training.seq_len",
        "2048",
        "--training.global_batch_size",
        "512",
        "--training.micro_batch_size",
        "1",
        "--training.dtype",
        "bfloat16",
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "parameters 69.3B, tokens 1.39T, FLOPs 5.76e+23" in r.stdout
    assert "nearest flavor: 70B" in r.stdout and "GPU-hours" in r.stdout
    report = json.loads(out.read_text())["compute_optimal"]
    assert report["flavor"] == "70B" and report["gpus"] == 64
    assert report["gpu_hours"] == pytest.approx(report["tokens"] / report["tokens_per_s_per_gpu"] / 3600)
    r = _plan(
        "--params", "125M", "--noise-scale", "2e5", "--training.seq_len", "2048"
    )  # no cluster: no GPU-hours
    assert r.returncode == 0 and "nearest flavor: 125M" in r.stdout and "GPU-hours" not in r.stdout
    assert "global batch: about 200,000 tokens = 98 sequences of 2048" in r.stdout


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--flops", "lots"], ["--flops = 'lots'", "expected a positive number"]),
        (["--flops", "0"], ["--flops = '0'", "expected a positive number"]),
        (["--flops", "1e22", "--params", "1B"], ["give exactly one of --flops, --params, --tokens"]),
        (["--noise-scale", "1e5"], ["--noise-scale = '1e5'", "only with --flops, --params or --tokens"]),
        (
            ["--flops", "1e22", "--generate", "--prompt-len", "8", "--output-len", "8"],
            ["--generate", "not with --flops"],
        ),
    ],
)
def test_cli_errors_are_one_line(cli_error, args, expect):
    line = cli_error("plan", *args)
    assert all(e in line for e in expect), line
