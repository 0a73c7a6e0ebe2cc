"""Sampling parameters and the next-token choice from logits: greedy, temperature, top-k, top-p, min-p, repetition
penalty, as transformers applies them (penalty on the logits first, then temperature, top-k, top-p, min-p in that
order), drawn with a seeded ``torch.Generator`` so that the same seed gives the same tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loom.config.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How one ``generate`` call chooses tokens and when each sequence stops.

    ``temperature`` 0: greedy (argmax; the default). ``top_k`` 0, ``top_p`` 1, ``min_p`` 0, ``repetition_penalty``
    1: off. ``stop``: strings that end a sequence (the text returned stops before the string); ``stop_token_ids``:
    ids that end it (the id is the last of ``token_ids``); the model's EOS ids end it unless ``ignore_eos``.
    ``seed``: the draws of one call (None: a fresh seed)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = 0

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        checks = (
            ("max_new_tokens", self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", 0 <= self.temperature < math.inf, "a finite number >= 0 (0 = greedy)"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 = off)"),
            ("min_p", 0 <= self.min_p < 1, "in [0, 1) (0 = off)"),
            ("repetition_penalty", 0 < self.repetition_penalty < math.inf, "a finite number > 0 (1 = off)"),
            # torch takes a negative seed as another one (-1 as 2**64 - 1); the generator adds offsets to it
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "None (a fresh seed) or 0 .. 2**63 - 1"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ConfigError(name, getattr(self, name), allowed)
        if any(not s for s in self.stop):
            raise ConfigError("stop", "", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_(self, **kw) -> SamplingParams:
        from dataclasses import replace

        return replace(self, **kw)


def new_generator(seed: int | None, device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def penalize(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: the logit of every token already in the sequence (prompt included)
    divided by ``penalty`` where positive, multiplied where negative. logits (N, V) fp32, seen (N, V) bool."""
    if seen is None or penalty == 1.0:
        return logits
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf on the removed tokens (at least one token stays).
    logits (N, V) fp32 -> (N, V) fp32."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        floor = params.min_p * probs.max(-1, keepdim=True).values  # (N, 1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def probabilities(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """The distribution a non-greedy draw samples from: logits (N, V) -> probabilities (N, V) fp32."""
    return warp(penalize(logits.float(), seen, params.repetition_penalty), params).softmax(-1)


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, seen: torch.Tensor | None = None
) -> torch.Tensor:
    """The next token of each row: logits (N, V) -> (N,) int64."""
    if params.greedy:
        if seen is None or params.repetition_penalty == 1.0:
            return logits.argmax(-1)  # any float dtype widens to fp32 exactly: the same argmax, no fp32 copy
        return penalize(logits.float(), seen, params.repetition_penalty).argmax(-1)
    return draw(probabilities(logits, params, seen), generator)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row from probs (N, V) -> (N,) int64."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def mark_seen(seen: torch.Tensor | None, tokens: torch.Tensor) -> None:
    """Record tokens (N,) or (N, S) in seen (N, V) (for the repetition penalty)."""
    if seen is not None:
        seen.scatter_(1, tokens.view(tokens.shape[0], -1), True)
