"""What a resumed run may change: every config field is ``must match``, ``applied`` or ``free``.

* must match: the checkpoint cannot hold anything else (the weights' shapes, the token stream and its order,
  the optimizer's state): a change stops the run before any weight is read, naming each field with the
  checkpoint's value and this run's;
* applied: takes effect from the resumed step on (LR and schedule, steps, batch, sequence length, evaluation,
  precision, ...) and is printed once, ``resuming with changes: optimizer.lr 0.001 -> 0.01, ...``, with a note
  where it cannot be honoured exactly;
* free: where and how the same math runs (layout, kernels, outputs); changes silently.

Each field's kind and why live with the field (``opt(resume=...)`` in loom/config/sections.py).
``python -m loom.train.resume_changes > docs/resume.md`` writes the table (a test keeps it current, another that
every field has a kind).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loom.checkpoint.manager import STATE, list_complete, verify
from loom.config.errors import ConfigError, SharedError, UserError
from loom.config.load import all_keys, coerce
from loom.config.sections import (
    APPLIED,
    FREE,
    MUST_MATCH,
    Config,
    OptimizerConfig,
    TrainingConfig,
    all_sections,
    config_dict,
)
from loom.data import build_tokenizer
from loom.resolve import resolve_model_args
from loom.train.large_batch import group_options
from loom.train.run_dir import missing_tokenizer, recorded_values


def rules() -> dict[str, tuple[str, str]]:
    """Every config field's (kind, why), from its ``opt(resume=...)`` (loom.config.sections), in the config's order."""
    return {
        f"{section}.{f.name}": f.metadata["resume"]
        for section, cls in all_sections().items()
        for f in dataclasses.fields(cls)
        if "resume" in f.metadata
    }


# the fields that resolve to the model's shape: other spellings of the same model are not a change of it
MODEL_FIELDS = (
    "model.flavor",
    "model.init_from",
    "model.vocab_size",
    "model.n_layers",
    "model.tie_embeddings",
    "model.moe_experts",
    "model.moe_ffn_dim",
    "model.sliding_window",
    "model.mtp_depth",
    "model.first_k_dense",
)
# LlamaArgs fields a resumed run may change (applied or free fields above): not part of "the same model"
_ARGS_FREE = {
    "max_seq_len",
    "residual_init",
    "moe_top_k",
    "moe_aux_loss",
    "attention",
    "fused_norm",
    "fused_rope",
    "fused_swiglu",
    "fused_loss",
    "moe_bias_speed",
    "mtp_weight",
}


def kind_of(key: str) -> str:
    return (
        all_sections()[key.partition(".")[0]]
        .__dataclass_fields__[key.partition(".")[2]]
        .metadata["resume"][0]
    )


# ---- the two configs --------------------------------------------------------------------------------


def config_values(cfg: Config) -> dict[str, Any]:
    """``{"section.field": value}`` of a config."""
    return {f"{s}.{k}": v for s, body in config_dict(cfg).items() for k, v in body.items()}


def checkpoint_values(folder: str | None) -> dict[str, Any] | None:
    """The config a checkpoint was written with (its ``config.toml``), None where it has none. Fields it lacks
    (written before they existed) take their defaults; fields this version does not know are left out. Its
    recorded paths are resolved where the files are now (``loom.train.run_dir.recorded_values``)."""
    values = _recorded(folder)
    return None if values is None else recorded_values(folder, values)


def _recorded(folder: str | None) -> dict[str, Any] | None:
    """``checkpoint_values`` as written in the file, paths unresolved."""
    path = os.path.join(folder, "config.toml") if folder else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    values = config_values(Config())
    for section, body in raw.items():
        for name, value in body.items() if isinstance(body, dict) else ():
            key = f"{section}.{name}"
            if key in values:
                try:
                    values[key] = coerce(key, value)
                except ConfigError:
                    values[key] = value
    return values


def _show(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if v else '""'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return repr(v)


def _same_tokenizer(a: str, b: str) -> bool:
    """Whether two ``data.tokenizer`` values name tokenizer.json files with the same bytes (a file or a folder
    holding one: the run dir's copy and its source are the same)."""
    if a in ("", "byte") or b in ("", "byte"):
        return a in ("", "byte") and b in ("", "byte")
    a, b = (os.path.join(p, "tokenizer.json") if os.path.isdir(p) else p for p in (a, b))
    try:
        if os.path.getsize(a) != os.path.getsize(b):
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def _same(key: str, old: Any, new: Any) -> bool:
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return list(old) == list(new)
    if old == new:
        return True
    if not (isinstance(old, str) and isinstance(new, str)):
        return False
    if key == "data.tokenizer":
        return _same_tokenizer(old, new)
    # recorded absolute (loom.train.run_dir.record_run_files): the same path given relative to this directory
    return key in _PATHS and bool(old and new) and os.path.realpath(old) == os.path.realpath(new)


_PATHS = ("model.init_from", "data.chat_template", "lora.init_from")  # recorded as absolute paths


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    note: str = ""

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}" + (f" ({self.note})" if self.note else "")


@dataclass
class ResumeChanges:
    """What resuming from ``folder`` (at ``step``) changes; ``unchecked`` says why nothing was compared."""

    folder: str
    step: int
    applied: list[Change] = field(default_factory=list)
    unchecked: str = ""

    def line(self) -> str | None:
        """The one line rank 0 prints, None when nothing changed."""
        if self.unchecked:
            return f"resuming without comparing configs: {self.unchecked}"
        if not self.applied:
            return None
        return "resuming with changes: " + ", ".join(map(str, self.applied))


class ResumeMismatch(UserError):
    """This run's config cannot continue the checkpoint (a must-match field changed)."""


def _note(key: str, old: dict, new: dict) -> str:
    """Printed beside an applied change where it is not simply in effect from the next step."""
    if key == "training.seq_len":
        return "not exact: windows re-cut, each source goes on from the same fraction of its epoch in a new order"
    if key == "model.residual_init":
        return "initialisation only: no effect on the resumed weights"
    if key == "training.loss_scale_init":
        return (
            "the loss scale restarts from it"
            if new["training.dtype"] == "float16"
            else "no effect: training.dtype is not float16"
        )
    if key == "training.dtype" and new[key] == "float16":
        return f"the loss scale starts at {_show(new['training.loss_scale_init'])}"
    return ""


def compare(
    old: dict[str, Any],
    cfg: Config,
    *,
    folder: str,
    step: int,
    model_difference: Callable[[], list[Change] | None] | None = None,
) -> ResumeChanges:
    """The applied changes from the checkpoint's config ``old`` to ``cfg``, or ResumeMismatch naming every
    must-match field that differs. ``model_difference()``: the resolved models' differences ([] = the same
    model, None = unknown), asked when a model field differs (``n_layers 0`` is the flavor's count: the same
    model) or the model comes from ``model.init_from`` (whose folder may have changed)."""
    new = config_values(cfg)
    applied, refused = [], []
    for key, (kind, _) in rules().items():
        if kind == FREE or key not in old or _same(key, old[key], new[key]):
            continue
        change = Change(key, old[key], new[key], _note(key, old, new))
        (applied if kind == APPLIED else refused).append(change)
    model = [c for c in refused if c.key in MODEL_FIELDS]
    if model_difference is not None and (model or new["model.init_from"]):
        diff = model_difference()
        if diff == [] and model:
            refused = [c for c in refused if c not in model]
            applied += [dataclasses.replace(c, note="the same model") for c in model]
            order = list(rules())
            applied.sort(key=lambda c: order.index(c.key))
        elif diff and not model:
            refused += diff
    if refused:
        raise ResumeMismatch(
            f"cannot resume from {folder} (step {step}): {', '.join(map(str, refused))}: must match the checkpoint "
            "(the weights' shapes, the data stream or the optimizer state; docs/resume.md): pass the checkpoint's "
            "values, or start a new run in another run.dir"
        )
    if cfg.training.steps < step:
        raise ResumeMismatch(
            f"training.steps = {cfg.training.steps}: the checkpoint {folder} is at step {step}; "
            f"allowed >= {step}"
        )
    return ResumeChanges(folder, step, applied)


def model_difference(
    old: dict[str, Any], cfg: Config, tokenizer=None, kernels=None, args=None
) -> list[Change] | None:
    """How the checkpoint's model differs from ``cfg``'s, resolved as the trainer builds them (flavor, then
    the model.* overrides, vocabulary from the tokenizer): [] for the same model, None when the checkpoint's
    cannot be resolved here (its model.init_from folder is gone, ...). ``args``: ``cfg``'s model as the run
    resolved it (else resolved here)."""
    if tokenizer is None:
        tokenizer = build_tokenizer(cfg.data.tokenizer)
    then = copy.deepcopy(cfg)
    for key in MODEL_FIELDS:
        section, name = key.split(".")
        setattr(getattr(then, section), name, old[key])
    try:
        before = resolve_model_args(then, tokenizer, kernels)
    except (ConfigError, UserError, OSError, ValueError, KeyError):
        return None
    now = args if args is not None else resolve_model_args(cfg, tokenizer, kernels)
    return [
        Change(f"model ({f.name})", getattr(before, f.name), getattr(now, f.name))
        for f in dataclasses.fields(now)
        if f.name not in _ARGS_FREE and getattr(before, f.name) != getattr(now, f.name)
    ]


def check_checkpoint(folder: str, cfg: Config, tokenizer=None, kernels=None, args=None) -> ResumeChanges:
    """``cfg`` against the config checkpoint ``folder`` was written with; reads small files only, so it runs
    before any weight is loaded (``args``: ``cfg``'s model as the run resolved it, else resolved here). Weights-only checkpoints (``loom convert --from-hf``) start a run at step 0
    with nothing of a run to continue: only their model shape is compared (``check_imported_shape``)."""
    with open(os.path.join(folder, STATE)) as fh:
        state = json.load(fh)
    if state.get("model_only"):
        check_imported_shape(folder, cfg, tokenizer, kernels, args)
        return ResumeChanges(folder, 0)
    step = int(state["step"])
    raw = _recorded(folder)
    if raw is None:
        return ResumeChanges(folder, step, unchecked=f"{folder} has no config.toml")
    missing = missing_tokenizer(
        folder, raw, "restore the run's tokenizer copy, or start a new run in another run.dir"
    )
    if missing is not None:
        raise missing
    old = recorded_values(folder, raw)
    return compare(
        old,
        cfg,
        folder=folder,
        step=step,
        model_difference=lambda: model_difference(old, cfg, tokenizer, kernels, args),
    )


def check_imported_shape(folder: str, cfg: Config, tokenizer=None, kernels=None, args=None) -> None:
    """A weights-only checkpoint loads only into a model of its own shape: another one is a ResumeMismatch that
    says how to take the shape from the checkpoint (``--model.init_from``), before any weight is read."""
    from loom.checkpoint.hf.config import HF_CONFIG_COPY, llama_args_from_hf_config

    kept = os.path.join(folder, HF_CONFIG_COPY)
    if not os.path.isfile(kept):
        return
    with open(kept) as fh:
        stored = llama_args_from_hf_config(json.load(fh), "checkpoint.resume", kept)
    now = (
        args
        if args is not None
        else resolve_model_args(cfg, tokenizer or build_tokenizer(cfg.data.tokenizer), kernels)
    )
    diff = [
        f"{f.name} {getattr(stored, f.name)!r} -> {getattr(now, f.name)!r}"
        for f in dataclasses.fields(now)
        if f.name not in _ARGS_FREE and getattr(stored, f.name) != getattr(now, f.name)
    ]
    if diff:
        raise ResumeMismatch(
            f"checkpoint.resume {folder}: a weights-only checkpoint (loom convert --from-hf) of "
            f"another model than this run's ({', '.join(diff)}): start from it with --model.init_from "
            f"{folder}, which takes the model's shape from it"
        )


def _candidate(cfg: Config) -> str | None:
    """The checkpoint ``checkpoint.resume`` will most likely pick, found without hashing: an explicit path, or
    for ``auto`` the newest complete one whose files have their recorded sizes."""
    mode = cfg.checkpoint.resume
    if mode == "none":
        return None
    ckpt_dir = cfg.checkpoint.dir or os.path.join(cfg.run.dir, "checkpoints")
    candidates = [mode] if mode != "auto" else [folder for _, folder in reversed(list_complete(ckpt_dir))]
    for folder in candidates:
        try:
            verify(folder, check_hash=False)
        except UserError:
            continue  # damaged: the trainer's verification names it (or falls back past it)
        return folder
    return None


def check_before_start(cfg: Config, tokenizer=None, kernels=None, args=None) -> None:
    """``loom train``'s precheck: a checkpoint this run cannot resume from is refused before any worker starts
    (the trainer checks the checkpoint it really picks again, before loading it). ``tokenizer``, ``kernels``,
    ``args``: the run's, as the precheck resolved them (else resolved here)."""
    folder = _candidate(cfg)
    if folder is None:
        return
    try:
        check_checkpoint(folder, cfg, tokenizer, kernels, args)
    except (OSError, json.JSONDecodeError, tomllib.TOMLDecodeError):
        return  # an unreadable small file: the trainer's hash check names it


def on_main(check: Callable[[], Any], is_main: bool, share: Callable[[Any], Any]) -> Any:
    """``check()`` on rank 0 only; its answer on every rank, or its user error raised on every rank (a
    ``SharedError``: printed by rank 0 only). ``share(obj)``: rank 0's ``obj`` everywhere."""
    answer = None
    if is_main:
        try:
            answer = ("ok", check())
        except (ConfigError, UserError) as err:
            answer = ("error", str(err))
    kind, value = share(answer)
    if kind == "error":
        raise SharedError(value)
    return value


# ---- applying the changes once the checkpoint is loaded -----------------------------------------------


def loader_state(state: dict, old: dict[str, Any] | None) -> dict:
    """The loader's state with the ``seq_len`` it was saved at (older checkpoints lack it: their config's)."""
    if "seq_len" in state or old is None:
        return state
    return {**state, "seq_len": old["training.seq_len"]}


def apply_optimizer_config(optimizer, cfg: OptimizerConfig) -> None:
    """This run's betas, eps and weight decay into every parameter group of ``optimizer`` (an
    ``OptimizerParts``): loading a checkpoint brings back the saved run's. Decay on matrices only, as
    ``build_optimizer`` groups them. The LR is the schedule's (``SchedulerParts.load_state_dict``)."""
    for opt in optimizer.optimizers:
        for group in opt.param_groups:
            group["betas"], group["eps"] = tuple(cfg.betas), cfg.eps
            group["weight_decay"] = cfg.weight_decay if any(p.ndim >= 2 for p in group["params"]) else 0.0
            group.update(group_options(cfg.name, cfg))  # lamb / lars: their own hyperparameters


def restore_loss_scale(scaler, old: dict[str, Any] | None, training: TrainingConfig) -> None:
    """After ``scaler.load_state_dict``: no scaling outside float16 (a float16 checkpoint's scale would
    otherwise multiply the gradients); into float16, or with another ``loss_scale_init``, the scale restarts
    from ``loss_scale_init``; the skipped-step count stays."""
    if not scaler.enabled:
        scaler.scale, scaler.good_steps = 1.0, 0
        return
    if old is not None and (
        old["training.dtype"] != "float16" or old["training.loss_scale_init"] != training.loss_scale_init
    ):
        scaler.scale, scaler.good_steps = training.loss_scale_init, 0


# ---- the document ------------------------------------------------------------------------------------


def markdown() -> str:
    lines = [
        "# Resuming with another config",
        "",
        "Generated from each field's `opt(resume=...)` in `loom/config/sections.py` by `python -m "
        "loom.train.resume_changes`; the rows follow the config's order (docs/config.md).",
        "",
        "A resumed run (`--checkpoint.resume auto` or a path) compares its resolved config with the "
        "checkpoint's `config.toml`, field by field, before any weight is read:",
        "",
        "* **must match**: the checkpoint cannot hold anything else (the weights' shapes, the token stream "
        "and its order, the optimizer state). A change exits with code 2 naming every such field with the "
        "checkpoint's value and this run's, e.g. `cannot resume from runs/a/checkpoints/step_00000020 (step "
        "20): model.n_layers 0 -> 4: must match the checkpoint ...`. `loom train` finds it before any "
        "worker starts. Another spelling of the same model is not refused: `model.n_layers 2` where the "
        "checkpoint has 0 (the `debug` flavor's 2 layers) is printed with the note `the same model`.",
        "* **applied**: takes effect from the resumed step on and is printed once, e.g. `resuming with "
        "changes: training.steps 30 -> 40, optimizer.lr 0.001 -> 0.01`, with a note in parentheses where "
        "it cannot be honoured exactly (`training.seq_len`) or has no effect. The LR schedule keeps only "
        "its position (optimizer steps taken) from the checkpoint: peak, shape, warmup and length are this "
        "run's, so the next step's LR is the new schedule's at that step. `training.steps` must be at least "
        "the checkpoint's step. Another `global_batch_size` continues the same sample order from the same "
        "sample; another `seq_len` re-cuts the windows, and each source goes on from the same fraction of "
        "the same epoch in a new order.",
        "* **free**: where and how the same math runs (layout, kernels, outputs); it changes silently. A "
        "checkpoint saved under one layout loads under any other.",
        "",
        "Weights-only checkpoints (`loom convert --from-hf`) start a run at step 0 and are not compared. "
        "After a resume at step N, `metrics.jsonl` keeps the records up to step N: those a run wrote past "
        "the checkpoint are dropped (the file is rewritten atomically), so each step appears once; "
        "TensorBoard hides them (`purge_step`). A rollback inside a run (`training.nonfinite = rollback`) "
        "rewinds both the same way (`MetricsLogger.rewind`).",
        "",
    ]
    for kind in (MUST_MATCH, APPLIED, FREE):
        lines += [f"## {kind}", "", "| key | why / what happens |", "|---|---|"]
        lines += [f"| `{key}` | {why} |" for key, (k, why) in rules().items() if k == kind]
        lines.append("")
    return "\n".join(lines)


def unclassified() -> list[str]:
    """Config fields whose ``opt()`` gives no ``resume`` (a test keeps this empty)."""
    return [k for k in all_keys() if k not in rules()]


if __name__ == "__main__":
    print(markdown())
