"""A CLI that explains itself: ``loom --version``, ``loom train --help [SECTION]`` from the config reference,
``--print-config`` (the resolved config as TOML), ``--dry-run`` (every start-up check and the plan, nothing
written), and unknown keys answered with the nearest key of any section. All in-process (no console script)."""

from __future__ import annotations

import dataclasses
import os
import tomllib

import pytest

from loom.cli.main import main as loom_main
from loom.config import build_config, to_toml
from loom.config.load import toml_value
from loom.config.reference import SECTION_HELP, markdown, section_help
from loom.config.sections import all_sections
from tests.tiny import tiny_args

SECTIONS = all_sections()  # the config's own and the registered methods' sections

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    """A plain single process, whatever launched pytest."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


def run(capsys, *argv: str) -> str:
    """stdout of a ``loom`` call that must succeed (exit 0)."""
    assert loom_main(list(argv)) == 0
    return capsys.readouterr().out


def user_error(capsys, *argv: str) -> str:
    """The one stderr line of a ``loom`` call that must fail as a user error (exit 2, nothing on stdout)."""
    with pytest.raises(SystemExit) as exit_:
        loom_main(list(argv))
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1 and out == "", err
    assert lines[0].startswith("loom: error: ")
    return lines[0]


# ---- --version --------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_pyprojects_with_torchs(capsys, flag):
    from importlib.metadata import version

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]["version"]
    out = run(capsys, flag).strip()
    assert out.startswith(f"loom {project} (torch {version('torch')}, Python ")
    assert len(out.splitlines()) == 1


def test_loom_version_attribute_is_the_same():
    import loom

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        assert loom.__version__ == tomllib.load(fh)["project"]["version"]


# ---- loom train --help [SECTION] --------------------------------------------------------


def test_every_section_has_a_description():
    assert set(SECTION_HELP) <= set(SECTIONS)  # a method's own section describes itself (its docstring)
    assert all(section_help(name) for name in SECTIONS)


def test_help_lists_every_section_and_points_to_the_reference(capsys):
    out = run(capsys, "train", "--help")
    assert out.startswith("usage: loom train")
    lines = out.splitlines()
    for name in SECTIONS:
        assert any(line.split()[:1] == [name] and section_help(name) in line for line in lines), name
    assert "docs/config.md" in out and "loom train --help SECTION" in out
    for option in ("--print-config", "--dry-run", "--nproc-per-node", "--config"):
        assert option in out
    assert run(capsys, "train", "--config", "x.toml", "-h") == out  # wherever it stands


@pytest.mark.parametrize("section", list(SECTIONS))
def test_help_section_lists_every_field_with_its_default(capsys, section):
    out = run(capsys, "train", "--help", section)
    assert out.startswith(f"[{section}]  {section_help(section)}")
    for f in dataclasses.fields(SECTIONS[section]):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert f"  {section}.{f.name} = {toml_value(default)}" in out, f.name
        assert f.metadata["help"].split()[0] in out
    if section == "training":
        assert 'training.dtype = "float32"  (float32 | bfloat16 | float16)' in out
        assert "training.steps = 200  (>= 1)" in out
    assert run(capsys, "train", f"--help={section}") == out
    assert run(capsys, "train", "--help", f"{section}.anything") == out  # a dotted key: its section


def test_help_and_docs_read_the_same_rows():
    doc = markdown()
    assert '| `training.dtype` | `"float32"` | `float32` \\| `bfloat16` \\| `float16` |' in doc
    assert SECTION_HELP["parallel"][1:] in doc


def test_unknown_section_suggests_the_nearest(capsys):
    line = user_error(capsys, "train", "--help", "optimiser")
    assert "'optimiser'" in line and "did you mean 'optimizer'?" in line
    assert "sections are run, model" in user_error(capsys, "train", "--help", "zzz")


# ---- unknown keys: the nearest of any section -------------------------------------------


@pytest.mark.parametrize(
    "arg,near",
    [
        ("--training.lr", "'optimizer.lr'"),  # an exact field name in another section
        ("--training.seed", "'run.seed'"),
        ("--training.dir", "'run.dir' or 'checkpoint.dir'"),
        ("--training.stpes", "'training.steps'"),  # a typo in the typed section
        ("--optimiser.lr", "'optimizer.lr'"),  # a typo in the section
        ("--training.warmup", "'optimizer.warmup_steps'"),
        ("--lr", "'optimizer.lr'"),  # no section
        ("--training_steps", "'training.steps'"),
    ],
)
def test_unknown_key_suggests_across_sections(capsys, arg, near):
    line = user_error(capsys, "train", arg, "1")
    assert line == f"loom: error: {arg[2:]}: unknown key; did you mean {near}?"


def test_unknown_key_without_a_near_one(capsys, tmp_path):
    assert user_error(capsys, "train", "--training.foo", "1").endswith(
        "training.foo: unknown key; see `loom train --help training` for its fields"
    )
    assert "sections are run, model, data" in user_error(capsys, "train", "--zzz.qqq", "1")
    toml = tmp_path / "t.toml"
    toml.write_text("[training]\nlr = 0.1\n")
    assert user_error(capsys, "train", "--config", str(toml)).endswith("did you mean 'optimizer.lr'?")


def test_misspelt_option_names_the_option(capsys):
    assert user_error(capsys, "train", "--dryrun").endswith(
        "--dryrun: unknown option; did you mean '--dry-run'? (see `loom train --help`)"
    )
    assert "did you mean '--print-config'?" in user_error(capsys, "train", "--print-conifg")


# ---- --print-config ---------------------------------------------------------------------


def test_print_config_is_the_resolved_config_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    toml = tmp_path / "train.toml"
    toml.write_text("[training]\nsteps = 50\nseq_len = 64\n[optimizer]\nlr = 0.01\n")
    out = run(
        capsys,
        "train",
        "--config",
        str(toml),
        "--print-config",
        "--training.steps",
        "7",
        "--nproc-per-node",
        "2",
    )
    want = build_config(str(toml), {"training.steps": "7"})
    assert out == to_toml(want)
    parsed = tomllib.loads(out)
    # overrides < file < defaults
    assert parsed["training"]["steps"] == 7 and parsed["training"]["seq_len"] == 64
    assert parsed["optimizer"]["lr"] == 0.01 and parsed["run"]["dir"] == "runs/lm"
    (tmp_path / "printed.toml").write_text(out)
    assert build_config(str(tmp_path / "printed.toml")) == want  # it reads back as the same config
    assert sorted(os.listdir(tmp_path)) == ["printed.toml", "train.toml"]  # no run dir


# ---- --dry-run --------------------------------------------------------------------------


def test_dry_run_prints_the_plan_and_writes_nothing(capsys, tmp_path, monkeypatch):
    from loom.cli.preflight import built_params, load_config, precheck

    monkeypatch.chdir(tmp_path)
    args = tiny_args(tmp_path / "run", **{"run.device": "cpu"})
    out = run(capsys, "train", *args, "--dry-run")
    run_ = precheck(load_config(args)[0], 1)
    params = built_params(run_.model_args)[0]
    assert params == sum(p.numel() for p in _debug_model(run_.model_args).parameters())
    assert "layout:    single (world 1)" in out
    assert f"flavor debug: {params:,} parameters" in out
    assert (
        "8 sequences x 32 tokens = 256 tokens per optimizer step (micro-batch 2 x 4 accumulation steps" in out
    )
    assert "per rank at a step's peak" in out and "MiB" in out
    assert "not created" in out
    assert os.listdir(tmp_path) == []  # no run dir, no lock, no cache


def _debug_model(args):
    import torch

    from loom.models.llama import Llama

    with torch.device("meta"):
        return Llama(args)


def test_dry_run_plans_for_nproc_per_node(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = run(
        capsys,
        "train",
        *tiny_args(tmp_path / "run", **{"run.device": "cpu"}),
        "--nproc-per-node",
        "2",
        "--dry-run",
    )
    assert "on 2 ranks" in out and "(world 2: dp_shard=2)" in out
    assert "micro-batch 2 x 2 accumulation steps x 2 data-parallel" in out
    assert os.listdir(tmp_path) == []


def test_dry_run_refuses_what_a_start_refuses(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = user_error(
        capsys,
        "train",
        *tiny_args(tmp_path / "run"),
        "--nproc-per-node",
        "2",
        "--training.global_batch_size",
        "6",
        "--dry-run",
    )
    assert "training.global_batch_size = 6" in line
    (tmp_path / "file").write_text("")
    assert "run.dir" in user_error(capsys, "train", *tiny_args(tmp_path / "file" / "run"), "--dry-run")
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.slow
def test_dry_run_counts_the_imported_model(capsys, tmp_path, monkeypatch):
    """With model.init_from the plan counts the folder's model, not the flavor's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=384,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    hf = transformers.LlamaForCausalLM(cfg)
    hf.save_pretrained(tmp_path / "hf")
    monkeypatch.chdir(tmp_path)
    out = run(
        capsys, "train", *tiny_args(tmp_path / "run"), "--model.init_from", str(tmp_path / "hf"), "--dry-run"
    )
    assert f"model.init_from {tmp_path / 'hf'}: {hf.num_parameters():,} parameters (3 layers, dim 32" in out
    assert sorted(os.listdir(tmp_path)) == ["hf"]
