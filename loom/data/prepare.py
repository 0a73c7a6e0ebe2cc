"""Tokenize a source into a token file (``loom data prepare``, and the cache used by training)."""

from __future__ import annotations

import os
from typing import Callable

from loom.data.sources import SourceSpec, documents
from loom.data.token_file import TokenFileMeta, TokenFileWriter, meta_path


def tokenize_to_file(spec: SourceSpec, tokenizer, out_path: str,
                     progress: Callable[[int, int], None] | None = None, batch: int = 256) -> TokenFileMeta:
    """Write every document of ``spec`` to ``out_path``; ``progress(docs, tokens)`` after each batch."""
    writer = TokenFileWriter(out_path, eos_id=tokenizer.eos_id, vocab_size=tokenizer.vocab_size,
                             tokenizer=tokenizer.fingerprint())
    byte_fast = hasattr(tokenizer, "encode_bytes")
    pending: list[str] = []

    def flush():
        if not pending:
            return
        if byte_fast:
            ids = [tokenizer.encode_bytes(t.encode("utf-8")) for t in pending]
        elif hasattr(tokenizer, "encode_batch"):
            ids = tokenizer.encode_batch(pending)
        else:
            ids = [tokenizer.encode(t) for t in pending]
        for doc in ids:
            writer.add(doc)
        pending.clear()
        if progress:
            progress(writer.meta.documents, writer.meta.tokens)

    for text in documents(spec):
        if not text:
            continue  # empty documents are skipped in every format, so formats agree
        pending.append(text)
        if len(pending) >= batch:
            flush()
    flush()
    return writer.close()


def cache_path(spec: SourceSpec, tokenizer, cache_dir: str) -> str:
    return os.path.join(cache_dir, f"{spec.kind}-{spec.fingerprint()}-{tokenizer.fingerprint()}.bin")


def ensure_token_file(spec: SourceSpec, tokenizer, cache_dir: str) -> str:
    """Path of a token file for ``spec``: the file itself, or a cached tokenization (built if missing)."""
    if spec.kind == "tokens":
        return spec.paths[0]
    path = cache_path(spec, tokenizer, cache_dir)
    if not os.path.isfile(meta_path(path)):  # the metadata is written last: its presence means complete
        tokenize_to_file(spec, tokenizer, path)
    return path
