"""Speculative decoding: a cheap proposer guesses k tokens per row, the target model checks all of them in one
forward of k + 1 tokens, and each round keeps the longest agreeing prefix plus one token of the target's own.

- ``PromptLookup(k, max_ngram, min_ngram)``: the guess continues the last earlier occurrence of the sequence's
  trailing n-gram (longest n first) in the prompt and the text generated so far; nothing to load, no model run.
- ``DraftModel(path_or_model, k)``: a smaller model with the same tokenizer runs k decode steps (its own cache and
  graphs, ``loom.infer.engine``); its vocabulary is cut or padded to the target's.

Verification (``verify``): greedy keeps a draft while it equals the target's argmax and then takes the target's
argmax, so the output is token for token what target-only greedy decoding gives. Sampling uses rejection sampling
(Leviathan et al. 2023, Chen et al. 2023): draft d drawn from q is kept with probability min(1, p(d) / q(d)); at the
first rejection the token is drawn from max(0, p - q) renormalized; when all k are kept one more comes from p. Every
kept token then follows the target's distribution p (with the call's temperature, top-k, top-p, min-p and
repetition penalty). Prompt lookup's guess is a point mass (q(d) = 1): kept with probability p(d), else drawn
from p without d. The draft model proposes from its logits with the call's sampling but no repetition penalty (any
q keeps the output exact; the penalty only shapes p).

Cache bookkeeping: slot = position, so a rejected tail needs no undo: the slots past a row's position are never
seen and are overwritten by the next round. The draft model's first step of each round feeds the last two tokens
(the one before the pending token too), so a round that kept all k guesses, whose last guess the draft never saw,
leaves no gap in its cache."""

from __future__ import annotations

import time

import torch

from loom.config.errors import ConfigError
from loom.infer.engine import SCRATCH, Engine, Stats
from loom.infer.sampling import (
    SamplingParams,
    draw,
    mark_seen,
    new_generator,
    penalize,
    probabilities,
    sample,
    warp,
)


def _check_k(k: int) -> int:
    if not 1 <= k < SCRATCH:
        raise ConfigError("speculative k", k, f"an integer in [1, {SCRATCH - 1}]")
    return k


def _step_seen(seen: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor | None:
    """The penalty's token sets at each of the k + 1 verified positions: position i has also seen drafts < i.
    seen (B, V), drafts (B, k) -> (B, k + 1, V)."""
    if seen is None:
        return None
    out = seen[:, None].repeat(1, drafts.shape[1] + 1, 1)
    for i in range(drafts.shape[1]):
        out[:, i + 1 :].scatter_(2, drafts[:, i, None, None].expand(-1, out.shape[1] - i - 1, 1), True)
    return out


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator,
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits (B, k + 1, V) at the pending token and the k drafts (B, k); q (B, k, V): the draft
    distributions (None: point masses on the drafts). Returns (kept (B,): how many drafts each row keeps, next
    (B,): the token that follows them)."""
    bsz, k = drafts.shape
    seen_at = _step_seen(seen, drafts)
    flat = logits.float().reshape(bsz * (k + 1), -1)
    seen_flat = None if seen_at is None else seen_at.reshape(bsz * (k + 1), -1)
    rows = torch.arange(bsz, device=drafts.device)
    if params.greedy:
        target = penalize(flat, seen_flat, params.repetition_penalty).argmax(-1).view(bsz, k + 1)
        kept = (drafts == target[:, :k]).long().cumprod(1).sum(1)  # (B,)
        return kept, target[rows, kept]
    p = probabilities(flat, params, seen_flat).view(bsz, k + 1, -1)  # (B, k + 1, V)
    p_d = p[:, :k].gather(2, drafts[..., None])[..., 0]  # (B, k)
    q_d = torch.ones_like(p_d) if q is None else q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(bsz, k, generator=generator, device=drafts.device)
    kept = (u * q_d < p_d).long().cumprod(1).sum(1)  # (B,)
    at = p[
        rows, kept
    ]  # (B, V): the target's distribution where the first rejection is (or after the last draft)
    if q is None:
        minus = torch.zeros_like(at).scatter_(1, drafts[rows, kept.clamp(max=k - 1), None], 1.0)
    else:
        minus = q[rows, kept.clamp(max=k - 1)]
    residual = torch.where((kept < k)[:, None], (at - minus).clamp(min=0), at)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), at)  # p == q exactly: never rejected
    return kept, draw(residual, generator)


class _Ngrams:
    """One row's tokens and, for each n, where the continuation of every n-gram's latest occurrence starts."""

    def __init__(self, tokens: list[int], min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        for t in tokens:
            self.add(t)

    def add(self, token: int) -> None:
        self.tokens.append(token)
        end = len(self.tokens) - 1  # the new token continues the n-gram just before it
        for n in range(self.min_n, self.max_n + 1):
            if end >= n:
                self.index[n][tuple(self.tokens[end - n : end])] = end

    def propose(self, k: int) -> list[int] | None:
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(self.tokens) < n:
                continue
            start = self.index[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                guess = self.tokens[start : start + k]
                return guess + [guess[-1]] * (k - len(guess))
        return None


class PromptLookup:
    """Prompt-lookup (n-gram) speculation: k guesses continuing the latest earlier occurrence of the trailing
    n-gram, n from ``max_ngram`` down to ``min_ngram``; a row without one guesses its last token (not counted as
    proposed)."""

    def __init__(self, k: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        self.k = _check_k(k)
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError("ngram", f"{min_ngram}..{max_ngram}", "1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def run(self, engine: Engine, prompts, params, sequences) -> Stats:
        return speculate(engine, prompts, params, sequences, self)

    # the proposer interface of ``speculate``
    def start(self, prompts: list[list[int]], reserve: int, params: SamplingParams) -> None:
        self._rows = [_Ngrams(p, self.min_ngram, self.max_ngram) for p in prompts]

    def propose(self, pending: torch.Tensor, pending_host: list[int], pos: torch.Tensor, done: list[bool]):
        guesses, real = [], []
        for row, token, finished in zip(self._rows, pending_host, done):
            if not finished:
                row.add(token)
            guess = None if finished else row.propose(self.k)
            real.append(guess is not None)
            guesses.append(guess or [token] * self.k)
        return torch.tensor(guesses, dtype=torch.long, device=pending.device), None, real

    def accepted(
        self, kept: torch.Tensor, kept_host: list[int], drafts_host: list[list[int]], done: list[bool]
    ) -> None:
        for row, m, guess, finished in zip(self._rows, kept_host, drafts_host, done):
            if not finished:
                for t in guess[:m]:
                    row.add(t)

    def advance(self, prev: torch.Tensor, running: torch.Tensor) -> None:
        pass  # the rows' n-grams take the pending token when the next round starts


class DraftModel:
    """Draft-model speculation: ``draft`` (a path ``Generator`` loads, a ``Generator``, or a loom model on the
    target's device) proposes k tokens per round with its own cache (and CUDA graphs on CUDA)."""

    def __init__(self, draft, k: int = 4, **load):
        self.k = _check_k(k)
        self._draft, self._load = draft, load
        self.engine: Engine | None = None

    def _engine(self, target: Engine) -> Engine:
        if self.engine is None:
            from loom.infer.generator import Generator

            draft = self._draft
            if isinstance(draft, str):
                dtype = self._load.pop("dtype", target.dtype)
                device = self._load.pop("device", str(target.device))
                draft = Generator(draft, device=device, dtype=dtype, tp=False, **self._load)
            model = draft.model if isinstance(draft, Generator) else draft
            self.engine = (
                draft.engine
                if isinstance(draft, Generator)
                else Engine(model, compile=target.compile, cuda_graphs=target.cuda_graphs)
            )
        return self.engine

    def run(self, engine: Engine, prompts, params, sequences) -> Stats:
        self._target = engine
        return speculate(engine, prompts, params, sequences, self)

    def start(self, prompts: list[list[int]], reserve: int, params: SamplingParams) -> None:
        draft = self._engine(self._target)
        draft.start(prompts, reserve)
        self._params = params.with_(repetition_penalty=1.0)
        self._generator = new_generator(None if params.seed is None else params.seed + 1, draft.device)
        self._vocab = self._target.vocab_size
        last = [p[-1] for p in prompts]
        self._prev = torch.tensor(
            last, dtype=torch.long, device=draft.device
        )  # the token before the pending one

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits (B, V_draft) -> (token (B,), q (B, V_target) or None for greedy)."""
        logits = logits.float()
        vd = logits.shape[-1]
        if vd > self._vocab:
            logits = logits[:, : self._vocab]
        elif vd < self._vocab:
            logits = torch.nn.functional.pad(logits, (0, self._vocab - vd), value=float("-inf"))
        if self._params.greedy:
            return logits.argmax(-1), None
        q = warp(logits, self._params).softmax(-1)
        return draw(q, self._generator), q

    def propose(self, pending: torch.Tensor, pending_host: list[int], pos: torch.Tensor, done: list[bool]):
        draft = self.engine
        offsets = torch.arange(-1, 1, device=draft.device)
        logits = draft.step(torch.stack([self._prev, pending], 1), pos[:, None] + offsets)[:, -1]  # (B, V)
        drafts, qs = [], []
        for i in range(self.k):
            token, q = self._choose(logits)
            drafts.append(token)
            qs.append(q)
            if i + 1 < self.k:
                logits = draft.step(token[:, None], (pos + i + 1)[:, None])[:, 0]
        q = None if self._params.greedy else torch.stack(qs, 1)  # (B, k, V)
        return torch.stack(drafts, 1), q, [not d for d in done]

    def accepted(self, kept: torch.Tensor, kept_host, drafts_host, done) -> None:
        pass  # the draft's cache needs no undo (slot = position)

    def advance(self, prev: torch.Tensor, running: torch.Tensor) -> None:
        """The token before each running row's new pending token: the next round's first step feeds it again."""
        self._prev = torch.where(running, prev, self._prev)


@torch.no_grad()
def speculate(engine: Engine, prompts: list[list[int]], params: SamplingParams, sequences, proposer) -> Stats:
    """The decode loop of ``Engine.generate`` with ``proposer``'s k guesses verified per target forward."""
    t0 = time.perf_counter()
    k = proposer.k
    logits, tokens, lens = engine.start(prompts, params.max_new_tokens + k + 1)
    proposer.start(prompts, params.max_new_tokens + k + 1, params)
    generator = new_generator(params.seed, engine.device)
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(len(prompts), logits.shape[-1], dtype=torch.bool, device=engine.device)
        mark_seen(seen, tokens)
    stats = Stats(prompts=len(prompts), prompt_tokens=int(sum(len(p) for p in prompts)))
    pending = engine.share(sample(logits, params, generator, seen))  # (B,) the first new token of every row
    mark_seen(seen, pending)
    pending_host = pending.tolist()
    stats.prefill_seconds = time.perf_counter() - t0
    for seq, token in zip(sequences, pending_host):
        seq.add(token)
        stats.new_tokens += 1
    pos = lens.clone()  # (B,) the pending token's position
    steps = torch.arange(k + 1, device=engine.device)
    running, running_for = (
        None,
        None,
    )  # (B,) bool on the device: the rows not done, and the list it was made from
    while not all(s.done for s in sequences):
        done = [s.done for s in sequences]
        drafts, q, real = proposer.propose(pending, pending_host, pos, done)  # (B, k)
        drafts = engine.share(drafts)  # under tensor parallelism every rank verifies the first rank's guesses
        out = engine.step(torch.cat([pending[:, None], drafts], 1), pos[:, None] + steps)  # (B, k + 1, V)
        kept, nxt = verify(out, drafts, q, params, generator, seen)
        both = engine.share(torch.cat([kept, nxt]))
        bsz = len(prompts)
        kept, nxt = both[:bsz], both[bsz:]
        host = torch.cat([both, drafts.flatten()]).tolist()  # the round's one wait for the device
        kept_host, nxt_host = host[:bsz], host[bsz : 2 * bsz]
        drafts_host = [host[2 * bsz + b * k : 2 * bsz + (b + 1) * k] for b in range(bsz)]
        stats.target_steps += 1
        for b, seq in enumerate(sequences):
            if done[b]:
                continue
            if real[b]:
                stats.proposed += k
                stats.accepted += kept_host[b]
            for token in drafts_host[b][: kept_host[b]] + [nxt_host[b]]:
                stats.new_tokens += 1
                if seq.add(token):
                    break
        proposer.accepted(kept, kept_host, drafts_host, done)
        if seen is not None:
            mark_seen(seen, torch.where(steps[:k] < kept[:, None], drafts, nxt[:, None]))  # the kept drafts
            mark_seen(seen, nxt)
        if running is None or done != running_for:  # a row finished: a new mask (a copy to the device)
            running, running_for = torch.tensor([not d for d in done], device=engine.device), done
        prev = torch.where(kept > 0, drafts.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0], pending)
        proposer.advance(prev, running)
        pos += (kept + 1) * running
        pending = torch.where(running, nxt, pending)
        pending_host = [p if d else n for p, n, d in zip(pending_host, nxt_host, done)]
    engine.sync()
    stats.seconds = time.perf_counter() - t0
    return stats
