"""Build a ``Config`` from defaults < TOML file < CLI overrides, and validate it."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import math
import os
import tomllib
import typing
from typing import Any

from loom.config.errors import ConfigError
from loom.config.sections import SECTIONS, Config, all_sections, config_dict, section_class, section_names


def all_keys(generic_only: bool = False) -> list[str]:
    """Every ``section.field``; ``generic_only``: the config's own sections' (no method module imported)."""
    sections = SECTIONS if generic_only else all_sections()
    return [f"{s}.{f.name}" for s, cls in sections.items() for f in dataclasses.fields(cls)]


def _unknown_key(key: str) -> ConfigError:
    """One line: the nearest known keys (``nearest_keys``), else where to look."""
    near = nearest_keys(key)
    section, _, name = key.partition(".")
    sections = section_names()
    if name and section not in sections and not difflib.get_close_matches(section, sections, n=1, cutoff=0.6):
        near = [
            k for k in near if k.partition(".")[2] == name
        ]  # no section like it: only the field's exact name
    if key in sections:  # a section where a field belongs: `--training 5`, or `training = 5` outside a table
        hint = f"a section, not a field: set its fields as {key}.FIELD (see `loom train --help {key}`)"
    elif near:
        hint = "did you mean " + " or ".join(f"'{k}'" for k in near) + "?"
    elif section in sections:
        hint = f"see `loom train --help {section}` for its fields"
    else:
        hint = f"sections are {', '.join(sections)}"
    return ConfigError(key, None, f"unknown key; {hint}", show_value=False)


def nearest_keys(key: str) -> list[str]:
    """Known ``section.field`` keys an unknown ``key`` most likely meant, searched over every section: an exact field
    name first (``training.lr`` -> ``optimizer.lr``; every section that has it), else the closest field name (ties to
    the typed section), else the closest dotted name where the typed section is no section (``training_steps``).
    Matching the whole dotted name first would favour any field of the typed section: its name is half the string."""
    section, dot, name = key.partition(".")
    if not dot:
        section, name = "", key
    # the config's own sections first: a method's are imported (its module) only for a key no generic one matches
    if section not in SECTIONS or not (near := _nearest_in(section, name, key, all_keys(generic_only=True))):
        near = _nearest_in(section, name, key, all_keys())
    return near


def _nearest_in(section: str, name: str, key: str, known: list[str]) -> list[str]:
    keys = [k.split(".", 1) for k in known]
    exact = [f"{s}.{f}" for s, f in keys if f == name]
    if exact:
        return exact[:3]
    fields = difflib.get_close_matches(name, sorted({f for _, f in keys}), n=1, cutoff=0.6)
    if fields:
        owners = [s for s, f in keys if f == fields[0]]
        owner = (
            section
            if section in owners
            else max(owners, key=lambda s: difflib.SequenceMatcher(None, section, s).ratio())
        )
        return [f"{owner}.{fields[0]}"]
    if section in section_names():
        return []
    return difflib.get_close_matches(key, known, n=1, cutoff=0.6)


def _field(key: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    cls = section_class(section)
    if cls is None or not name:
        raise _unknown_key(key)
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise _unknown_key(key)


def _type_of(f: dataclasses.Field) -> type:
    # the generic sections first: a method's module is imported only for a field of its own section
    owners = itertools.chain(
        SECTIONS.values(), (section_class(n) for n in section_names() if n not in SECTIONS)
    )
    owner = next(cls for cls in owners if any(g is f for g in dataclasses.fields(cls)))
    return typing.get_type_hints(owner)[f.name]


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def coerce(key: str, value: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or raise ConfigError."""
    f = _field(key)
    typ = _type_of(f)
    text = isinstance(value, str)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if text and value.lower() in _TRUE | _FALSE:
                return value.lower() in _TRUE
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, int):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if text:
                return int(value.replace("_", ""))
            raise ValueError
        if typ is float:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            number = float(value)
            if not math.isfinite(number):
                raise ValueError
            return number
        if typ is str:
            if isinstance(value, str):
                return value
            raise ValueError
        if typ is list:
            if text:
                value = json.loads(value) if value.strip().startswith("[") else value.split(",")
            if not isinstance(value, list) or any(isinstance(v, bool) for v in value):
                raise ValueError
            numbers = [float(v) for v in value]
            if not all(math.isfinite(v) for v in numbers):
                raise ValueError
            return numbers
    except (ValueError, TypeError, json.JSONDecodeError):
        pass
    name = {
        bool: "true or false",
        int: "an integer",
        float: "a finite number",
        str: "a string",
        list: "a list of numbers",
    }[typ]
    raise ConfigError(key, value, f"expected {name}")


def validate_field(key: str, value: Any) -> None:
    meta = _field(key).metadata
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(key, value, "allowed: " + " | ".join(map(str, choices)))
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None:
        if meta.get("min_exclusive") and not value > lo:
            raise ConfigError(key, value, f"must be > {lo}")
        if not meta.get("min_exclusive") and value < lo:
            raise ConfigError(key, value, f"must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(key, value, f"must be <= {hi}")


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``--section.field value`` or ``--section.field=value`` pairs, in order."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError("<command line>", arg, "expected --section.field value")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and "." in args[i + 1][2:]):
                raise ConfigError(key, None, "missing value after the option", show_value=False)
            value = args[i + 1]
            i += 2
        _field(key)  # unknown keys fail here, with a suggestion
        out[key] = value
    return out


def read_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError("--config", path, "file not found")
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as err:
        raise ConfigError("--config", path, f"cannot be read ({err.strerror})") from None
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:  # TOML is UTF-8 text: a binary file or another encoding is not TOML
        raise ConfigError(
            "--config",
            path,
            f"not UTF-8 text (byte 0x{data[err.start]:02x} at byte offset "
            f"{err.start}); expected a TOML file saved as UTF-8",
        ) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("--config", path, f"not valid TOML ({err})") from None
    flat: dict[str, Any] = {}
    for section, body in raw.items():
        if not isinstance(body, dict):
            raise _unknown_key(section)
        for name, value in body.items():
            flat[f"{section}.{name}"] = value
    return flat


def build_config(file: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults < TOML file < overrides; every value coerced and checked on its own (loom.resolve checks the rules
    that relate fields)."""
    values: dict[str, Any] = {}
    if file:
        values.update(read_toml(file))
    values.update(overrides or {})
    cfg = Config()
    for key, raw in values.items():
        value = coerce(key, raw)
        validate_field(key, value)
        section, name = key.split(".", 1)
        setattr(getattr(cfg, section), name, value)
    if "optimizer.warmup_steps" not in values:  # the default warmup shrinks to fit a short run
        cfg.optimizer.warmup_steps = min(cfg.optimizer.warmup_steps, cfg.training.steps // 10)
    # each objective its own run dir: `loom train`, then `... objective sft`, both run
    if "run.dir" not in values:
        cfg.run.dir = f"runs/{cfg.training.objective}"
    if "data.document_positions" not in values and cfg.training.objective == "sft":
        cfg.data.document_positions = True  # packed conversations never attend to each other
    check_fields(cfg)
    return cfg


def check_fields(cfg: Config) -> None:
    """A single field's rules that the choices/min/max metadata cannot say (rules relating fields: loom.resolve)."""
    if cfg.model.init_from and not os.path.isdir(cfg.model.init_from):
        raise ConfigError(
            "model.init_from",
            cfg.model.init_from,
            "no such folder; expected a Hugging Face Llama folder (config.json + safetensors)",
        )
    b = len(cfg.optimizer.betas)
    if b != 2 or not all(0.0 <= x < 1.0 for x in cfg.optimizer.betas):
        raise ConfigError("optimizer.betas", cfg.optimizer.betas, "expected two numbers in [0, 1)")
    if cfg.checkpoint.resume not in ("none", "auto") and not os.path.exists(cfg.checkpoint.resume):
        raise ConfigError(
            "checkpoint.resume", cfg.checkpoint.resume, "allowed: none | auto | an existing checkpoint path"
        )
    split = cfg.parallel.pp_layers_per_stage
    if split:
        if not all(float(n).is_integer() and n >= 0 for n in split):
            raise ConfigError("parallel.pp_layers_per_stage", split, "expected whole numbers >= 0")
        cfg.parallel.pp_layers_per_stage = [int(n) for n in split]
    profile_window(cfg.metrics)


def profile_window(metrics) -> tuple[int, int] | None:
    """``metrics.profile_steps`` as (first, last) optimizer steps, None when empty (off), else a ConfigError."""
    text = metrics.profile_steps.strip()
    if not text:
        return None
    first, sep, last = (part.strip() for part in text.partition(":"))
    whole = all(n.isascii() and n.isdecimal() for n in (first, last))
    if sep and whole and 1 <= int(first) <= int(last):
        return int(first), int(last)
    raise ConfigError(
        "metrics.profile_steps",
        metrics.profile_steps,
        "allowed: '' (off) or 'A:B', whole numbers with 1 <= A <= B (optimizer steps, 1-based)",
    )


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return config_dict(cfg)


def to_toml(cfg: Config) -> str:
    """Serialize the resolved config as TOML (flat sections of scalars and lists)."""
    lines: list[str] = []
    for section, body in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for name, value in body.items():
            lines.append(f"{name} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(v: Any) -> str:
    """A value as written in a TOML file (also the defaults of the config reference)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return _toml_string(str(v))


def _toml_string(s: str) -> str:
    """A TOML basic string: backslash, quote and control characters escaped, everything else as is."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
