"""Pre-tokenized, memory-mapped token files.

``name.bin`` holds the token ids back to back (little-endian uint16 or uint32) with the EOS id
after every document; ``name.bin.json`` describes it (dtype, token count, documents, EOS id,
tokenizer fingerprint). ``loom data prepare`` writes them; any source is cached in this format.
An SFT token file also has ``name.bin.mask``: one byte of flags per token (``loom.data.chat``: the token takes
loss as a target; the token starts a conversation), so a conversation may hold the EOS id (a turn's end).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import socket
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
    mask: str = ""  # SFT: the loss mask's mode (data.loss_tokens) when name.bin.mask holds per-token flags
    chat_template: str = ""  # SFT: the chat template's origin and fingerprint
    trained_tokens: int = 0  # SFT: tokens that take loss as targets


def meta_path(path: str) -> str:
    return path + ".json"


def mask_path(path: str) -> str:
    """The per-token flags of an SFT token file, beside it."""
    return path + ".mask"


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


TEMP_TAG = (
    ".loom-tmp-"  # <file>.loom-tmp-<host>-<pid>: a file being written, renamed into place when complete
)


def temp_path(path: str) -> str:
    """Where this process writes ``path`` before renaming it into place: named for its host and pid, so that a
    later run can tell a dead writer's leftover from a live one's."""
    return f"{path}{TEMP_TAG}{socket.gethostname()}-{os.getpid()}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs here (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_temps(path: str) -> None:
    """Delete temporary files of ``path`` (and its description) left by killed writers on this host; those of
    live processes, and of other hosts sharing the folder, stay."""
    folder, base = os.path.split(os.path.abspath(path))
    host = socket.gethostname()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not name.startswith(base + ".") or TEMP_TAG not in name:
            continue
        owner_host, _, pid = name.rsplit(TEMP_TAG, 1)[1].rpartition("-")
        if owner_host == host and pid.isdecimal() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                os.remove(os.path.join(folder, name))
            except OSError:
                pass


class TokenFileWriteError(UserError):
    """A token file that could not be written (an unwritable folder, a full disk); nothing partial is left."""

    def __init__(self, path: str, err: OSError, written: int | None = None):
        self.path, self.reason = path, err.strerror or str(err)
        # a full disk: how far it got and what is free, so the user knows how much room to make
        at = "" if written is None else f" after {written:,} bytes"
        free = "" if written is None else f"; {free_bytes(path):,} bytes free there"
        self.detail = f"{self.reason}{at}{free}"
        super().__init__(
            f"token file {path} could not be written{at} ({self.reason}{free}); no partial file was kept"
        )


def write_whole(path: str, data: bytes) -> None:
    """``data`` into ``path`` through a temporary file renamed at the end: a full disk leaves no partial file, and
    the error is one line with the path, the bytes and what is free."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise UserError(
            f"{path}: writing {len(data):,} bytes failed ({err.strerror or err}; {free_bytes(path):,} bytes free "
            "there); nothing was written"
        ) from None


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds ``path``'s folder (0 where it cannot be asked)."""
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:
        return 0


class TokenFileWriter:
    """Append documents' token ids; ``close()`` writes the metadata last and renames into place. ``mask`` (an SFT
    file's loss-mask mode): every document also gets its per-token flags, written to ``mask_path``."""

    def __init__(
        self,
        path: str,
        *,
        eos_id: int,
        vocab_size: int,
        tokenizer: str,
        mask: str = "",
        chat_template: str = "",
    ):
        self.path = path
        self.dtype = dtype_for_vocab(vocab_size)
        self.meta = TokenFileMeta(
            self.dtype, 0, 0, eos_id, vocab_size, tokenizer, mask=mask, chat_template=chat_template
        )
        self._tmp = temp_path(path)
        self._tmp_mask = temp_path(mask_path(path)) if mask else None
        self._mask_fh = None
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            remove_stale_temps(path)
            self._fh = open(self._tmp, "wb")
            if mask:
                self._mask_fh = open(self._tmp_mask, "wb")
        except OSError as err:
            raise TokenFileWriteError(path, err) from None
        self._eos = torch.tensor([eos_id], dtype=DTYPES[self.dtype])
        self._written = 0

    def add(self, ids, flags: bytes | None = None) -> None:
        """``ids``: a list of ints or an integer tensor (one document, without EOS); ``flags``: its per-token flags
        (an SFT file; the EOS after it gets none)."""
        t = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.int64)
        t = torch.cat([t.to(DTYPES[self.dtype]), self._eos])
        if self._mask_fh is not None:
            assert flags is not None and len(flags) == t.numel() - 1, (
                "an SFT document needs one flag per token"
            )
            self._write(self._mask_fh, bytes(flags) + b"\0")
            if flags:
                self.meta.trained_tokens += int(
                    (torch.frombuffer(bytearray(flags), dtype=torch.uint8) & 1).sum()
                )
        self._write(self._fh, t.numpy().tobytes())
        self.meta.tokens += t.numel()
        self.meta.documents += 1

    def extend(self, tokens: torch.Tensor, documents: int, flags: torch.Tensor | None = None) -> None:
        """Append already-terminated token ids (and an SFT file's flags) as they are (copying another token file)."""
        if self._mask_fh is not None:
            self._write(self._mask_fh, flags.numpy().tobytes())
            self.meta.trained_tokens += int((flags & 1).sum())
        self._write(self._fh, tokens.to(DTYPES[self.dtype]).numpy().tobytes())
        self.meta.tokens += tokens.numel()
        self.meta.documents += documents

    def _write(self, fh, data: bytes) -> None:
        try:
            fh.write(data)
        except OSError as err:  # a full disk: the caller aborts, which removes the partial file
            raise TokenFileWriteError(self.path, err, self.written()) from None
        self._written += len(data)

    def written(self) -> int:
        """Bytes handed to the token (and mask) files so far."""
        return self._written

    def abort(self) -> None:
        """Drop the partial files, so a failed run leaves nothing that looks like a token file (closing a file
        whose buffer a full disk cannot take fails too: the file goes all the same)."""
        for fh, tmp in ((self._fh, self._tmp), (self._mask_fh, self._tmp_mask)):
            if fh is not None:
                with contextlib.suppress(OSError):
                    fh.close()
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)

    def close(self) -> TokenFileMeta:
        tmp_meta = temp_path(meta_path(self.path))
        try:
            self._fh.close()
            if self._mask_fh is not None:
                self._mask_fh.close()
            if os.path.exists(meta_path(self.path)):  # a stale description must never vouch for new tokens
                os.remove(meta_path(self.path))
            os.replace(self._tmp, self.path)
            if self._tmp_mask is not None:
                os.replace(self._tmp_mask, mask_path(self.path))
            with open(tmp_meta, "w") as fh:
                json.dump(asdict(self.meta), fh, indent=1)
            os.replace(tmp_meta, meta_path(self.path))
        except OSError as err:
            self.abort()
            for leftover in (tmp_meta, self.path):  # without its description the token file is incomplete
                if os.path.isfile(leftover):
                    os.remove(leftover)
            raise TokenFileWriteError(self.path, err, self.written()) from None
        return self.meta


def read_meta(path: str) -> TokenFileMeta:
    mp = meta_path(path)
    if not os.path.isfile(mp):
        raise UserError(
            f"token file {path}: its description {mp} is missing (write token files with `loom data prepare`)"
        )
    try:
        with open(mp) as fh:
            meta = TokenFileMeta(**json.load(fh))
    except (ValueError, TypeError) as err:
        raise UserError(
            f"token file {path}: its description {mp} is not a loom token file description ({err})"
        ) from None
    if meta.dtype not in DTYPES:
        raise UserError(
            f"token file {path}: unknown dtype {meta.dtype!r} in {mp} (allowed: {', '.join(DTYPES)})"
        )
    if not os.path.isfile(path):
        raise UserError(f"token file {path} is missing (only its description {mp} exists)")
    size = os.path.getsize(path)
    itemsize = DTYPES[meta.dtype].itemsize
    if size != meta.tokens * itemsize:
        raise UserError(
            f"token file {path}: {size} bytes, expected {meta.tokens * itemsize} "
            f"({meta.tokens} {meta.dtype} tokens); the file is truncated or not a loom token file"
        )
    if meta.mask:
        mp = mask_path(path)
        if not os.path.isfile(mp) or os.path.getsize(mp) != meta.tokens:
            found = f"{os.path.getsize(mp)} bytes" if os.path.isfile(mp) else "missing"
            raise UserError(
                f"token file {path}: its loss mask {mp} is {found}, expected {meta.tokens} bytes (one per "
                "token); write it again with `loom data prepare --objective sft`"
            )
    return meta


def check_tokenizer(path: str, meta: TokenFileMeta, tokenizer, field: str = "data.tokenizer") -> None:
    """Token ids only mean something with the tokenizer that wrote them: refuse any other one."""
    if meta.tokenizer != tokenizer.fingerprint() or meta.eos_id != tokenizer.eos_id:
        raise ConfigError(
            field,
            tokenizer.fingerprint(),
            f"token file {path} was written with tokenizer {meta.tokenizer} "
            f"(vocab {meta.vocab_size}, eos {meta.eos_id}); pass the same tokenizer",
        )


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
        self.mask: torch.Tensor | None = None  # (tokens,) uint8 flags of an SFT file
        if self.meta.mask:
            self._mask_fh = open(mask_path(path), "rb")
            self._mask_mm = mmap.mmap(self._mask_fh.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.mask = torch.frombuffer(self._mask_mm, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.meta.tokens

    def slice(self, start: int, stop: int) -> torch.Tensor:
        return self.tokens[start:stop].to(torch.int64)

    def flags(self, start: int, stop: int) -> torch.Tensor:
        """An SFT file's per-token flags (uint8) of tokens ``start:stop``."""
        return self.mask[start:stop].clone()

    def largest_id(self, chunk: int = 1 << 24) -> tuple[int, int]:
        """(largest token id, its position): one pass over the file, remembered per file version."""
        import numpy as np

        st = os.stat(self.path)
        key = (os.path.realpath(self.path), st.st_size, st.st_mtime_ns)
        if key not in _LARGEST:
            ids = np.frombuffer(self._mm, dtype=self.meta.dtype)
            best, where = -1, 0
            for start in range(0, len(ids), chunk):
                top = int(ids[start : start + chunk].max())
                if top > best:
                    best, where = top, start + int(ids[start : start + chunk].argmax())
            _LARGEST[key] = (best, where)
        return _LARGEST[key]


_LARGEST: dict[tuple, tuple[int, int]] = {}


def check_ids(tf: TokenFile, tokenizer, field: str = "data.source") -> None:
    """Every id of ``tf`` is one of ``tokenizer``'s: an id past the vocabulary would index past the embedding (a
    crash, or on a model with spare rows, training on rows no text maps to)."""
    top, where = tf.largest_id()
    if top >= tokenizer.vocab_size:
        raise ConfigError(
            field,
            tf.path,
            f"holds token id {top} (token {where}), but tokenizer "
            f"{tokenizer.fingerprint()} has {tokenizer.vocab_size} ids (0..{tokenizer.vocab_size - 1}): "
            "written with another tokenizer or damaged; re-create it with `loom data prepare` and the "
            "tokenizer you train with",
        )
