"""Data sources: where documents come from.

A ``data.source`` string is one source or a weighted mixture ``a.jsonl:0.7,b.bin:0.3``. Each entry
is a file, a glob, or a folder:

* ``*.bin`` with a ``.bin.json`` beside it: a pre-tokenized token file (used as is)
* ``*.jsonl`` / ``*.ndjson`` (or ``.gz``): one document per line, text in ``data.text_field``
* ``*.parquet``: one document per row, text in ``data.text_field`` (needs pyarrow)
* a folder written by ``datasets.Dataset.save_to_disk`` (needs the ``datasets`` extra)
* anything else: a text file (``.gz``: decompressed), one document per file

Unset: the embedded default, this Python's own standard-library source files.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field

from loom.config.errors import ConfigError

EMBEDDED = "<stdlib>"


@dataclass
class SourceSpec:
    kind: str  # "tokens" | "jsonl" | "parquet" | "hf_dataset" | "text" | "stdlib"
    paths: list[str]
    weight: float = 1.0
    text_field: str = "text"
    label: str = ""
    extra: dict = field(default_factory=dict)
    encoding_errors: str = "strict"  # data.encoding_errors: "strict" | "replace"

    def fingerprint(self) -> str:
        """Changes whenever the content could have changed (paths, sizes, mtimes, field, and the decoding of bytes
        that are not UTF-8: a cache made with ``replace`` must never serve a ``strict`` run, which has to stop at
        them; strict keeps the fingerprint it always had, so existing caches stay valid)."""
        h = hashlib.blake2b(digest_size=12)
        h.update(f"{self.kind}|{self.text_field}".encode())
        if self.encoding_errors != "strict":
            h.update(f"|{self.encoding_errors}".encode())
        for p in self.paths:
            for f in _files_of(p):
                st = os.stat(f)
                h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
        return h.hexdigest()


def content_hash(paths: list[str]) -> str:
    """blake2b over the files' contents in order (each prefixed by its byte length, so that moving bytes
    between files changes it): names the exact text of a corpus, wherever it is installed."""
    h = hashlib.blake2b(digest_size=16)
    for p in paths:
        with open(p, "rb") as fh:
            data = fh.read()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _files_of(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)
    return [path]


def stdlib_files() -> list[str]:
    """Standard-library ``.py`` files, sorted, without site-packages and test suites."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root).split(os.sep)
        dirnames[:] = [
            d
            for d in dirnames
            if d not in ("site-packages", "__pycache__") and not d.startswith(("test", "idle_test"))
        ]
        if rel[0] != "." and (rel[0].startswith("test") or "site-packages" in rel):
            continue
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(out)


def _kind_of(path: str) -> str:
    if os.path.isdir(path):
        # save_to_disk writes state.json + dataset_info.json for a Dataset, dataset_dict.json for a DatasetDict
        if any(
            os.path.isfile(os.path.join(path, f))
            for f in ("dataset_info.json", "state.json", "dataset_dict.json")
        ):
            return "hf_dataset"
        raise ConfigError(
            "data.source",
            path,
            "a folder must be a Hugging Face dataset saved with "
            "save_to_disk; for files inside it use a glob such as 'folder/*.txt'",
        )
    if path.endswith(".bin"):
        return "tokens"
    if path.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    return "text"


def _expand(pattern: str) -> list[str]:
    if any(c in pattern for c in "*?["):
        found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not found:
            raise ConfigError("data.source", pattern, "the glob matches no files")
        return found
    if not os.path.exists(pattern):
        raise ConfigError("data.source", pattern, "no such file or folder")
    return [pattern]


def _split_weight(entry: str) -> tuple[str, float | None]:
    path, sep, w = entry.rpartition(":")
    if sep and path and not os.path.exists(entry):
        try:
            return path, float(w)
        except ValueError:
            pass
    return entry, None


def parse_source(source: str, text_field: str = "text", encoding_errors: str = "strict") -> list[SourceSpec]:
    """The ``data.source`` string as a list of specs (one per mixture entry)."""
    if not source:
        return [
            SourceSpec("stdlib", stdlib_files(), 1.0, text_field, EMBEDDED, encoding_errors=encoding_errors)
        ]
    entries = [e.strip() for e in source.split(",") if e.strip()]
    specs = []
    for entry in entries:
        pattern, weight = _split_weight(entry)
        if weight is not None and weight <= 0:
            raise ConfigError("data.source", entry, "mixture weights must be > 0")
        if weight is None and len(entries) > 1:
            raise ConfigError("data.source", entry, "in a mixture every entry needs a weight: path:weight")
        paths = _expand(pattern)
        kinds = {_kind_of(p) for p in paths}
        if len(kinds) > 1:
            raise ConfigError("data.source", pattern, f"mixes kinds {sorted(kinds)}; use a mixture instead")
        kind = kinds.pop()
        if kind == "tokens" and len(paths) > 1:
            raise ConfigError("data.source", pattern, "one token file per mixture entry")
        specs.append(
            SourceSpec(kind, paths, weight or 1.0, text_field, pattern, encoding_errors=encoding_errors)
        )
    return specs


# ---- documents ---------------------------------------------------------------


def not_utf8(path: str, where: str) -> ConfigError:
    """Bytes that are not UTF-8 under ``data.encoding_errors = strict``: the file, where, and the way out.
    ``loom data prepare`` names its own option in place of --data.encoding_errors."""
    return ConfigError(
        "data.encoding_errors",
        "strict",
        f"{path} is not valid UTF-8 at {where}; "
        "--data.encoding_errors replace would decode it with U+FFFD replacement characters",
    )


def decode(data: bytes, errors: str, path: str, where: str = "") -> str:
    """UTF-8 text of ``data``; under ``strict`` a ConfigError naming ``path``, ``where`` (a line or row, ending in
    ', ') and the byte offset of the first bad byte."""
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as err:
        raise not_utf8(path, f"{where}byte offset {err.start} (byte 0x{data[err.start]:02x})") from None


_SURROGATE = re.compile("[\ud800-\udfff]")


def no_surrogates(text: str, errors: str, path: str, where: str) -> str:
    """JSON can spell a lone surrogate (``"\\ud800"``), which no UTF-8 encodes: the same rule as for bad bytes."""
    if text.isascii():
        return text
    found = _SURROGATE.search(text)
    if found is None:
        return text
    if errors == "strict":
        raise not_utf8(
            path, f"{where}character {found.start()} (a lone surrogate \\u{ord(found.group()):04x})"
        )
    return _SURROGATE.sub("\ufffd", text)


def read_text(path: str, errors: str = "strict") -> str:
    """One document per file; a ``.gz`` file is decompressed (a damaged one is a one-line error)."""
    gz = path.endswith(".gz")
    with (gzip.open if gz else open)(path, "rb") as fh:
        data = b"".join(_gz_lines(fh, path)) if gz else fh.read()
    try:
        return data.decode("utf-8", errors)
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        where = f"line {line}, byte offset {err.start}{' of the decompressed text' if gz else ''}"
        raise not_utf8(path, f"{where} (byte 0x{data[err.start]:02x})") from None


def _jsonl_rows(path: str, errors: str = "strict") -> Iterator[tuple[int, dict]]:
    """(line number, object) of every non-blank line; bytes that are not UTF-8, a line that is not JSON or not an
    object are one-line errors naming the line."""
    gz = path.endswith(".gz")
    opener = gzip.open if gz else open
    offset = 0  # of the line's first byte (in the decompressed stream of a .gz)
    with opener(path, "rb") as fh:
        for lineno, raw in enumerate(_gz_lines(fh, path) if gz else fh, 1):
            start, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8", errors)
            except UnicodeDecodeError as err:
                where = f"line {lineno}, byte offset {start + err.start}{' of the decompressed text' if gz else ''}"
                raise not_utf8(path, f"{where} (byte 0x{raw[err.start]:02x})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError("data.source", path, f"line {lineno} is not valid JSON") from None
            except RecursionError:
                raise ConfigError(
                    "data.source", path, f"line {lineno} nests JSON too deeply to read"
                ) from None
            if not isinstance(row, dict):
                raise ConfigError("data.source", path, f"line {lineno} is not a JSON object")
            yield lineno, row


def _jsonl_docs(path: str, text_field: str, errors: str = "strict") -> Iterator[str]:
    for lineno, row in _jsonl_rows(path, errors):
        if text_field not in row:
            raise ConfigError(
                "data.text_field",
                text_field,
                f"not a field of {path} line {lineno}; it has {sorted(row)[:8]}",
            )
        text = row[text_field]
        yield no_surrogates(text, errors, path, f"line {lineno}, ") if isinstance(text, str) else text


def _gz_lines(fh, path: str) -> Iterator[bytes]:
    """Lines of a gzip stream; a damaged or cut-off one (an interrupted download) as a one-line error."""
    try:
        yield from fh
    except (OSError, EOFError) as err:
        raise ConfigError(
            "data.source", path, f"is not a complete gzip file ({err}); download or copy it again"
        ) from None


def _arrow_texts(column, errors: str, path: str, first_row: int) -> list:
    """Python values of an Arrow column; a string column holding bytes that are not UTF-8 (Arrow does not check
    what a Parquet writer stored) is decoded by ``decode``, naming the 1-based row."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    import pyarrow as pa

    raw = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
    return [
        None if b is None else decode(b, errors, path, f"row {first_row + i + 1}, ")
        for i, b in enumerate(raw.to_pylist())
    ]


def _parquet_file(path: str):
    """``pyarrow.parquet.ParquetFile(path)``; a damaged file (cut off, or not parquet) as a one-line error."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            "data.source", path, "parquet needs the 'pyarrow' package (pip install 'loom-train[data]')"
        ) from None
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise _bad_parquet(path, err) from None


def _bad_parquet(path: str, err: BaseException) -> ConfigError:
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
    return ConfigError(
        "data.source",
        path,
        f"not a readable parquet file ({reason}); it is probably truncated or "
        "damaged: write, download or copy it again",
    )


def _parquet_batches(pf, path: str, columns: list[str]):
    """The file's record batches of ``columns``; damage found while reading is one line too."""
    try:
        yield from pf.iter_batches(columns=columns, batch_size=1024)
    except (OSError, ValueError) as err:
        raise _bad_parquet(path, err) from None


def _parquet_docs(path: str, text_field: str, errors: str = "strict") -> Iterator[str]:
    pf = _parquet_file(path)
    if text_field not in pf.schema_arrow.names:
        raise ConfigError(
            "data.text_field", text_field, f"not a column of {path}; it has {pf.schema_arrow.names}"
        )
    row = 0
    for batch in _parquet_batches(pf, path, [text_field]):
        yield from _arrow_texts(batch.column(0), errors, path, row)
        row += batch.num_rows


def _load_dataset(path: str):
    """The dataset ``save_to_disk`` wrote at ``path`` (a DatasetDict: its ``train`` split)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "data.source",
            path,
            "a saved Hugging Face dataset needs the 'datasets' package (pip install 'loom-train[data]')",
        ) from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ConfigError("data.source", path, f"a DatasetDict needs a 'train' split; it has {list(ds)}")
        ds = ds["train"]
    return ds


def _hf_dataset_docs(path: str, text_field: str, errors: str = "strict") -> Iterator[str]:
    ds = _load_dataset(path)
    if text_field not in ds.column_names:
        raise ConfigError("data.text_field", text_field, f"not a column of {path}; it has {ds.column_names}")
    row = 0
    for batch in ds.with_format("arrow").iter(batch_size=1024):  # a pyarrow Table per batch
        yield from _arrow_texts(batch.column(text_field), errors, path, row)
        row += batch.num_rows


def _parquet_rows(path: str, columns: tuple[str, ...] | None) -> Iterator[tuple[int, dict]]:
    """(row number, {column: value}) of the ``columns`` the file has (None: all; nested lists and structs as Python
    values)."""
    pf = _parquet_file(path)
    have = (
        list(pf.schema_arrow.names) if columns is None else [c for c in columns if c in pf.schema_arrow.names]
    )
    if not have:
        raise ConfigError(
            "data.source",
            path,
            f"has none of the columns {list(columns or ())}; it has {pf.schema_arrow.names}",
        )
    row = 0
    for batch in _parquet_batches(pf, path, have):
        for values in batch.to_pylist():
            row += 1
            yield row, values


def _hf_dataset_rows(path: str, columns: tuple[str, ...] | None) -> Iterator[tuple[int, dict]]:
    """(row number, {column: value}) of a dataset saved with ``save_to_disk`` (a DatasetDict's ``train`` split)."""
    ds = _load_dataset(path)
    have = list(ds.column_names) if columns is None else [c for c in columns if c in ds.column_names]
    if not have:
        raise ConfigError(
            "data.source", path, f"has none of the columns {list(columns or ())}; it has {ds.column_names}"
        )
    row = 0
    for batch in ds.select_columns(have).iter(batch_size=1024):  # {column: [values]}
        for values in zip(*(batch[c] for c in have)):
            row += 1
            yield row, dict(zip(have, values))


def rows(spec: SourceSpec, columns: tuple[str, ...] | None) -> Iterator[tuple[str, str, dict]]:
    """(file, where, row) of every row of a jsonl / parquet / saved-dataset source, in a fixed order; ``where`` names
    the line or row for errors. jsonl rows are whole objects; the others hold those of ``columns`` they have (None:
    every column)."""
    for path in spec.paths:
        if spec.kind == "jsonl":
            for lineno, row in _jsonl_rows(path, spec.encoding_errors):
                yield path, f"line {lineno}", row
        elif spec.kind == "parquet":
            for n, row in _parquet_rows(path, columns):
                yield path, f"row {n}", row
        elif spec.kind == "hf_dataset":
            for n, row in _hf_dataset_rows(path, columns):
                yield path, f"row {n}", row
        else:
            raise AssertionError(spec.kind)


def _strings(texts: Iterator, path: str, text_field: str) -> Iterator[str]:
    """Missing text (null) is an empty document; anything else that is not text is the user's mistake."""
    for text in texts:
        if text is None:
            yield ""
        elif isinstance(text, str):
            yield text
        else:
            raise ConfigError(
                "data.text_field", text_field, f"holds a {type(text).__name__}, not text, in {path}"
            )


def documents(spec: SourceSpec) -> Iterator[str]:
    """Every document of a (non-token-file) source, in a fixed order."""
    readers = {"jsonl": _jsonl_docs, "parquet": _parquet_docs, "hf_dataset": _hf_dataset_docs}
    for path in spec.paths:
        if spec.kind in ("text", "stdlib"):
            # the embedded default is whatever this Python ships, which the user cannot fix: always replaced
            yield read_text(path, "replace" if spec.kind == "stdlib" else spec.encoding_errors)
        elif spec.kind in readers:
            texts = readers[spec.kind](path, spec.text_field, spec.encoding_errors)
            yield from _strings(texts, path, spec.text_field)
        else:
            raise AssertionError(spec.kind)
