"""What a run says about itself: the banner at the start, one line at the end saying where things are."""

import os
import warnings

from loom.metrics.flops import device_peak, mfu_note
from loom.train.trainer import Trainer


def _fit(cfg, capsys) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(cfg).fit()
    assert not [w for w in caught if "MFU" in str(w.message)]  # on CPU a banner note, not a warning
    return capsys.readouterr().out.splitlines()


def test_banner_and_last_line(tiny, tmp_path, capsys):
    cfg = tiny(**{"checkpoint.at_end": None})
    out = _fit(cfg, capsys)
    run = os.path.abspath(cfg.run.dir)
    assert out[0] == f"loom: run dir {run}"
    assert out[1].startswith("model: flavor debug, ") and "2 layers, dim 64" in out[1]
    assert (
        out[2].startswith("layout: single (world 1), accumulation 4") and "MFU not reported on cpu" in out[2]
    )
    assert out[3] == "batch: 8 x 32 = 256 tokens per step, 4 steps"
    assert out[4].startswith("data: <stdlib>: ") and "of it" in out[4]
    last = out[-1]
    ckpt = os.path.join(cfg.checkpoint.dir or os.path.join(run, "checkpoints"), "step_00000004")
    assert last == f"loom: stopped at step 4; checkpoint {ckpt}; metrics {os.path.join(run, 'metrics.jsonl')}"
    assert os.path.isdir(ckpt)


def test_small_corpus_warnings(tiny, tmp_path, capsys):
    text = tmp_path / "small.txt"
    text.write_text("a few words of text repeated. " * 20)  # 600 bytes: 17 training windows of 33 tokens
    out = _fit(tiny(**{"data.source": str(text), "training.steps": 3}), capsys)
    assert any(line.startswith("warning:") and "will be repeated: 1.4 epochs" in line for line in out)
    text.write_text("too short for a step. " * 5)  # 110 bytes: 2 training windows, a step takes 8
    out = _fit(
        tiny(**{"data.source": str(text), "training.steps": 1, "run.dir": str(tmp_path / "run2")}), capsys
    )
    assert any("fewer windows (2) than one step takes from it (8)" in line for line in out)


def test_mfu_note():
    import torch

    cpu = torch.device("cpu")
    assert device_peak(cpu, "float32") is None
    assert mfu_note(cpu, "bfloat16") == "MFU not reported on cpu"


def test_a_resume_says_when_the_corpus_changed_under_the_same_name(tiny, tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("some words of text for a short corpus. " * 40)
    over = {"data.source": str(text), "training.steps": 2, "checkpoint.at_end": None}
    _fit(tiny(**over), capsys)
    out = _fit(tiny(**{**over, "training.steps": 3}), capsys)  # the same files: no line
    assert "resumed from step 2" in out and not any("its files changed" in line for line in out)
    text.write_text("other words, and more of them, in an edited corpus. " * 40)
    out = _fit(tiny(**{**over, "training.steps": 4}), capsys)
    assert any("its files changed since the checkpoint" in line for line in out), out
