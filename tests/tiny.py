"""The one tiny training run the tests build on: the ``debug`` model (loom's default flavor) on the embedded
default corpus, 4 steps of 8 sequences of 32 tokens, metrics every step, no TensorBoard, no save at the end.

``tests/conftest.py`` re-exports these; code that runs in other processes (the gloo workers of
``tests/distributed/harness.py``, a ``loom train`` subprocess) imports ``tests.tiny`` itself. Overrides are
dotted keys (``**{"training.steps": 3}``); a value of ``None`` drops the key, so loom's own default applies
(``**{"checkpoint.at_end": None}`` saves at the end again)."""

from __future__ import annotations

TINY = {
    "training.steps": 4,
    "training.seq_len": 32,
    "training.global_batch_size": 8,
    "training.micro_batch_size": 2,
    "optimizer.warmup_steps": 1,
    "metrics.every": 1,
    "metrics.tensorboard": "false",
    "checkpoint.at_end": "false",
}


def tiny_overrides(run_dir=None, cache=None, **overrides) -> dict:
    """The tiny run as dotted overrides: ``run.dir`` and ``data.cache_dir`` when given (paths or strings),
    then ``overrides``."""
    d = dict(TINY)
    if run_dir is not None:
        d["run.dir"] = str(run_dir)
    if cache is not None:
        d["data.cache_dir"] = str(cache)
    d.update(overrides)
    return {k: v for k, v in d.items() if v is not None}


def tiny_args(run_dir=None, cache=None, **overrides) -> list[str]:
    """The same run as ``loom train`` arguments (``--key=value``)."""
    return [f"--{k}={v}" for k, v in tiny_overrides(run_dir, cache, **overrides).items()]


def tiny_config(run_dir=None, cache=None, **overrides):
    """The same run as a resolved ``Config``."""
    from loom.config import build_config

    return build_config(None, {k: str(v) for k, v in tiny_overrides(run_dir, cache, **overrides).items()})
