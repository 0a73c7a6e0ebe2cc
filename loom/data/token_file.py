"""Pre-tokenized, memory-mapped token files.

``name.bin`` holds the token ids back to back (little-endian uint16 or uint32) with the EOS id
after every document; ``name.bin.json`` describes it (dtype, token count, documents, EOS id,
tokenizer fingerprint). ``loom data prepare`` writes them; any source is cached in this format.
"""

from __future__ import annotations

import json
import mmap
import os
import warnings
from dataclasses import asdict, dataclass

import torch

from loom.config.errors import ConfigError, UserError

DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}


@dataclass
class TokenFileMeta:
    dtype: str
    tokens: int
    documents: int
    eos_id: int
    vocab_size: int
    tokenizer: str
    format: str = "loom-tokens-v1"


def meta_path(path: str) -> str:
    return path + ".json"


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


class TokenFileWriter:
    """Append documents' token ids; ``close()`` writes the metadata last and renames into place."""

    def __init__(self, path: str, *, eos_id: int, vocab_size: int, tokenizer: str):
        self.path = path
        self.dtype = dtype_for_vocab(vocab_size)
        self.meta = TokenFileMeta(self.dtype, 0, 0, eos_id, vocab_size, tokenizer)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._tmp = f"{path}.tmp{os.getpid()}"
        self._fh = open(self._tmp, "wb")
        self._eos = torch.tensor([eos_id], dtype=DTYPES[self.dtype])

    def add(self, ids) -> None:
        """``ids``: a list of ints or an integer tensor (one document, without EOS)."""
        t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64)
        t = torch.cat([t.to(DTYPES[self.dtype]), self._eos])
        self._fh.write(t.numpy().tobytes())
        self.meta.tokens += t.numel()
        self.meta.documents += 1

    def extend(self, tokens: torch.Tensor, documents: int) -> None:
        """Append already-terminated token ids as they are (copying another token file)."""
        self._fh.write(tokens.to(DTYPES[self.dtype]).numpy().tobytes())
        self.meta.tokens += tokens.numel()
        self.meta.documents += documents

    def abort(self) -> None:
        """Drop the partial file, so a failed run leaves nothing that looks like a token file."""
        self._fh.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def close(self) -> TokenFileMeta:
        self._fh.close()
        if os.path.exists(meta_path(self.path)):  # a stale description must never vouch for new tokens
            os.remove(meta_path(self.path))
        os.replace(self._tmp, self.path)
        tmp_meta = meta_path(self.path) + ".tmp"
        with open(tmp_meta, "w") as fh:
            json.dump(asdict(self.meta), fh, indent=1)
        os.replace(tmp_meta, meta_path(self.path))
        return self.meta


def read_meta(path: str) -> TokenFileMeta:
    mp = meta_path(path)
    if not os.path.isfile(mp):
        raise UserError(f"token file {path}: its description {mp} is missing "
                        "(write token files with `loom data prepare`)")
    try:
        with open(mp) as fh:
            meta = TokenFileMeta(**json.load(fh))
    except (ValueError, TypeError) as err:
        raise UserError(f"token file {path}: its description {mp} is not a loom token file description "
                        f"({err})") from None
    if meta.dtype not in DTYPES:
        raise UserError(f"token file {path}: unknown dtype {meta.dtype!r} in {mp} (allowed: {', '.join(DTYPES)})")
    if not os.path.isfile(path):
        raise UserError(f"token file {path} is missing (only its description {mp} exists)")
    size = os.path.getsize(path)
    itemsize = DTYPES[meta.dtype].itemsize
    if size != meta.tokens * itemsize:
        raise UserError(f"token file {path}: {size} bytes, expected {meta.tokens * itemsize} "
                        f"({meta.tokens} {meta.dtype} tokens); the file is truncated or not a loom token file")
    return meta


def check_tokenizer(path: str, meta: TokenFileMeta, tokenizer, field: str = "data.tokenizer") -> None:
    """Token ids only mean something with the tokenizer that wrote them: refuse any other one."""
    if meta.tokenizer != tokenizer.fingerprint() or meta.eos_id != tokenizer.eos_id:
        raise ConfigError(field, tokenizer.fingerprint(),
                          f"token file {path} was written with tokenizer {meta.tokenizer} "
                          f"(vocab {meta.vocab_size}, eos {meta.eos_id}); pass the same tokenizer")


class TokenFile:
    """Random access to a token file without reading it into memory."""

    def __init__(self, path: str):
        self.path = path
        self.meta = read_meta(path)
        if self.meta.tokens == 0:
            raise UserError(f"token file {path} holds no tokens")
        self._fh = open(path, "rb")
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we never write through it
            self.tokens = torch.frombuffer(self._mm, dtype=DTYPES[self.meta.dtype])

    def __len__(self) -> int:
        return self.meta.tokens

    def slice(self, start: int, stop: int) -> torch.Tensor:
        return self.tokens[start:stop].to(torch.int64)
