"""Reward functions: Python callables named ``module:function``, called once per batch of completions as
``fn(prompts=[...], completions=[...], completion_ids=[...], **fields)`` where ``fields`` holds every other field of
the prompt rows (one value per completion, e.g. the embedded task's ``answer``), returning one float per
completion (the calling convention of TRL's reward functions, so theirs work here). Several are combined as a
weighted sum; each one's mean and std are logged."""

from __future__ import annotations

import importlib
import inspect
import math
import traceback

import torch

from loom.config.errors import ConfigError, UserError


def load_function(spec: str, field: str = "grpo.rewards"):
    """The callable ``spec`` ('package.module:function') names."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(field, spec, "'module:function' (e.g. loom.rl.arithmetic:exact_answer)")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            field, spec, f"an importable 'module:function' ({type(err).__name__}: {err})"
        ) from None
    if not callable(fn):
        raise ConfigError(field, spec, "a callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # no signature to read (some builtins): the call says
    try:
        signature.bind_partial(prompts=[], completions=[], completion_ids=[])
    except TypeError:
        raise ConfigError(
            field,
            spec,
            f"a reward function takes keyword arguments prompts=, completions=, "
            f"completion_ids= (and the rows' fields, or **kwargs); it has {signature}",
        ) from None
    return fn


class Rewards:
    """Reward functions with weights: ``score`` gives the weighted sum per completion and each function's own."""

    def __init__(self, specs: list[str], weights: list[float] | None = None, extra: tuple = ()):
        """``extra``: (name, callable, weight) sources beside the named functions (the judge: loom.rl.judge)."""
        weights = list(weights) if weights else [1.0] * len(specs)
        if not specs and not extra:
            raise ConfigError("grpo.rewards", "", "at least one 'module:function'")
        if len(weights) != len(specs):
            raise ConfigError(
                "grpo.reward_weights", weights, f"one weight per reward function ({len(specs)})"
            )
        if not all(math.isfinite(w) for w in weights):  # float() reads "nan" and "inf": every total would be
            raise ConfigError("grpo.reward_weights", weights, "finite numbers, one per reward function")
        self.functions = [load_function(s) for s in specs] + [fn for _, fn, _ in extra]
        self.own = len(specs)  # the user's functions come first; the extra sources are loom's
        self.specs = list(specs) + [name for name, _, _ in extra]
        self.names = [s.partition(":")[2] for s in specs] + [name for name, _, _ in extra]
        self.weights = torch.tensor(weights + [w for _, _, w in extra], dtype=torch.float32)

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        fields: dict[str, list],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted total (N,), each function's rewards (N, K)) of N completions, fp32 on the CPU."""
        per = torch.zeros(len(completions), len(self.functions))
        for k, (fn, spec) in enumerate(zip(self.functions, self.specs)):
            try:
                out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **fields)
            except Exception as err:
                if k >= self.own:  # loom's own source (the judge): a bug keeps its traceback
                    raise
                raise raised_error(fn, spec, err) from None
            per[:, k] = torch.tensor(checked_rewards(out, spec, len(completions)))
        return per @ self.weights, per


def raised_error(fn, spec: str, err: Exception) -> UserError:
    """The one line for a reward function that raised: the function, where it is defined, the exception and where
    it was raised (the user's traceback is theirs to reproduce, not spread over the run's log). A TypeError from
    the call itself (no frame of the function's own) is a signature the call does not fit."""
    frames = traceback.extract_tb(err.__traceback__)[1:]  # the first is the call in Rewards.score
    if isinstance(err, TypeError) and not frames:
        return UserError(
            f"grpo.rewards: {spec} cannot be called as a reward function ({err}): it takes "
            "prompts=, completions=, completion_ids= and the rows' fields as keywords"
        )
    code = getattr(inspect.unwrap(fn), "__code__", None)
    defined = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    message = (str(err).strip().splitlines() or [""])[0][:200]
    return UserError(
        f"grpo.rewards: {spec}{defined} raised {type(err).__name__}: {message}{at}: the run stopped; a reward "
        "function returns one number per completion"
    )


def checked_rewards(out, spec: str, n: int) -> list[float]:
    """A reward function's result as n floats, or one line naming the function and what it returned."""
    what = f"grpo.rewards: {spec} returned"
    if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        kind = "None" if out is None else f"a {type(out).__name__}"
        raise UserError(
            f"{what} {kind}: a reward function returns a list of {n} numbers (one per completion)"
        )
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError) as err:
        raise UserError(f"{what} a value that is not a number ({err}): it returns {n} numbers") from None
    if len(values) != n:
        raise UserError(f"{what} {len(values)} rewards for {n} completions (one per completion)")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:  # one NaN makes every advantage of its group NaN: the step would be skipped or stop the run
        raise UserError(
            f"{what} {values[bad[0]]} for completion {bad[0]} ({len(bad)} of {n} not finite): rewards are finite "
            "numbers"
        )
    return values
