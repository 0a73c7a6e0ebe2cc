"""Evaluation: perplexity and bits per byte on any data source loom reads, an lm-evaluation-harness backend
(``loom.eval.harness``, registered as ``loom``), and the evaluations a training run makes at ``training.eval_every``
(``loom.eval.hook``). docs/eval.md."""

from __future__ import annotations

from loom.eval.model import EvalModel, load
from loom.eval.perplexity import Perplexity, perplexity, total

__all__ = ["EvalModel", "Perplexity", "load", "perplexity", "total"]
