"""Tokenize a source into a token file (``loom data prepare``, and the cache used by training). Under
``training.objective sft`` a source's conversations are rendered with the chat template and written with their
per-token loss flags (``loom.data.chat.ChatEncoder``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from loom.config.errors import ConfigError, UserError
from loom.data.chat import FLAG_LOSS, FLAG_START, ChatEncoder, ChatError
from loom.data.dpo import MASK as DPO_MASK
from loom.data.dpo import encoder_fingerprint, write_pairs
from loom.data.kto import MASK as KTO_MASK
from loom.data.kto import encoder_fingerprint as kto_fingerprint
from loom.data.kto import write_examples
from loom.data.sft import conversations
from loom.data.sources import SourceSpec, documents
from loom.data.token_file import (
    TokenFile,
    TokenFileMeta,
    TokenFileWriteError,
    TokenFileWriter,
    check_ids,
    check_tokenizer,
    meta_path,
    read_meta,
)

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


def _write_documents(
    spec: SourceSpec, tokenizer, writer: TokenFileWriter, progress: Progress | None, batch: int
) -> None:
    for texts in _batches(documents(spec), batch):
        for ids in _encode(tokenizer, texts):
            if len(ids):  # a text that tokenizes to nothing would be a lone EOS: skip it like an empty one
                writer.add(ids)
        if progress:
            progress(writer.meta.documents, writer.meta.tokens)


def _write_conversations(
    spec: SourceSpec,
    encoder: ChatEncoder,
    writer: TokenFileWriter,
    progress: Progress | None,
    every: int = 256,
) -> None:
    """Each conversation rendered, tokenized and written with its flags; one with nothing to train on (no assistant
    turn) is skipped, as an empty document is."""
    for n, conv in enumerate(conversations(spec), 1):
        try:
            ids, flags = encoder.encode(conv.messages, conv.first)
        except ChatError as err:
            raise ConfigError("data.source", conv.where, str(err)) from None
        if any(f & FLAG_LOSS for f in flags):
            writer.add(ids, flags)
        if progress and n % every == 0:
            progress(writer.meta.documents, writer.meta.tokens)


def check_mask(path: str, meta: TokenFileMeta, kind, field: str = "data.source") -> None:
    """An SFT run reads only token files with a loss mask, a DPO run only files of pairs, a language-model run only
    files without a mask. ``kind``: the data a run reads, 'lm' | 'sft' | 'dpo' (True / False: 'sft' / 'lm')."""
    kind = {True: "sft", False: "lm"}.get(kind, kind)
    held = {DPO_MASK: "dpo", KTO_MASK: "kto", "": "lm"}.get(meta.mask, "sft")
    if kind == held:
        return
    if held == "kto" or kind == "kto":
        raise ConfigError(
            field,
            path,
            "holds KTO examples: it is for training.objective kto"
            if held == "kto"
            else "training.objective kto reads unpaired examples ('prompt', 'completion', 'label' in jsonl, "
            "parquet or a saved dataset), not a token file of another objective",
        )
    if kind == "sft" and held == "lm":
        raise ConfigError(
            field,
            path,
            "holds no loss mask: training.objective sft trains on a token file written by "
            "`loom data prepare --objective sft` (or on the conversations themselves)",
        )
    if held == "sft":
        raise ConfigError(
            field,
            path,
            "holds SFT conversations (a loss mask): it is for training.objective sft "
            "(loom data prepare --objective sft)",
        )
    if held == "dpo":
        raise ConfigError(field, path, "holds DPO preference pairs: it is for training.objective dpo")
    raise ConfigError(
        field,
        path,
        "holds plain text tokens: training.objective dpo trains on preference pairs "
        "('prompt', 'chosen', 'rejected' in jsonl, parquet or a saved dataset)",
    )


def _copy_tokens(
    spec: SourceSpec, tokenizer, writer: TokenFileWriter, progress: Progress | None, chunk: int = 1 << 22
) -> None:
    """A token file as the source: its ids (and an SFT file's flags) are already final, so copy them (same
    tokenizer only)."""
    src = TokenFile(spec.paths[0])
    check_tokenizer(src.path, src.meta, tokenizer)
    check_mask(
        src.path,
        src.meta,
        {DPO_MASK: "dpo", KTO_MASK: "kto"}.get(writer.meta.mask, bool(writer.meta.mask)),
    )
    check_ids(src, tokenizer)
    if src.mask is not None:
        writer.meta.mask, writer.meta.chat_template = src.meta.mask, src.meta.chat_template
    for start in range(0, len(src), chunk):
        part = src.tokens[start : start + chunk]  # (chunk,)
        flags = None if src.mask is None else src.mask[start : start + chunk]
        docs = (
            int((part == src.meta.eos_id).sum()) if flags is None else int(((flags & FLAG_START) > 0).sum())
        )
        writer.extend(part, docs, flags)
        if progress:
            progress(writer.meta.documents, writer.meta.tokens)


def tokenize_to_file(
    spec: SourceSpec,
    tokenizer,
    out_path: str,
    progress: Progress | None = None,
    batch: int = 256,
    sft: ChatEncoder | None = None,
    dpo: bool = False,
    kto: bool = False,
) -> TokenFileMeta:
    """Write every document of ``spec`` to ``out_path``; ``progress(docs, tokens)`` after each batch. ``sft``: the
    source's conversations, rendered and flagged by this encoder; with ``dpo`` its preference pairs, two sequences
    each (loom.data.dpo); with ``kto`` its KTO examples, two sequences each (loom.data.kto).

    The file only appears (with its description, written last) when the whole source went through;
    a failure part-way leaves no partial token file behind."""
    if spec.kind == "tokens" and os.path.abspath(spec.paths[0]) == os.path.abspath(out_path):
        raise UserError(f"token file {out_path} cannot be both the source and the output")
    writer = TokenFileWriter(
        out_path,
        eos_id=tokenizer.eos_id,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.fingerprint(),
        mask=KTO_MASK if kto else DPO_MASK if dpo else sft.loss_tokens if sft else "",
        chat_template=f"{sft.template.origin} {sft.template.fingerprint()}" if sft else "",
    )
    try:
        if spec.kind == "tokens":
            _copy_tokens(spec, tokenizer, writer, progress)
        elif kto:
            write_examples(spec, sft, writer)
        elif dpo:
            write_pairs(spec, sft, writer)
        elif sft is not None:
            _write_conversations(spec, sft, writer, progress)
        else:
            _write_documents(spec, tokenizer, writer, progress, batch)
        if writer.meta.tokens == 0:
            what = (
                "preference pairs with completions"
                if dpo
                else "KTO examples with completions"
                if kto
                else "conversations with an assistant turn"
                if sft
                else "non-empty documents"
            )
            field = "" if sft else f", text field {spec.text_field!r}"
            raise UserError(
                f"data source {spec.label or spec.paths}: no {what} "
                f"(checked {len(spec.paths)} file(s){field})"
            )
    except (
        OSError
    ) as err:  # a source file that cannot be read (the writer's own errors are TokenFileWriteError)
        writer.abort()
        raise UserError(
            f"data source {err.filename or spec.label or spec.paths[0]}: cannot be read "
            f"({err.strerror or err})"
        ) from None
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def cache_path(
    spec: SourceSpec,
    tokenizer,
    cache_dir: str,
    sft: ChatEncoder | None = None,
    dpo: bool = False,
    kto: bool = False,
) -> str:
    """The cached tokenization of ``spec``; an SFT or DPO one is named for its objective, chat template and loss
    mask too, so a language-model cache never serves an SFT run, nor one template's another's. A DPO file does not
    depend on training.seq_len (the loader truncates)."""
    name = f"{spec.kind}-{spec.fingerprint()}-{tokenizer.fingerprint()}"
    if dpo or kto:
        pairing = spec.extra.get("rejected", "docstring")  # the embedded pairs' rejected answers
        name += "" if pairing == "docstring" else f"-{pairing}"
        if kto:
            return os.path.join(cache_dir, f"kto-{name}-{kto_fingerprint(sft)}.bin")
        return os.path.join(cache_dir, f"dpo-{name}-{encoder_fingerprint(sft)}.bin")
    return os.path.join(cache_dir, f"sft-{name}-{sft.fingerprint()}.bin" if sft else f"{name}.bin")


def ensure_token_file(
    spec: SourceSpec,
    tokenizer,
    cache_dir: str,
    sft: ChatEncoder | None = None,
    dpo: bool = False,
    kto: bool = False,
) -> str:
    """Path of a token file for ``spec``: the file itself, or a cached tokenization (built if missing)."""
    if spec.kind == "tokens":
        check_mask(
            spec.paths[0], read_meta(spec.paths[0]), "kto" if kto else "dpo" if dpo else sft is not None
        )
        return spec.paths[0]
    path = cache_path(spec, tokenizer, cache_dir, sft, dpo, kto)
    if not os.path.isfile(meta_path(path)):  # the metadata is written last: its presence means complete
        try:
            tokenize_to_file(spec, tokenizer, path, sft=sft, dpo=dpo, kto=kto)
        except TokenFileWriteError as err:
            raise ConfigError(
                "data.cache_dir",
                cache_dir,
                f"the tokenized source cannot be written there ({err.detail}; no partial file was kept): "
                "choose a writable folder with room",
            ) from None
    return path
