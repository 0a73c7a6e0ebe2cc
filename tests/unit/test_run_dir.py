"""A run dir you can move and reuse (loom.train.run_dir): the tokenizer is copied into it, the recorded config
names the copy by an absolute path, and whoever reads a checkpoint's config (convert, resume) finds the copy in
the checkpoint's run dir wherever that moved; a missing one is one line naming the paths tried."""

from __future__ import annotations

import json
import os
import shutil
import tomllib

import pytest

from loom.cli.main import main as loom_main
from loom.config.errors import ConfigError
from loom.config.load import to_toml
from loom.data.tokenizers import HFTokenizer, build_tokenizer
from loom.train import resume_changes as rc
from loom.train.run_dir import record_run_files, recorded_run_dir, recorded_tokenizer
from tests.tiny import tiny_config

tokenizers = pytest.importorskip("tokenizers")

CORPUS = "".join(f"line {i}: the quick brown fox {i * 7 % 13} jumps over the lazy dog\n" for i in range(600))
# loom ends documents with <|end_of_text|>; the tokenizer_config names the chat turn's end as its EOS
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
TEMPLATE = (
    "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|begin_of_text|>assistant\n{% endif %}"
)


def tokenizer_folder(folder, chat_template: str | None = TEMPLATE) -> str:
    """A small byte-level BPE tokenizer.json trained on CORPUS, with a tokenizer_config.json (special tokens and,
    where given, a chat template) beside it."""
    tk = tokenizers
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "tokenizer_class": "LlamaTokenizer",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh)
    return str(folder)


def recording(monkeypatch) -> None:
    """The engine records its config through record_run_files (what Engine._setup_run_dir and save_checkpoint
    do once engine.py calls it; applying it twice changes nothing)."""
    import loom.train.engine as engine_module

    monkeypatch.setattr(engine_module, "to_toml", lambda cfg: to_toml(record_run_files(cfg)))


def run_config(tmp_path, run_dir, tokenizer: str = "byte", steps: int = 2, **extra):
    """The tiny model for ``steps`` steps on a small text file, saving at the end."""
    text = tmp_path / "corpus.txt"
    if not text.exists():
        text.write_text(CORPUS)
    return tiny_config(
        run_dir,
        tmp_path / "cache",
        **{
            "run.device": "cpu",
            "data.source": str(text),
            "data.tokenizer": tokenizer,
            "training.steps": steps,
            "training.global_batch_size": 4,
            "optimizer.warmup_steps": 0,
            "metrics.progress": "false",
            "checkpoint.at_end": None,
            **extra,
        },
    )


def train(tmp_path, monkeypatch, run_dir, tokenizer: str = "byte", steps: int = 2, **extra):
    """``run_config``'s run, trained with the config recorded as the trainer records it; returns the trainer."""
    from loom.train.trainer import Trainer

    recording(monkeypatch)
    trainer = Trainer(run_config(tmp_path, run_dir, tokenizer, steps, **extra))
    trainer.fit()
    return trainer


def recorded(path) -> dict:
    with open(path, "rb") as fh:
        return tomllib.load(fh)


# ---- recording ----------------------------------------------------------------------------------------


def test_the_tokenizer_is_copied_and_recorded_paths_are_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tokenizer_folder(tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text(TEMPLATE)
    (tmp_path / "tok" / "notes.txt").write_text("not a tokenizer file")
    os.makedirs("hf")
    cfg = tiny_config("run", **{"data.tokenizer": "tok/tokenizer.json", "model.init_from": "hf"})
    out = record_run_files(cfg)
    copy = str(tmp_path / "run" / "tokenizer")
    assert (out.run.dir, out.data.tokenizer, out.model.init_from) == (
        str(tmp_path / "run"),
        copy,
        str(tmp_path / "hf"),
    )
    assert (cfg.run.dir, cfg.data.tokenizer) == (
        "run",
        "tok/tokenizer.json",
    )  # the run's own config is untouched
    assert sorted(os.listdir(copy)) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").read_bytes() == (
        tmp_path / "tok" / "tokenizer.json"
    ).read_bytes()
    # token caches stay valid
    assert build_tokenizer(copy).fingerprint() == build_tokenizer("tok").fingerprint()
    assert record_run_files(cfg) == out and record_run_files(out) == out  # the same files: the same copy
    assert sorted(os.listdir(tmp_path / "run")) == ["tokenizer"]  # no temporary folder left

    # another tokenizer in the same run dir: the copy the checkpoints may name stays as it was
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "<|end_of_text|>"}')
    other = record_run_files(cfg).data.tokenizer
    assert os.path.basename(other).startswith("tokenizer-") and other != copy
    assert (
        json.loads((tmp_path / "run" / "tokenizer" / "tokenizer_config.json").read_text())["eos_token"]
        == "<|eot_id|>"
    )


def test_the_byte_tokenizer_copies_nothing_and_a_lone_file_is_copied_alone(tmp_path):
    assert record_run_files(tiny_config(tmp_path / "run")).data.tokenizer == "byte"
    assert not os.path.exists(tmp_path / "run")
    tokenizer_folder(tmp_path / "tok")
    shutil.copyfile(tmp_path / "tok" / "tokenizer.json", tmp_path / "mine.json")
    out = record_run_files(tiny_config(tmp_path / "run", **{"data.tokenizer": str(tmp_path / "mine.json")}))
    assert os.listdir(out.data.tokenizer) == ["tokenizer.json"]  # a file's neighbours are not its companions


def test_a_missing_tokenizer_names_its_resolved_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        record_run_files(tiny_config("run", **{"data.tokenizer": "gone/tokenizer.json"}))
    assert str(err.value) == (
        f"data.tokenizer = 'gone/tokenizer.json': not found ({tmp_path}/gone/tokenizer.json); "
        "allowed: byte | path to a tokenizer.json or a folder holding one"
    )
    os.makedirs("empty")
    with pytest.raises(
        ConfigError, match=f"no tokenizer.json in this folder \\({tmp_path}/empty/tokenizer.json\\)"
    ):
        HFTokenizer("empty")


def test_a_checkpoint_finds_its_run_dir_where_it_is_now(tmp_path):
    run = tmp_path / "run"
    for folder in ("checkpoints/step_00000002", "checkpoints/superseded/20260101-000000/step_00000002"):
        os.makedirs(run / folder)
        (run / folder / "trainer_state.json").write_text("{}")
        assert recorded_run_dir(str(run / folder), {"run.dir": "/elsewhere"}) == str(run)
    # another checkpoint.dir: only the recorded run dir is known
    assert (
        recorded_run_dir(
            str(run / "checkpoints/step_00000002"), {"run.dir": "/elsewhere", "checkpoint.dir": "/ckpts"}
        )
        == "/elsewhere"
    )
    # the run's copy where the run dir is now, else where it was recorded
    values = {"run.dir": str(tmp_path / "old"), "data.tokenizer": str(tmp_path / "old" / "tokenizer")}
    os.makedirs(tmp_path / "old" / "tokenizer")
    assert recorded_tokenizer(str(run / "checkpoints/step_00000002"), values) == str(
        tmp_path / "old" / "tokenizer"
    )
    os.makedirs(run / "tokenizer")
    assert recorded_tokenizer(str(run / "checkpoints/step_00000002"), values) == str(run / "tokenizer")


# ---- a trained run, moved ------------------------------------------------------------------------------


def test_a_moved_run_dir_exports_and_resumes_with_its_own_tokenizer(tmp_path, monkeypatch, capsys):
    pytest.importorskip("safetensors")
    source = tokenizer_folder(tmp_path / "tok")
    run = tmp_path / "run"
    train(tmp_path, monkeypatch, run, tokenizer=source)
    copy = str(run / "tokenizer")
    assert recorded(run / "config.toml")["data"]["tokenizer"] == copy
    assert recorded(run / "checkpoints" / "step_00000002" / "config.toml")["data"]["tokenizer"] == copy

    moved = tmp_path / "elsewhere" / "moved"
    os.makedirs(moved.parent)
    shutil.move(str(run), str(moved))
    os.remove(moved / ".lock")  # this process holds the lock on it until it exits, as the first run's would
    shutil.rmtree(source)  # the tokenizer the run started from is gone too
    os.makedirs(tmp_path / "cwd")
    monkeypatch.chdir(tmp_path / "cwd")
    ckpt = str(moved / "checkpoints" / "step_00000002")
    assert loom_main(["convert", "--from", ckpt, "--to-hf", "out"]) == 0
    exported = json.loads((tmp_path / "cwd" / "out" / "tokenizer.json").read_text())
    assert exported == json.loads((moved / "tokenizer" / "tokenizer.json").read_text())

    # resuming in the moved dir: the copy is the checkpoint's tokenizer, so nothing changed
    cfg = run_config(tmp_path, moved, str(moved / "tokenizer"))
    assert rc.check_checkpoint(ckpt, cfg).line() is None
    trainer = train(tmp_path, monkeypatch, moved, tokenizer=str(moved / "tokenizer"), steps=3)
    out = capsys.readouterr().out
    assert trainer.step == 3 and "resumed from step 2" in out
    assert "resuming with changes: training.steps 2 -> 3\n" in out  # and nothing about the tokenizer
    other = tokenizer_folder(tmp_path / "other", chat_template=None)
    with open(os.path.join(other, "tokenizer.json"), "a") as fh:
        fh.write(" ")  # other bytes
    with pytest.raises(rc.ResumeMismatch, match="data.tokenizer"):
        rc.check_checkpoint(ckpt, run_config(tmp_path, moved, other))

    # the copy gone as well: one line naming the paths it was looked for at
    shutil.rmtree(moved / "tokenizer")
    with pytest.raises(SystemExit) as exit_info:
        loom_main(["convert", "--from", ckpt, "--to-hf", "out2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert (
        f"data.tokenizer = '{copy}': recorded in {ckpt}/config.toml: missing (not at {moved}/tokenizer nor "
        f"at {copy}); pass --data.tokenizer" in err
    )
    with pytest.raises(ConfigError, match=f"missing \\(not at {moved}/tokenizer nor at {copy}\\)"):
        rc.check_checkpoint(ckpt, cfg)
