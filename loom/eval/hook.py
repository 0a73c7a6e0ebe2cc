"""The evaluations a training run makes at every validation point (``training.eval_every``) besides the validation
loss: a Python callable (``training.eval_hook = "module:function"``) and lm-evaluation-harness tasks
(``training.eval_tasks``), on the live model. Their numbers join that step's record in metrics.jsonl (and
TensorBoard, W&B, MLflow) as ``eval/<name>``.

Every rank runs them with the same inputs, so a sharded model (FSDP, tensor parallel) runs its collectives in
step; rank 0 logs. They run in eval mode under the run's autocast, and leave the random number generators as they
found them, so training continues exactly as without them.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom.config.errors import ConfigError, UserError, require
from loom.eval.model import EvalModel


@dataclass
class EvalContext:
    """What ``training.eval_hook`` receives: the live model as an ``EvalModel`` (model, tokenizer, device,
    max_length = training.seq_len, prefix token EOS, the run's autocast), the step just taken, the run dir, and
    whether this is the rank that logs. The callable returns ``{name: number}``."""

    em: EvalModel
    step: int
    run_dir: str
    is_main: bool

    @property
    def model(self) -> torch.nn.Module:
        return self.em.model

    @property
    def tokenizer(self):
        return self.em.tokenizer

    def harness(self, **kwargs):
        """lm-eval's backend over the live model (``loom.eval.harness.LoomLM``), for a callable that calls
        lm-eval itself."""
        from loom.eval.harness import LoomLM

        return LoomLM(model=self.em, **kwargs)


@contextlib.contextmanager
def kept_rng(device: torch.device):
    """Torch's (CPU and this CUDA device's), Python's and NumPy's generators as they were before the block
    (lm-eval seeds all three)."""
    import random

    import numpy as np

    state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        random.setstate(state)
        np.random.set_state(np_state)


def import_callable(spec: str, field: str = "training.eval_hook") -> Callable:
    """``module:function`` (``package.module:object.attr`` too) imported, or a one-line ConfigError."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(field, spec, "expected 'module:function' (a module Python can import)")
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(field, spec, f"module {module!r} cannot be imported ({err})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(field, spec, f"{module} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(field, spec, f"{attr} is not callable")
    return obj


def check_one_argument(fn: Callable, spec: str, field: str = "training.eval_hook") -> None:
    """The hook is called with one argument (an EvalContext): a callable that cannot take it is one line at start,
    not a traceback at the first validation point."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no signature to read: the call says
    try:
        signature.bind(object())
    except TypeError:
        raise ConfigError(
            field,
            spec,
            f"an eval hook takes one argument (the EvalContext: model, step, run_dir); "
            f"this one has {signature}",
        ) from None


def task_names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


class TrainingEvals:
    """``training.eval_hook`` and ``training.eval_tasks``, checked when the run is built (an unknown callable or a
    missing lm-eval stops the start, not step N); called at each validation point."""

    def __init__(self, training, parallel, run_dir: str, is_main: bool, sharded: bool = False):
        self.training, self.run_dir, self.is_main, self.tp = training, run_dir, is_main, parallel.tp
        self.hook = import_callable(training.eval_hook) if training.eval_hook else None
        if self.hook is not None:
            check_one_argument(self.hook, training.eval_hook)
        self.tasks = task_names(training.eval_tasks)
        if self.tasks:
            require("lm_eval", "eval", package="lm-eval", purpose="training.eval_tasks")
            from loom.eval.harness import task_manager

            self.manager = task_manager(
                self.tasks,
                training.eval_tasks_include or None,
                ("training.eval_tasks", "training.eval_tasks_include"),
            )
            self._task_dict = self._load_tasks()
            if sharded:
                self._refuse_generation()

    def _load_tasks(self) -> dict:
        """The tasks with their datasets, loaded before the first step: a task whose dataset is neither cached nor
        reachable (no network) is one line now, not a traceback at the first validation point."""
        from lm_eval.tasks import get_task_dict

        try:
            return get_task_dict(self.tasks, self.manager)
        except Exception as err:  # datasets' ConnectionError, OfflineModeIsEnabled, FileNotFoundError, ...
            reason = (str(err).strip().splitlines() or [""])[0][:160]
            raise ConfigError(
                "training.eval_tasks",
                ",".join(self.tasks),
                "cannot be loaded before training: its "
                f"dataset is not cached and cannot be fetched ({type(err).__name__}: {reason}); run "
                "once where the network reaches the Hugging Face Hub, or use local task YAMLs "
                "(training.eval_tasks_include)",
            ) from None

    def _refuse_generation(self) -> None:
        """loom's generation engine takes a whole model: generate_until tasks are refused on a sharded one (FSDP,
        tensor parallel) before the run starts (the loaded tasks' output types)."""

        def output_types(tasks: dict):
            for name, task in tasks.items():
                if isinstance(task, dict):
                    yield from output_types(task)
                else:
                    yield getattr(name, "group_name", name), task.OUTPUT_TYPE

        generating = [name for name, kind in output_types(self._task_dict) if kind == "generate_until"]
        if generating:
            raise ConfigError(
                "training.eval_tasks",
                ",".join(generating),
                "generate text, and loom's generation "
                "engine takes a whole model, not one sharded by FSDP or tensor parallelism: train with "
                "data parallelism alone (parallel.dp_replicate) or evaluate the checkpoints with "
                "`loom eval`",
            )

    def __call__(
        self,
        model: torch.nn.Module,
        tokenizer,
        step: int,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> dict[str, float]:
        """``{"eval/<name>": value}`` of the callable's numbers and the tasks' metrics at ``step``."""
        em = EvalModel(
            model,
            tokenizer,
            device,
            self.training.seq_len,
            tokenizer.eos_id,
            name=f"step {step}",
            autocast=autocast,
            width_multiple=self.tp,
        )
        out: dict[str, float] = {}
        with kept_rng(device), torch.no_grad():
            if self.hook is not None:
                out.update(self._hook_values(self.hook(EvalContext(em, step, self.run_dir, self.is_main))))
            if self.tasks:
                out.update(self._task_values(em))
        return out

    def _hook_values(self, values) -> dict[str, float]:
        if not isinstance(values, dict):
            raise UserError(
                f"training.eval_hook {self.training.eval_hook}: returned a {type(values).__name__}; "
                "it must return a dict of names to numbers"
            )
        out = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(
                    f"training.eval_hook {self.training.eval_hook}: {name!r} is a "
                    f"{type(value).__name__}; the values must be numbers"
                )
            out[f"eval/{name}"] = float(value)
        return out

    def _task_values(self, em: EvalModel) -> dict[str, float]:
        from loom.eval.harness import LoomLM, flat_metrics, run_tasks

        t = self.training
        results = run_tasks(
            LoomLM(model=em),
            self.tasks,
            manager=self.manager,
            limit=t.eval_tasks_limit or None,
            num_fewshot=None if t.eval_tasks_fewshot < 0 else t.eval_tasks_fewshot,
        )
        if results is None:  # another process than LOCAL_RANK 0, which reports
            return {}
        return {k: v for k, v in flat_metrics(results, "eval/").items() if math.isfinite(v)}


def training_evals(
    cfg, run_dir: str, is_main: bool, model: torch.nn.Module | None = None
) -> TrainingEvals | None:
    """The run's evaluations besides the validation loss; None when it asks for none (or never evaluates).
    ``model``: the run's (parallelized) model, whose sharding decides whether generation tasks can run."""
    t = cfg.training
    if not t.eval_every or not (t.eval_hook or task_names(t.eval_tasks)):
        return None
    sharded = model is not None and any(hasattr(p, "full_tensor") for p in model.parameters())
    return TrainingEvals(t, cfg.parallel, run_dir, is_main, sharded)
