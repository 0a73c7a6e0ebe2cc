"""Build a ``Config`` from defaults < TOML file < CLI overrides, and validate it."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import tomllib
import typing
from typing import Any

from loom.config.errors import ConfigError
from loom.config.sections import SECTIONS, Config


def all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown_key(key: str) -> ConfigError:
    near = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{near[0]}'?" if near else f"; sections are {', '.join(SECTIONS)}"
    return ConfigError(key, None, f"unknown key{hint}", show_value=False)


def _field(key: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    cls = SECTIONS.get(section)
    if cls is None or not name:
        raise _unknown_key(key)
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise _unknown_key(key)


def _type_of(f: dataclasses.Field) -> type:
    hints = typing.get_type_hints(SECTIONS_BY_FIELD[id(f)])
    return hints[f.name]


SECTIONS_BY_FIELD: dict[int, type] = {
    id(f): cls for cls in SECTIONS.values() for f in dataclasses.fields(cls)
}

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
    name = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
            list: "a list of numbers"}[typ]
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
        raise ConfigError("--config", path, f"not UTF-8 text (byte 0x{data[err.start]:02x} at byte offset "
                          f"{err.start}); expected a TOML file saved as UTF-8") from None
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
    """Defaults < TOML file < overrides; every value coerced and checked."""
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
    check_cross_fields(cfg)
    return cfg


def check_cross_fields(cfg: Config) -> None:
    """Rules that involve more than one field (or the file system) and need no process group."""
    if cfg.model.init_from and not os.path.isdir(cfg.model.init_from):
        raise ConfigError("model.init_from", cfg.model.init_from,
                          "no such folder; expected a Hugging Face Llama folder (config.json + safetensors)")
    if cfg.model.init_from and cfg.model.n_layers:
        raise ConfigError("model.n_layers", cfg.model.n_layers, "must be 0 with model.init_from (the checkpoint "
                          "fixes the layer count)")
    b = len(cfg.optimizer.betas)
    if b != 2 or not all(0.0 <= x < 1.0 for x in cfg.optimizer.betas):
        raise ConfigError("optimizer.betas", cfg.optimizer.betas, "expected two numbers in [0, 1)")
    t = cfg.training
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError("training.global_batch_size", t.global_batch_size,
                          f"must be a multiple of training.micro_batch_size ({t.micro_batch_size})")
    if t.eval_every and cfg.data.val_fraction == 0:
        raise ConfigError("training.eval_every", t.eval_every, "needs held-out data, but data.val_fraction is 0: "
                          "set data.val_fraction > 0 (e.g. 0.01) or training.eval_every 0")
    if cfg.checkpoint.resume not in ("none", "auto") and not os.path.exists(cfg.checkpoint.resume):
        raise ConfigError("checkpoint.resume", cfg.checkpoint.resume,
                          "allowed: none | auto | an existing checkpoint path")
    check_parallel_fields(cfg)
    if cfg.optimizer.warmup_steps > t.steps:
        raise ConfigError("optimizer.warmup_steps", cfg.optimizer.warmup_steps,
                          f"must be <= training.steps ({t.steps})")
    window = profile_window(cfg.metrics)
    if window and window[1] > t.steps:
        raise ConfigError("metrics.profile_steps", cfg.metrics.profile_steps,
                          f"the last profiled step must be <= training.steps ({t.steps})")


def profile_window(metrics) -> tuple[int, int] | None:
    """``metrics.profile_steps`` as (first, last) optimizer steps, None when empty (off), else a ConfigError."""
    text = metrics.profile_steps.strip()
    if not text:
        return None
    first, sep, last = (part.strip() for part in text.partition(":"))
    whole = all(n.isascii() and n.isdecimal() for n in (first, last))
    if sep and whole and 1 <= int(first) <= int(last):
        return int(first), int(last)
    raise ConfigError("metrics.profile_steps", metrics.profile_steps,
                      "allowed: '' (off) or 'A:B', whole numbers with 1 <= A <= B (optimizer steps, 1-based)")


PIPELINE_SCHEDULES_SINGLE = ("gpipe", "1f1b")  # one stage per rank
PIPELINE_SCHEDULES_V = ("zbv", "dualpipev")  # two stages per rank, V-shaped
PIPELINE_SCHEDULES_SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # input/weight grads apart


def stages_per_rank(parallel) -> int:
    """Pipeline stages each pp rank holds: ``parallel.pp_virtual_stages`` or the schedule's own."""
    if parallel.pp_virtual_stages:
        return parallel.pp_virtual_stages
    return 1 if parallel.pp_schedule in PIPELINE_SCHEDULES_SINGLE else 2


def check_parallel_fields(cfg: Config) -> None:
    """Parallel options that contradict each other or the training section (no world size needed)."""
    p, t = cfg.parallel, cfg.training
    v = stages_per_rank(p)
    if p.pp_schedule in PIPELINE_SCHEDULES_SINGLE and v != 1:
        raise ConfigError("parallel.pp_virtual_stages", p.pp_virtual_stages,
                          f"pp_schedule {p.pp_schedule} runs one stage per rank: allowed 0 or 1 "
                          "(interleaved_1f1b, looped_bfs, interleaved_zb, zbv, dualpipev run several)")
    if p.pp_schedule in PIPELINE_SCHEDULES_V and v != 2:
        raise ConfigError("parallel.pp_virtual_stages", p.pp_virtual_stages,
                          f"pp_schedule {p.pp_schedule} is V-shaped: exactly 2 stages per rank (allowed 0 or 2)")
    split = p.pp_layers_per_stage
    if split:
        if not all(float(n).is_integer() and n >= 0 for n in split):
            raise ConfigError("parallel.pp_layers_per_stage", split, "expected whole numbers >= 0")
        p.pp_layers_per_stage = [int(n) for n in split]
        if len(split) != p.pp * v:
            raise ConfigError("parallel.pp_layers_per_stage", p.pp_layers_per_stage,
                              f"expected one entry per pipeline stage: pp x stages per rank = {p.pp} x {v} = "
                              f"{p.pp * v}")
    if p.pp > 1 and t.compile and p.pp_schedule in PIPELINE_SCHEDULES_SPLIT_BACKWARD:
        raise ConfigError("parallel.pp_schedule", p.pp_schedule,
                          "splits input and weight gradients, which torch.compile does not support: set "
                          "training.compile false or use gpipe | 1f1b | interleaved_1f1b | looped_bfs")
    if p.async_tp and p.tp == 1:
        raise ConfigError("parallel.async_tp", True, "needs parallel.tp > 1")
    if p.async_tp and not t.compile:
        raise ConfigError("parallel.async_tp", True, "needs training.compile true (the pass runs in the compiler)")
    if p.cp > 1:
        if t.seq_len % (2 * p.cp):
            raise ConfigError("parallel.cp", p.cp, f"training.seq_len {t.seq_len} must split into 2 x cp = {2 * p.cp} "
                              "equal chunks (each cp rank holds two: balanced causal work)")
    if p.cpu_offload and (p.tp > 1 or p.pp > 1):
        raise ConfigError("parallel.cpu_offload", True, "supported with data parallelism only (tp = pp = 1)")
    if t.float8 != "none" and p.tp > 1:
        raise ConfigError("training.float8", t.float8, "not supported with parallel.tp > 1 yet: allowed none there")
    if t.float8 != "none" and t.dtype != "bfloat16":
        raise ConfigError("training.float8", t.float8, f"needs training.dtype bfloat16 (got {t.dtype})")
    if cfg.model.fused_norm == "true" and p.tp > 1:
        raise ConfigError("model.fused_norm", True, "not supported with parallel.tp > 1 (sequence-parallel norms run "
                          "on DTensors): allowed auto | false there")
    if cfg.model.fused_loss == "true" and (p.tp > 1 or p.pp > 1):
        raise ConfigError("model.fused_loss", True, "not supported with parallel.tp > 1 or parallel.pp > 1 (vocab-"
                          "sharded or stage-split output): allowed auto | false there")


def accumulation_steps(training, dp_size: int) -> int:
    """Micro-batches per rank per optimizer step, or a ConfigError when the global batch does not split."""
    per_pass = training.micro_batch_size * dp_size
    if training.global_batch_size % per_pass:
        raise ConfigError("training.global_batch_size", training.global_batch_size,
                          f"must be a multiple of micro_batch_size x data-parallel size = "
                          f"{training.micro_batch_size} x {dp_size} = {per_pass}")
    return training.global_batch_size // per_pass


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """Serialize the resolved config as TOML (flat sections of scalars and lists)."""
    lines: list[str] = []
    for section, body in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for name, value in body.items():
            lines.append(f"{name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
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
