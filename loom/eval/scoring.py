"""Log-likelihood of token windows, batched: the one computation behind perplexity, bits per byte and the
harness backend's loglikelihood requests.

A window is a token sequence whose last ``n`` tokens are scored: the model reads ``ids[:-1]`` and each of the
last ``n`` tokens is predicted from everything before it. Windows are sorted longest first and right-padded into
batches; causal attention means the padding never reaches a real position, so a window scores the same in any
batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from loom.eval.model import EvalModel


@dataclass(frozen=True)
class Window:
    ids: list[int]  # the model reads ids[:-1]
    n: int  # the last n tokens of ids are scored

    def __post_init__(self):
        assert 1 <= self.n < len(self.ids), f"a window scores 1..{len(self.ids) - 1} tokens, not {self.n}"


def continuation_window(context: list[int], continuation: list[int], max_length: int) -> Window:
    """The window scoring ``continuation`` after ``context``, cut from the left to ``max_length`` inputs (as
    lm-eval's Hugging Face backend: ``(context + continuation)[-(max_length + 1):]``)."""
    if not continuation or len(continuation) > max_length:
        raise ValueError(
            f"a continuation of {len(continuation)} tokens: allowed 1..{max_length} (the model's max length)"
        )
    return Window((context + continuation)[-(max_length + 1) :], len(continuation))


def rolling_windows(tokens: list[int], prefix_id: int, max_length: int) -> list[Window]:
    """Windows that score every token of ``tokens`` exactly once, the first after ``prefix_id``, each with as
    much context as ``max_length`` inputs hold: the first window predicts the first ``max_length`` tokens, each
    later one the next ``max_length`` (fewer at the end) after the tokens just before them. lm-eval's
    ``loglikelihood_rolling`` windows (``get_rolling_token_windows`` with context_len 1, made disjoint)."""
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    out = [Window([prefix_id] + tokens[:first], first)]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_length)
        end = done + n
        out.append(Window(tokens[end - max_length - 1 : end], n))
        done = end
    return out


@torch.no_grad()
def score(em: EvalModel, windows: list[Window], batch_size: int = 8) -> list[tuple[float, bool]]:
    """(log-probability of the scored tokens in nats, whether each is the model's argmax) of every window, in the
    order given. Longest windows first, ``batch_size`` a batch (the first batch shows whether memory suffices)."""
    assert batch_size >= 1
    for w in windows:
        if len(w.ids) - 1 > em.max_length:
            raise ValueError(
                f"a window of {len(w.ids) - 1} inputs is longer than the model's max length ({em.max_length})"
            )
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].ids))
    out: list[tuple[float, bool] | None] = [None] * len(windows)
    for start in range(0, len(order), batch_size):
        picked = order[start : start + batch_size]
        for i, result in zip(picked, _score_batch(em, [windows[i] for i in picked])):
            out[i] = result
    return out  # type: ignore[return-value]


def _score_batch(em: EvalModel, rows: list[Window]) -> Iterable[tuple[float, bool]]:
    width = max(len(w.ids) for w in rows) - 1
    width = -(-width // em.width_multiple) * em.width_multiple  # right padding changes no real position
    inputs = torch.zeros(len(rows), width, dtype=torch.int64)  # (B, S): right padding (any id) after each row
    for r, w in enumerate(rows):
        inputs[r, : len(w.ids) - 1] = torch.tensor(w.ids[:-1], dtype=torch.int64)
    with em.autocast():
        logits = em.model(inputs.to(em.device))  # (B, S, V)
    if hasattr(logits, "full_tensor"):  # a tensor-parallel model's vocabulary-sharded logits
        logits = logits.full_tensor()
    for r, w in enumerate(rows):
        end = len(w.ids) - 1
        logp = logits[r, end - w.n : end].float().log_softmax(-1)  # (n, V)
        target = torch.tensor(w.ids[-w.n :], dtype=torch.int64, device=logp.device)  # (n,)
        picked = logp.gather(-1, target[:, None])  # (n, 1)
        yield float(picked.sum()), bool((logp.argmax(-1) == target).all())


def bits(nats: float) -> float:
    return nats / math.log(2)
