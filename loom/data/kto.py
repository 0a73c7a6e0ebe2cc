"""KTO data: unpaired examples (``prompt``, ``completion``, ``label``: desirable or not) in TRL's format, plain
strings or conversational, rendered with the chat template; the embedded default derived from the embedded
preference pairs (chosen: desirable, rejected: undesirable).

An example is stored as a pair of sequences of a DPO-style token file (mask mode ``kto``, loom.data.dpo's loader
reads it): prompt + completion, then prompt + a mismatched completion for KTO's KL estimate, TRL's construction
((x_i, y_i) with (x_i, y_j) of another example: loom takes the nearest earlier example of another prompt, the file
read as a ring). The first token of a desirable example's completion sequence carries ``FLAG_DESIRABLE``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

from loom.config.errors import ConfigError
from loom.data.chat import FLAG_LOSS, ChatEncoder, ChatError
from loom.data.dpo import FLAG_DESIRABLE, docstring_preferences
from loom.data.dpo import KTO_MASK as MASK
from loom.data.sft import checked_messages
from loom.data.sources import SourceSpec, no_surrogates, rows
from loom.data.token_file import TokenFileWriter

COLUMNS = ("prompt", "completion", "label")
__all__ = ["FLAG_DESIRABLE", "MASK", "examples", "from_row", "mismatched", "write_examples"]


@dataclass
class Example:
    prompt: list[dict]
    completion: list[dict]
    desirable: bool
    where: str  # the file and line or row, for errors


def examples(spec: SourceSpec) -> Iterator[Example]:
    """Every example of ``spec``, in a fixed order."""
    if spec.kind == "stdlib":
        for pair in docstring_preferences(spec.paths, spec.extra.get("rejected", "docstring")):
            yield Example(pair.prompt, pair.chosen, True, pair.where)
            yield Example(pair.prompt, pair.rejected, False, pair.where)
        return
    if spec.kind not in ("jsonl", "parquet", "hf_dataset"):
        raise ConfigError(
            "data.source",
            spec.label or spec.paths[0],
            "training.objective kto reads unpaired examples: "
            "jsonl, parquet or a saved Hugging Face dataset with 'prompt', 'completion' and 'label' "
            f"(this source is {spec.kind})",
        )
    for path, where, row in rows(spec, COLUMNS):
        yield from_row(row, f"{path} {where}", spec.encoding_errors)


def from_row(row: dict, where: str, errors: str = "strict") -> Example:
    """One row as an example: 'prompt' and 'completion' both strings (a user and an assistant message) or both
    lists of messages (TRL's conversational format); 'label' a boolean (true = desirable)."""
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise ConfigError(
            "data.source",
            where,
            f"a KTO example needs 'prompt', 'completion' and 'label'; it has {sorted(row)[:8]}",
        )
    label = row["label"]
    if not isinstance(label, bool):
        raise ConfigError(
            "data.source", where, f"'label' must be true or false (desirable or not); got {label!r}"
        )
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        p, c = (no_surrogates(v, errors, where, "") for v in (prompt, completion))
        return Example([{"role": "user", "content": p}], [{"role": "assistant", "content": c}], label, where)
    if isinstance(prompt, list) and isinstance(completion, list):
        return Example(
            checked_messages(prompt, where, "prompt", errors),
            checked_messages(completion, where, "completion", errors),
            label,
            where,
        )
    raise ConfigError(
        "data.source",
        where,
        "'prompt' and 'completion' must both be strings or both lists of messages; "
        f"got {type(prompt).__name__}, {type(completion).__name__}",
    )


def mismatched(items: list[Example]) -> list[int]:
    """For each example, the one whose completion its KL sequence takes: the nearest earlier example (the list read
    as a ring) with another prompt; itself where every example has the same prompt."""
    n, out = len(items), []
    for i, ex in enumerate(items):
        j = next((k % n for k in range(i - 1, i - n, -1) if items[k % n].prompt != ex.prompt), i)
        out.append(j)
    return out


def encoder_fingerprint(encoder: ChatEncoder) -> str:
    """The cache key of a KTO token file: the chat template and this format's version."""
    return hashlib.blake2b(f"loom-kto-v1|{encoder.fingerprint()}".encode(), digest_size=8).hexdigest()


def write_examples(spec: SourceSpec, encoder: ChatEncoder, writer: TokenFileWriter) -> None:
    """Each example as two flagged sequences (its completion, the mismatched one); an example whose sequences hold
    no token to train on is left out."""
    items = list(examples(spec))
    for ex, j in zip(items, mismatched(items)):
        try:
            seqs = [
                encoder.encode(ex.prompt + completion, len(ex.prompt))
                for completion in (ex.completion, items[j].completion)
            ]
        except ChatError as err:
            raise ConfigError("data.source", ex.where, str(err)) from None
        if all(any(f & FLAG_LOSS for f in flags) for _, flags in seqs):
            (ids, flags), second = seqs
            flags = bytearray(flags)
            if ex.desirable:
                flags[0] |= FLAG_DESIRABLE
            writer.add(ids, flags)
            writer.add(*second)
