"""Every ``loom`` command as the subprocess a user runs (the in-process tests do not see the entry point, argv
parsing, exit codes and what reaches the terminal): exit code and the essential output of ``generate``, ``score``,
``eval``, ``report``, ``convert``, ``plan``, ``doctor`` and ``launch --slurm / --kubernetes``, on one tiny trained
run and one tiny reward model shared by the module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.tiny import tiny_config

LOOM = os.path.join(os.path.dirname(sys.executable), "loom")
STEPS = 2


def loom(*argv, cwd=None, timeout=180) -> subprocess.CompletedProcess:
    """``loom ARGV`` on this machine's CPU; the process is ended at ``timeout`` (its output so far in the error)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [LOOM, *map(str, argv)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny language-model run and a tiny reward-model run, each saved at its end."""
    from loom.train.trainer import Trainer
    from tests.unit.test_reward import reward_run, write_pairs

    tmp = tmp_path_factory.mktemp("cli_commands")
    Trainer(
        tiny_config(tmp / "lm", tmp / "cache", **{"training.steps": STEPS, "checkpoint.at_end": "true"})
    ).fit()
    source = write_pairs(tmp / "pairs.jsonl")
    Trainer(
        reward_run(
            tmp / "rm", tmp / "cache", source, **{"training.steps": STEPS, "checkpoint.at_end": "true"}
        )
    ).fit()
    step = f"checkpoints/step_{STEPS:08d}"
    return {"tmp": tmp, "lm": tmp / "lm", "ckpt": tmp / "lm" / step, "rm": tmp / "rm" / step}


def test_generate(runs):
    out = ok(loom("generate", "--model", runs["ckpt"], "The cat", "--max-new-tokens", 6, "--no-stream"))
    assert out.strip(), "no completion printed"


def test_score(runs):
    rows = runs["tmp"] / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in (
                {"prompt": "The cat sat.", "completion": "On a mat.", "id": 1},
                {"text": "One bird sang."},
            )
        )
    )
    got = [
        json.loads(line)
        for line in ok(loom("score", "--model", runs["rm"], "--file", rows, "--device", "cpu")).splitlines()
    ]
    assert [r.get("id") for r in got] == [1, None] and all(isinstance(r["score"], float) for r in got)


def test_eval(runs):
    text = runs["tmp"] / "eval.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out_json = runs["tmp"] / "eval.json"
    out = ok(loom("eval", runs["ckpt"], "--source", text, "--device", "cpu", "--out", out_json))
    assert "perplexity" in out.lower()
    assert json.loads(out_json.read_text())  # the figures, written


def test_report(runs):
    pytest.importorskip("matplotlib")
    prefix = runs["tmp"] / "report"
    ok(loom("report", runs["lm"], "--out", prefix))
    assert (runs["tmp"] / "report.png").stat().st_size > 0
    assert "<img" in (runs["tmp"] / "report.html").read_text()


def test_convert_to_hf(runs):
    out = runs["tmp"] / "hf"
    ok(loom("convert", "--from", runs["ckpt"], "--to-hf", out))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and (out / "model.safetensors").exists()


def test_plan():
    out = ok(loom("plan", "--gpus", 8, "--model.flavor", "1B", "--training.global_batch_size", 64))
    assert "GiB" in out


def test_doctor_local(runs):
    out_json = runs["tmp"] / "doctor.json"
    proc = loom("doctor", "--local", "--json", out_json)
    assert proc.returncode in (0, 1), proc.stderr  # 1: a FAIL line (this machine's), still a finished report
    assert "torch" in proc.stdout and out_json.exists()


def test_launch_writes_slurm_and_kubernetes_files(runs):
    tmp = runs["tmp"]
    ok(
        loom(
            "launch",
            "--slurm",
            "--nodes",
            2,
            "--gpus-per-node",
            8,
            "--cpus-per-node",
            32,
            "--script",
            tmp / "job.sbatch",
            "--training.steps",
            10,
            "--training.micro_batch_size",  # 1 x 16 workers divide the global batch of 16
            1,
        )
    )
    script = (tmp / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "loom" in script
    ok(
        loom(
            "launch",
            "--kubernetes",
            "--image",
            "loom:latest",
            "--nodes",
            2,
            "--gpus-per-node",
            8,
            "--name",
            "tiny",
            "--out",
            tmp / "k8s",
            "--training.micro_batch_size",
            1,
        )
    )
    written = sorted(p.name for p in (tmp / "k8s").iterdir())
    assert written == ["tiny.jobset.yaml", "tiny.pytorchjob.yaml"], written
