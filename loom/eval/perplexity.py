"""Perplexity and bits per byte of a model on any source loom reads (text, jsonl, parquet, a saved dataset, a token
file, the embedded default; a mixture is scored entry by entry).

What is scored: each document on its own. Its text is tokenized as loom tokenizes training data (nothing added
around it) and every token is predicted once, the first after the model's prefix token (``EvalModel.prefix_id``),
each with as much of the document before it as ``max_length`` inputs hold (``scoring.rolling_windows``; lm-eval's
``loglikelihood_rolling``). No end-of-document token is scored. Empty documents, and documents that tokenize to
nothing, are skipped, as ``loom data prepare`` skips them.

- token perplexity = exp(NLL / tokens), NLL the summed negative log-likelihood in nats;
- bits per byte = NLL / ln 2 / bytes, where bytes is the UTF-8 length of the scored documents' text as loom
  decodes it (with ``encoding_errors = replace`` a replaced byte counts as the 3 bytes of U+FFFD). It does not
  depend on the tokenizer, so models with different vocabularies compare on it.

A token file holds no text: its documents (the runs of tokens between EOS ids) give a token perplexity, and no
bits per byte.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from loom.config.errors import ConfigError
from loom.eval.model import EvalModel
from loom.eval.scoring import Window, bits, rolling_windows, score

NO_BYTES = (
    "bits per byte: not available for a token file (it holds ids, not text: evaluate its text source for bpb)"
)


@dataclass
class Perplexity:
    """The totals of one source; ``bytes`` None: a token file, which has no text to count."""

    label: str
    documents: int = 0
    tokens: int = 0
    bytes: int | None = 0
    nll: float = 0.0  # nats, summed over every scored token

    @property
    def token_perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else math.nan

    @property
    def nll_per_token(self) -> float:
        return self.nll / self.tokens if self.tokens else math.nan

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.bytes else bits(self.nll) / self.bytes

    def as_dict(self) -> dict:
        return {
            "source": self.label,
            "documents": self.documents,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "nll": self.nll,
            "nll_per_token": self.nll_per_token,
            "token_perplexity": self.token_perplexity,
            "bits_per_byte": self.bits_per_byte,
        }

    def line(self) -> str:
        """One line for a terminal."""
        bpb = f"bits/byte {self.bits_per_byte:.4f}" if self.bits_per_byte is not None else NO_BYTES
        return (
            f"{self.label}: {self.documents:,} documents, {self.tokens:,} tokens: perplexity "
            f"{self.token_perplexity:.4f} (NLL {self.nll_per_token:.4f} nats/token); {bpb}"
        )


def total(results: list[Perplexity]) -> Perplexity:
    """The sources together (bytes only where every source has text)."""
    out = Perplexity(
        "total",
        sum(r.documents for r in results),
        sum(r.tokens for r in results),
        None if any(r.bytes is None for r in results) else sum(r.bytes for r in results),
        sum(r.nll for r in results),
    )
    return out


def perplexity(
    em: EvalModel,
    source: str,
    *,
    text_field: str = "text",
    encoding_errors: str = "strict",
    limit: int = 0,
    batch_size: int = 8,
    progress: Callable[[Perplexity], None] | None = None,
    pending_windows: int = 512,
) -> list[Perplexity]:
    """Perplexity (and bits per byte where there is text) of ``em`` on each entry of ``source`` (a
    ``data.source`` string; '' = the embedded default). ``limit`` > 0: the first ``limit`` documents of each
    entry. ``progress`` is called with the running totals after each scored batch of windows."""
    from loom.data.sources import parse_source

    if limit < 0:
        raise ConfigError("--limit", limit, "allowed: 0 (every document) or a positive count")
    out = []
    for spec in parse_source(source, text_field, encoding_errors):
        result = Perplexity(spec.label, bytes=None if spec.kind == "tokens" else 0)
        windows: list[Window] = []
        for ids, nbytes in _documents(spec, em.tokenizer, limit):
            result.documents += 1
            result.tokens += len(ids)
            if nbytes is not None:
                result.bytes += nbytes
            windows += rolling_windows(ids, em.prefix_id, em.max_length)
            if len(windows) >= pending_windows:
                _add(result, em, windows, batch_size, progress)
                windows = []
        _add(result, em, windows, batch_size, progress)
        out.append(result)
    return out


def _add(result: Perplexity, em: EvalModel, windows: list[Window], batch_size: int, progress) -> None:
    if not windows:
        return
    result.nll -= sum(logp for logp, _ in score(em, windows, batch_size))
    if progress:
        progress(result)


def _documents(spec, tokenizer, limit: int) -> Iterator[tuple[list[int], int | None]]:
    """(token ids, UTF-8 bytes of the text or None for a token file) of each non-empty document."""
    from loom.data.sources import documents

    n = 0
    docs = (
        token_file_documents(spec.paths[0], tokenizer)
        if spec.kind == "tokens"
        else (_tokenized(text, tokenizer) for text in documents(spec) if text)
    )
    for ids, nbytes in docs:
        if not ids:
            continue
        yield ids, nbytes
        n += 1
        if limit and n >= limit:
            return


def _tokenized(text: str, tokenizer) -> tuple[list[int], int]:
    return list(tokenizer.encode(text)), len(text.encode("utf-8"))


def token_file_documents(path: str, tokenizer, chunk: int = 1 << 22) -> Iterator[tuple[list[int], None]]:
    """The documents of a plain-text token file: the runs of ids between EOS ids (written after every document),
    read ``chunk`` tokens at a time. Its ids must be ``tokenizer``'s."""
    from loom.data.token_file import TokenFile, check_tokenizer

    tf = TokenFile(path)
    check_tokenizer(path, tf.meta, tokenizer, field="--source")
    if tf.meta.mask:
        raise ConfigError(
            "--source",
            path,
            "holds SFT conversations or DPO pairs (a loss mask): perplexity reads plain text token files",
        )
    eos, pending = tf.meta.eos_id, []
    for start in range(0, len(tf), chunk):
        part = tf.slice(start, min(start + chunk, len(tf)))  # (chunk,) int64
        prev = 0
        for end in (part == eos).nonzero().flatten().tolist():
            yield pending + part[prev:end].tolist(), None
            pending, prev = [], end + 1
        pending += part[prev:].tolist()
    if pending:
        yield pending, None
