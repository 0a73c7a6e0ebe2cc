"""Tokenize a source into a token file (``loom data prepare``, and the cache used by training)."""

from __future__ import annotations

import os
from typing import Callable, Iterator

from loom.config.errors import ConfigError, UserError
from loom.data.sources import SourceSpec, documents
from loom.data.token_file import (TokenFile, TokenFileMeta, TokenFileWriteError, TokenFileWriter, check_ids,
                                  check_tokenizer, meta_path)

Progress = Callable[[int, int], None]


def _encode(tokenizer, texts: list[str]) -> list:
    """Token ids of each text; the fastest path the tokenizer offers."""
    if hasattr(tokenizer, "encode_bytes"):
        return [tokenizer.encode_bytes(t.encode("utf-8")) for t in texts]
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    """Non-empty texts in lists of ``size``: empty documents are skipped in every format, so formats agree."""
    pending: list[str] = []
    for text in texts:
        if text:
            pending.append(text)
        if len(pending) >= size:
            yield pending
            pending = []
    if pending:
        yield pending


def _write_documents(spec: SourceSpec, tokenizer, writer: TokenFileWriter, progress: Progress | None,
                     batch: int) -> None:
    for texts in _batches(documents(spec), batch):
        for ids in _encode(tokenizer, texts):
            if len(ids):  # a text that tokenizes to nothing would be a lone EOS: skip it like an empty one
                writer.add(ids)
        if progress:
            progress(writer.meta.documents, writer.meta.tokens)


def _copy_tokens(spec: SourceSpec, tokenizer, writer: TokenFileWriter, progress: Progress | None,
                 chunk: int = 1 << 22) -> None:
    """A token file as the source: its ids are already final, so copy them (same tokenizer only)."""
    src = TokenFile(spec.paths[0])
    check_tokenizer(src.path, src.meta, tokenizer)
    check_ids(src, tokenizer)
    for start in range(0, len(src), chunk):
        part = src.tokens[start:start + chunk]  # (chunk,)
        writer.extend(part, int((part == src.meta.eos_id).sum()))
        if progress:
            progress(writer.meta.documents, writer.meta.tokens)


def tokenize_to_file(spec: SourceSpec, tokenizer, out_path: str,
                     progress: Progress | None = None, batch: int = 256) -> TokenFileMeta:
    """Write every document of ``spec`` to ``out_path``; ``progress(docs, tokens)`` after each batch.

    The file only appears (with its description, written last) when the whole source went through;
    a failure part-way leaves no partial token file behind."""
    if spec.kind == "tokens" and os.path.abspath(spec.paths[0]) == os.path.abspath(out_path):
        raise UserError(f"token file {out_path} cannot be both the source and the output")
    writer = TokenFileWriter(out_path, eos_id=tokenizer.eos_id, vocab_size=tokenizer.vocab_size,
                             tokenizer=tokenizer.fingerprint())
    try:
        if spec.kind == "tokens":
            _copy_tokens(spec, tokenizer, writer, progress)
        else:
            _write_documents(spec, tokenizer, writer, progress, batch)
        if writer.meta.tokens == 0:
            raise UserError(f"data source {spec.label or spec.paths}: no non-empty documents "
                            f"(checked {len(spec.paths)} file(s), text field {spec.text_field!r})")
    except OSError as err:  # a source file that cannot be read (the writer's own errors are TokenFileWriteError)
        writer.abort()
        raise UserError(f"data source {err.filename or spec.label or spec.paths[0]}: cannot be read "
                        f"({err.strerror or err})") from None
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def cache_path(spec: SourceSpec, tokenizer, cache_dir: str) -> str:
    return os.path.join(cache_dir, f"{spec.kind}-{spec.fingerprint()}-{tokenizer.fingerprint()}.bin")


def ensure_token_file(spec: SourceSpec, tokenizer, cache_dir: str) -> str:
    """Path of a token file for ``spec``: the file itself, or a cached tokenization (built if missing)."""
    if spec.kind == "tokens":
        return spec.paths[0]
    path = cache_path(spec, tokenizer, cache_dir)
    if not os.path.isfile(meta_path(path)):  # the metadata is written last: its presence means complete
        try:
            tokenize_to_file(spec, tokenizer, path)
        except TokenFileWriteError as err:
            raise ConfigError("data.cache_dir", cache_dir, f"the tokenized source cannot be written there "
                              f"({err.reason}); choose a writable folder") from None
    return path
