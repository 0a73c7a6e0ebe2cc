"""Data: tokenizers, sources, token files, packing and the stateful loader."""

from __future__ import annotations

import json

from loom.config.errors import ConfigError
from loom.config.sections import DataConfig
from loom.data.chat import ChatEncoder, load_template
from loom.data.dpo import PairFile, PairLoader
from loom.data.loader import Loader, MicroBatch, StepData, Windows
from loom.data.prepare import check_mask, ensure_token_file
from loom.data.sources import content_hash, parse_source
from loom.data.token_file import TokenFile, check_tokenizer, read_meta, write_whole
from loom.data.tokenizers import build_tokenizer

__all__ = [
    "Loader",
    "MicroBatch",
    "StepData",
    "build_loader",
    "build_tokenizer",
    "chat_encoder",
    "describe_sources",
    "prepare_data",
]

# the kinds of prepared data (a token file's mask: loom.data.prepare.check_mask); a method names the one it reads
# (loom.train.objective.Objective.data)
TEXT, CHAT, PAIRS, UNPAIRED = "lm", "sft", "dpo", "kto"


def chat_encoder(cfg: DataConfig, tokenizer, kind: str = TEXT) -> ChatEncoder | None:
    """The conversation encoder of conversations or pairs (its chat template and loss mask); None for plain text."""
    if kind not in (CHAT, PAIRS, UNPAIRED):
        return None
    return ChatEncoder(load_template(cfg.chat_template, tokenizer), tokenizer, cfg.loss_tokens)


def prepare_data(
    cfg: DataConfig, tokenizer, cache_dir: str, kind: str = TEXT, rejected: str = "docstring"
) -> list[tuple[str, float, str]]:
    """Tokenize (or find cached) every source; returns (token file, weight, label). Run on one rank first.
    ``kind``: CHAT reads conversations and writes their loss masks, PAIRS preference pairs (one source);
    ``rejected``: the embedded pairs' rejected answers (loom.data.dpo.docstring_preferences)."""
    sft = chat_encoder(cfg, tokenizer, kind)
    out = []
    specs = parse_source(cfg.source, cfg.text_field, cfg.encoding_errors)
    pairs = kind in (PAIRS, UNPAIRED)
    if pairs and len(specs) > 1:
        raise ConfigError(
            "data.source", cfg.source, f"training.objective {kind} reads one source (no mixture)"
        )
    for spec in specs:
        if pairs and spec.kind == "stdlib":
            spec.extra["rejected"] = rejected
        path = ensure_token_file(spec, tokenizer, cache_dir, sft, dpo=kind == PAIRS, kto=kind == UNPAIRED)
        out.append((path, spec.weight, spec.label))
    return out


def check_tokenizer_match(path: str, meta, tokenizer) -> None:
    """Kept for callers of the old name: a token file must have been written by this tokenizer."""
    check_tokenizer(path, meta, tokenizer)


def build_loader(
    cfg: DataConfig,
    tokenizer,
    files: list[tuple[str, float, str]],
    *,
    seq_len: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
    micro_batch: int,
    accumulation: int,
    kind: str = TEXT,
) -> Loader | PairLoader:
    """The loader of ``files``: packed windows, or for PAIRS preference pairs (global batches of pairs;
    micro_batch and accumulation count pairs)."""
    if kind in (PAIRS, UNPAIRED):  # KTO's examples are stored as pairs of sequences (loom.data.kto)
        ((path, _, label),) = files
        tf = TokenFile(path)
        check_tokenizer(path, tf.meta, tokenizer)
        check_mask(path, tf.meta, kind)
        pad = getattr(tokenizer, "pad_id", None)
        return PairLoader(
            PairFile(tf, seq_len, cfg.val_fraction, label),
            seed=seed,
            pad_id=tokenizer.eos_id if pad is None else pad,
            dp_rank=dp_rank,
            dp_size=dp_size,
            micro_batch=micro_batch,
            accumulation=accumulation,
        )
    windows, weights = [], []
    for path, weight, label in files:
        tf = TokenFile(path)
        check_tokenizer(path, tf.meta, tokenizer)
        check_mask(path, tf.meta, kind)
        windows.append(Windows(tf, seq_len, cfg.val_fraction, label))
        weights.append(weight)
    return Loader(
        windows,
        weights,
        seed=seed,
        eos_id=tokenizer.eos_id,
        dp_rank=dp_rank,
        dp_size=dp_size,
        micro_batch=micro_batch,
        accumulation=accumulation,
    )


def describe_sources(cfg: DataConfig, files, out_path: str) -> None:
    """Record what was trained on, so a run can be traced to its text. The embedded default depends on the
    installed Python, so it also gets its file list and a content hash (same hash = same training text). An SFT
    token file adds its chat template (origin and fingerprint), loss mask and conversation count."""
    records = []
    for spec, (path, weight, label) in zip(
        parse_source(cfg.source, cfg.text_field, cfg.encoding_errors), files
    ):
        rec = {
            "label": label,
            "kind": spec.kind,
            "weight": weight,
            "token_file": path,
            "fingerprint": spec.fingerprint(),
            "files": len(spec.paths),
        }
        meta = read_meta(path)
        if meta.mask == "dpo":
            rec.update(chat_template=meta.chat_template, pairs=meta.documents // 2)
        elif meta.mask:
            rec.update(
                chat_template=meta.chat_template,
                loss_tokens=meta.mask,
                conversations=meta.documents,
                trained_tokens=meta.trained_tokens,
            )
        if spec.kind == "stdlib":
            rec["file_list"] = spec.paths
            rec["content_hash"] = content_hash(spec.paths)
        records.append(rec)
    write_whole(out_path, json.dumps(records, indent=1).encode())  # a full disk: one line, no partial file
