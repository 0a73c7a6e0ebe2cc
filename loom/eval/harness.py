"""An lm-evaluation-harness model backend, registered as ``loom``: any harness task runs on a loom checkpoint, a
Hugging Face folder, or a training run's live model.

- ``loglikelihood``: lm-eval's ``TemplateLM`` encodes (context, continuation) pairs as its Hugging Face backend does
  (trailing spaces of the context move to the continuation; an empty context is the prefix token); each pair is cut
  from the left to ``max_length`` inputs and scored in batches sorted longest first (``loom.eval.scoring``).
- ``loglikelihood_rolling``: every token of the text once, in lm-eval's rolling windows of ``max_length``.
- ``generate_until``: loom's generation engine (``loom.infer.Generator``) on contexts cut from the left to
  ``max_length - max_gen_toks`` tokens, batched by generation settings and sorted longest first; the text is cut at
  the first stop string, as the Hugging Face backend cuts it.

lm-eval 0.4 looks ``--model`` names up in its own registry before any other code runs, and it finds no backends
in other installed packages, so ``lm_eval --model loom`` needs this module imported first:
``python -m loom.eval.harness`` is lm-eval's own command line with the backend registered (``loom eval --tasks``
runs tasks too).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from loom.config.errors import ConfigError, UserError, require
from loom.eval.model import EvalModel, load
from loom.eval.scoring import continuation_window, rolling_windows, score

_model_api = require(
    "lm_eval.api.model", "eval", package="lm-eval", purpose="the lm-evaluation-harness backend"
)
_registry = require("lm_eval.api.registry", "eval", package="lm-eval")
# lm-eval registers its own backends (lazily) only while its registry is empty: before ours joins it
require("lm_eval.models", "eval", package="lm-eval")

NAME = "loom"
DEFAULT_BATCH = 8


def _int(name: str, value, lowest: int) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ConfigError(name, value, "expected an integer") from None
    if out < lowest:
        raise ConfigError(name, value, f"allowed: {lowest} or more")
    return out


def _batch(value) -> int:
    """lm-eval's batch_size: a count, or ``auto`` / ``auto:N`` (here: the default count; loom does not probe
    memory)."""
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH
    return _int("batch_size", value, 1)


class LoomLM(_model_api.TemplateLM):
    """``checkpoint``: a loom checkpoint or Hugging Face folder (lm-eval's ``--model_args checkpoint=PATH``), or
    ``model``: an ``EvalModel`` already in memory (a training run's). ``max_length`` 0: the model's (``load``);
    ``prefix_token_id``: the token before an empty context (default: ``EvalModel.prefix_id``)."""

    backend = "causal"

    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        model: EvalModel | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int | str | None = DEFAULT_BATCH,
        max_length: int | str = 0,
        max_gen_toks: int | str = 256,
        prefix_token_id: int | str | None = None,
        max_batch_size: int | None = None,
    ):
        super().__init__()
        if (checkpoint is None) == (model is None):
            raise ConfigError("checkpoint", checkpoint, "pass exactly one of checkpoint=PATH or an EvalModel")
        self.em = model or load(
            checkpoint, device=device or "auto", dtype=dtype, max_length=_int("max_length", max_length, 0)
        )
        self.batch_size = _batch(batch_size)
        self.max_gen_toks = _int("max_gen_toks", max_gen_toks, 1)
        self._prefix = (
            self.em.prefix_id if prefix_token_id is None else _int("prefix_token_id", prefix_token_id, 0)
        )
        self.tokenizer = self.em.tokenizer
        self._device = self.em.device
        self._generator = None

    # ---- what lm-eval asks of a TemplateLM --------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.em.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self.em.max_length

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs,
    ) -> list[int]:
        """The text's ids as loom tokenizes (nothing added around it; special-token names in the text are text)."""
        ids = list(self.tokenizer.encode(string))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        windows = [continuation_window(ctx, cont, self.max_length) for _, ctx, cont in requests]
        results = score(self.em, windows, override_bs or self.batch_size)
        for (request, _, _), answer in zip(requests, results):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each whole text, every token once (an empty text: 0)."""
        texts = [req.args[0] for req in requests]
        windows, owner = [], []
        for i, text in enumerate(texts):
            mine = rolling_windows(self.tok_encode(text), self.prefix_token_id, self.max_length)
            windows += mine
            owner += [i] * len(mine)
        totals = [0.0] * len(texts)
        for i, (logp, _) in zip(owner, score(self.em, windows, self.batch_size)):
            totals[i] += logp
        for text, value in zip(texts, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), value)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from loom.eval.generate import generate_until

        out = generate_until(self, [req.args for req in requests])
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    def generator(self):
        """loom's generation engine over this model (built on first use)."""
        if self._generator is None:
            from loom.infer import Generator

            if any(hasattr(p, "full_tensor") for p in self.em.model.parameters()):
                raise UserError(
                    "generate_until on a sharded model (FSDP or tensor parallel during training): loom's "
                    "generation engine takes a whole model; generate from the run's checkpoints with "
                    "`loom eval`, or train with data parallelism alone (parallel.dp_replicate)"
                )

            self._generator = Generator.from_model(
                self.em.model,
                self.em.tokenizer,
                eos_ids=self.em.stop_ids,
                compile=False,
                cuda_graphs=False,
                max_batch=self.batch_size,
            )
        return self._generator

    def get_model_info(self) -> dict:
        return {"model": self.em.name, "max_length": self.max_length, "prefix_token_id": self.prefix_token_id}


if __name__ != "__main__":  # run as a script, the module registers itself on import (below)
    _registry.register_model(NAME)(LoomLM)


# ---- running tasks ----------------------------------------------------------------------------------


def task_manager(
    tasks: list[str], include_path: str | None = None, fields: tuple[str, str] = ("--tasks", "--include-path")
):
    """lm-eval's TaskManager for ``tasks``: only ``include_path`` indexed when it holds every one of them (indexing
    lm-eval's own thousands of task files takes a while), else lm-eval's tasks too. An unknown task is one line, and
    so is a file of ``include_path`` that defines a requested task but cannot be loaded (a missing ``include:``).
    A name found in no task file's text is refused without indexing lm-eval's tasks. ``fields``: the names of the
    task list and the folder in the messages (``loom eval``'s options, or training's fields)."""
    from lm_eval.tasks import TaskManager

    names, folder = fields
    if not tasks:
        raise ConfigError(names, "", "name at least one lm-eval task")
    if include_path:
        if not os.path.isdir(include_path):
            raise ConfigError(folder, include_path, "not a folder: a folder of task YAML files")
        _check_task_files(tasks, include_path, folder)
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in own.all_tasks for t in tasks):
            return own
    where = f"lm-eval's tasks{f' or {folder} {include_path}' if include_path else ''}"
    absent = _named_in_no_task_file(tasks, include_path)
    if absent:
        raise ConfigError(names, ",".join(absent), f"no such task in {where}")
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(names, ",".join(unknown), f"no such task in {where}")
    return manager


def _yaml_files(root: str):
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("__pycache__", ".ipynb_checkpoints"))
        yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith(".yaml"))


def _check_task_files(tasks: list[str], include_path: str, folder: str) -> None:
    """A YAML file under ``include_path`` that names a requested task but does not load (lm-eval's index skips it
    silently, and the task would be reported unknown): one line naming the file and why."""
    from lm_eval.tasks._yaml_loader import load_yaml

    for path in _yaml_files(include_path):
        try:
            load_yaml(path, resolve_func=False)
            continue
        except Exception as err:  # yaml's errors, a missing include, an include cycle
            error = err
        try:
            own = load_yaml(path, resolve_func=False, recursive=False)
        except Exception:
            own = {}
        name = own.get("task", own.get("group")) if isinstance(own, dict) else None
        if not isinstance(name, str) or name not in tasks:
            continue
        if isinstance(error, FileNotFoundError):
            reason = f"its include {error.filename} does not exist"
        else:
            reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]}"
        raise ConfigError(folder, path, f"task {name!r} cannot be loaded: {reason}")


def _named_in_no_task_file(names: list[str], include_path: str | None) -> list[str]:
    """The names that occur in the text of no task file (lm-eval's own and ``include_path``'s): such a name is in
    no index (its task, group and tag names are all YAML values), and reading the files takes half a second where
    building lm-eval's index takes several."""
    from lm_eval import tasks as lm_tasks

    left = {name: name.encode() for name in names}
    for root in (include_path, os.path.dirname(lm_tasks.__file__)):
        for path in _yaml_files(root) if root else ():
            with open(path, "rb") as fh:
                text = fh.read()
            left = {name: key for name, key in left.items() if key not in text}
            if not left:
                return []
    return list(left)


def run_tasks(
    lm: LoomLM,
    tasks: list[str],
    *,
    include_path: str | None = None,
    manager=None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    gen_kwargs: dict | str | None = None,
    log_samples: bool = False,
    seed: int = 1234,
) -> dict | None:
    """lm-eval's ``simple_evaluate`` of ``tasks`` (lm-eval's own, or task YAMLs under ``include_path``; ``manager``:
    a ``task_manager`` already built) on ``lm``: lm-eval's results dict (None on a process whose LOCAL_RANK is not
    0: lm-eval reports on one). ``limit``: examples per task (a fraction below 1)."""
    evaluator = require("lm_eval.evaluator", "eval", package="lm-eval")
    try:
        return evaluator.simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager or task_manager(tasks, include_path),
            gen_kwargs=gen_kwargs,
            log_samples=log_samples,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    except (
        ConnectionError
    ) as err:  # datasets' (OfflineModeIsEnabled too): a task's dataset, offline and not cached
        reason = (str(err).strip().splitlines() or [""])[0][:160]
        raise ConfigError(
            "--tasks",
            ",".join(tasks),
            f"a task's dataset is not cached and cannot be fetched ({type(err).__name__}: {reason}); run once "
            "where the network reaches the Hugging Face Hub, or use local task YAMLs (--include-path)",
        ) from None


def flat_metrics(results: dict, prefix: str = "") -> dict[str, float]:
    """``{prefix + "task/metric": value}`` of every number in a results dict (a filter other than ``none`` kept
    in the name: ``exact_match,strict-match`` -> ``exact_match/strict-match``; standard errors left out)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, flt = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = metric if flt in ("", "none") else f"{metric}/{flt}"
            out[f"{prefix}{task}/{name}"] = float(value)
    return out


def main(argv: list[str] | None = None) -> Any:
    """lm-eval's command line with the ``loom`` backend registered: ``python -m loom.eval.harness --model loom
    --model_args checkpoint=PATH --tasks ...`` takes every option ``lm_eval`` takes."""
    cli = require("lm_eval.__main__", "eval", package="lm-eval")
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    return cli.cli_evaluate()


if __name__ == "__main__":
    from loom.eval import harness  # the module lm-eval's registry knows, not this __main__ copy

    sys.exit(harness.main())
