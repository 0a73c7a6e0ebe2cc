"""Config building: defaults < TOML < overrides, coercion, validation, and the TOML round trip."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from loom.config import Config, ConfigError, build_config, parse_overrides, to_toml
from loom.config.load import all_keys, read_toml
from loom.config.sections import all_sections
from loom.methods import check_config
from loom.resolve import accumulation_steps


def write(tmp_path, text: str, name: str = "c.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error(fn, *args) -> str:
    with pytest.raises(ConfigError) as exc:
        fn(*args)
    return str(exc.value)


def test_defaults_are_valid_and_match_the_dataclasses():
    assert build_config() == Config()


def test_toml_then_overrides_precedence(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\nwarmup_steps = 2\n")
    cfg = build_config(path, parse_overrides(["--training.steps", "3", "--optimizer.lr=2e-3"]))
    assert cfg.training.steps == 3  # command line beats the file
    assert cfg.optimizer.lr == 2e-3
    assert cfg.training.seq_len == 64  # file beats the default
    assert cfg.optimizer.warmup_steps == 2
    assert cfg.training.micro_batch_size == Config().training.micro_batch_size  # default kept


@pytest.mark.parametrize(
    "key,raw,expected",
    [
        ("training.steps", "1_000", 1000),
        ("training.steps", 12.0, 12),  # a TOML float with an integer value
        ("optimizer.lr", 1, 1.0),
        ("optimizer.lr", "3e-4", 3e-4),
        ("training.compile", "yes", True),
        ("training.compile", "OFF", False),
        ("training.compile", True, True),
        ("optimizer.betas", "0.8,0.9", [0.8, 0.9]),
        ("optimizer.betas", "[0.8, 0.99]", [0.8, 0.99]),
        ("optimizer.betas", [0.5, 0.6], [0.5, 0.6]),
    ],
)
def test_coercion(key, raw, expected):
    section, name = key.split(".")
    value = getattr(getattr(build_config(None, {key: raw}), section), name)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    "key,raw,allowed",
    [
        ("training.steps", "2.5", "expected an integer"),
        ("training.steps", True, "expected an integer"),
        ("optimizer.lr", "nan", "expected a finite number"),
        ("optimizer.lr", "inf", "expected a finite number"),
        ("optimizer.lr", False, "expected a finite number"),
        ("training.compile", "2", "expected true or false"),
        ("run.dir", 3, "expected a string"),
        ("optimizer.betas", "[0.9, true]", "expected a list of numbers"),
        ("optimizer.betas", "0.9,x", "expected a list of numbers"),
        ("optimizer.eps", "0", "must be > 0.0"),
        ("data.val_fraction", "0.6", "must be <= 0.5"),
        ("run.device", "tpu", "allowed: auto | cpu | cuda"),
    ],
)
def test_bad_values_name_field_value_and_what_is_allowed(key, raw, allowed):
    msg = error(build_config, None, {key: raw})
    assert msg == f"{key} = {raw!r}: {allowed}" or msg.startswith(f"{key} = ") and msg.endswith(allowed), msg


def test_cross_field_rules(tmp_path):
    assert "expected two numbers in [0, 1)" in error(build_config, None, {"optimizer.betas": "0.9,1.0"})
    assert "expected two numbers" in error(build_config, None, {"optimizer.betas": "0.9"})
    assert "must be <= training.steps (5)" in error(
        checked, {"training.steps": "5", "optimizer.warmup_steps": "6"}
    )
    missing = str(tmp_path / "no-such-model")
    assert error(build_config, None, {"model.init_from": missing}).startswith(
        f"model.init_from = {missing!r}: no such folder"
    )


def checked(overrides: dict):
    """A config built and checked as every command resolves it (the rules relating fields: loom.resolve)."""
    cfg = build_config(None, overrides)
    check_config(cfg)
    return cfg


def test_unknown_keys_suggest_the_nearest():
    assert (
        error(parse_overrides, ["--optimizer.lrr", "1"])
        == "optimizer.lrr: unknown key; did you mean 'optimizer.lr'?"
    )
    assert "sections are run, model, data" in error(parse_overrides, ["--zzz.qqq", "1"])
    # every section is searched: an exact field name elsewhere beats a near name in the typed section
    assert (
        error(parse_overrides, ["--training.lr", "1"])
        == "training.lr: unknown key; did you mean 'optimizer.lr'?"
    )
    assert error(parse_overrides, ["--model.layers", "1"]).endswith("did you mean 'model.n_layers'?")
    assert error(parse_overrides, ["--training.foo", "1"]).endswith(
        "see `loom train --help training` for its fields"
    )
    assert "a section, not a field" in error(parse_overrides, ["--training", "1"])


def test_toml_unknown_section_and_non_table(tmp_path):
    assert "did you mean 'optimizer.lr'" in error(
        read_toml_and_build, write(tmp_path, "[optimiser]\nlr = 1\n")
    )
    assert error(read_toml_and_build, write(tmp_path, "steps = 3\n")).startswith("steps: unknown key")


def read_toml_and_build(path):
    return build_config(path)


def test_toml_values_are_coerced_like_the_command_line(tmp_path):
    path = write(tmp_path, '[training]\ncompile = "true"\nsteps = "19"\n[optimizer]\nlr = 1\n')
    assert read_toml(path) == {"training.compile": "true", "training.steps": "19", "optimizer.lr": 1}
    cfg = build_config(path)
    assert (cfg.training.compile, cfg.training.steps, cfg.optimizer.lr) == (True, 19, 1.0)


def test_to_toml_round_trips_every_field(tmp_path):
    odd = 'dir with "quotes", back\\slash, tab\t, newline\n, \x7f and ünïcödé ☃ 𝔘'
    cfg = build_config(
        None,
        {
            "run.dir": odd,
            "data.source": "a.jsonl:0.7,b.bin:0.3",
            "optimizer.lr": "1e-5",
            "optimizer.betas": "0.8,0.95",
            "training.compile": "true",
            "run.seed": "123",
        },
    )
    path = write(tmp_path, to_toml(cfg), "resolved.toml")
    again = build_config(path)
    assert again == cfg
    assert to_toml(again) == to_toml(cfg)
    assert set(read_toml(path)) == set(all_keys())  # every field is written


def test_flavor_choices_match_the_model_flavors():
    from loom.models.registry import all_flavors

    flavor = next(f for f in dataclasses.fields(all_sections()["model"]) if f.name == "flavor")
    assert tuple(flavor.metadata["choices"]) == tuple(all_flavors())


def test_every_field_has_help_and_a_valid_default():
    for section, cls in all_sections().items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{section}.{f.name} has no help"
            if "choices" in f.metadata:
                assert f.default in f.metadata["choices"], f"{section}.{f.name}"


def test_accumulation_steps():
    t = build_config(None, {"training.global_batch_size": "16", "training.micro_batch_size": "2"}).training
    assert accumulation_steps(t, 1) == 8
    assert accumulation_steps(t, 4) == 2
    msg = error(accumulation_steps, t, 3)
    assert msg == (
        "training.global_batch_size = 16: must be a multiple of micro_batch_size x data-parallel "
        "size = 2 x 3 = 6"
    )


def test_default_warmup_shrinks_to_fit_a_short_run():
    assert build_config(None, {"training.steps": "5"}).optimizer.warmup_steps == 0
    assert build_config(None, {"training.steps": "50"}).optimizer.warmup_steps == 5
    assert build_config(None, {"training.steps": "1000"}).optimizer.warmup_steps == 10
    assert (
        build_config(None, {"training.steps": "5", "optimizer.warmup_steps": "3"}).optimizer.warmup_steps == 3
    )


@pytest.mark.parametrize(
    "recipe",
    sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "*.toml"))),
    ids=os.path.basename,
)
def test_every_recipe_is_a_valid_config(recipe):
    check_config(build_config(recipe))


def test_each_objective_has_its_own_default_run_dir():
    """`loom train` then `loom train --training.objective sft` (the README's order) never share a run dir."""
    from loom.config import build_config

    assert build_config().run.dir == "runs/lm"
    assert build_config(None, {"training.objective": "sft"}).run.dir == "runs/sft"
    assert build_config(None, {"training.objective": "dpo"}).run.dir == "runs/dpo"
    assert build_config(None, {"training.objective": "sft", "run.dir": "mine"}).run.dir == "mine"
