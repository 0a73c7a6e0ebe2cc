"""Tokenizers: a built-in byte-level one (no files) and any Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import json
import os

from loom.config.errors import ConfigError, require

TOKENIZER_JSON = "tokenizer.json"
# files a Hugging Face tokenizer folder keeps beside its tokenizer.json: special tokens and the chat template
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def is_byte(spec: str) -> bool:
    return spec in ("", "byte")


def tokenizer_json(spec: str, field: str = "data.tokenizer") -> str:
    """The tokenizer.json ``spec`` names (the file, or a folder holding one), or a ConfigError naming the
    resolved path that is missing."""
    path = os.path.join(spec, TOKENIZER_JSON) if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        what = f"no {TOKENIZER_JSON} in this folder" if os.path.isdir(spec) else "not found"
        raise ConfigError(
            field,
            spec,
            f"{what} ({os.path.abspath(path)}); allowed: byte | path to a tokenizer.json "
            "or a folder holding one",
        )
    return path


def tokenizer_files(spec: str, field: str = "data.tokenizer") -> dict[str, str]:
    """The files of tokenizer ``spec`` (name in a copy -> source path): its tokenizer.json and, when that file is
    named tokenizer.json, the companions (``COMPANIONS``) its folder holds."""
    path = tokenizer_json(spec, field)
    files = {TOKENIZER_JSON: path}
    if os.path.basename(path) == TOKENIZER_JSON:
        folder = os.path.dirname(path)
        files.update(
            {n: os.path.join(folder, n) for n in COMPANIONS if os.path.isfile(os.path.join(folder, n))}
        )
    return files


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (``bytes_to_unicode``), indexed by byte value: the alphabet of
    Hugging Face's ByteLevel pre-tokenizer."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 256)}
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    return chars


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; then BOS, EOS, PAD."""

    name = "byte"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259
    # the special ids' names in the Hugging Face form (``hf_json``): the names loom's HFTokenizer looks for
    _NAMES = {256: "<s>", 257: "</s>", 258: "<pad>"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes):
        """Fast path for the byte tokenizer: a uint8 tensor view of the raw bytes."""
        import torch

        if not data:  # frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "byte-v1"

    def token(self, i: int) -> str:
        """Token ``i``'s name in ``hf_json``."""
        return self._NAMES.get(i) or _byte_chars()[i]

    def hf_json(self) -> str:
        """This tokenizer as a Hugging Face ``tokenizer.json`` with the same ids: a byte-level BPE without merges
        (byte b is token b) and BOS, EOS, PAD as special tokens 256, 257, 258. Nothing is added around a text,
        as loom adds nothing when it tokenizes."""
        tk = require("tokenizers", "hf", purpose="writing the byte tokenizer as a tokenizer.json")
        chars = _byte_chars()
        tok = tk.Tokenizer(tk.models.BPE(vocab={c: b for b, c in enumerate(chars)}, merges=[]))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens(
            [tk.AddedToken(name, special=True, normalized=False) for name in self._NAMES.values()]
        )
        assert all(tok.token_to_id(name) == i for i, name in self._NAMES.items())
        return tok.to_str(pretty=True)


class HFTokenizer:
    """Wraps ``tokenizers.Tokenizer``; EOS is the tokenizer's end-of-text token."""

    _EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")

    def __init__(self, path: str):
        Tokenizer = require("tokenizers", "data", purpose=f"data.tokenizer {path}").Tokenizer
        path = tokenizer_json(path)
        self.path = path
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:  # the tokenizers library raises a bare Exception for a bad file
            raise ConfigError("data.tokenizer", path, f"not a Hugging Face tokenizer.json ({err})") from None
        # A document that contains the text "<|endoftext|>" must not gain an EOS id in its middle: special
        # tokens written in the text are encoded as ordinary text, so EOS only ever marks document ends.
        self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find(self._EOS_CANDIDATES)
        if self.eos_id is None:
            raise ConfigError(
                "data.tokenizer",
                path,
                f"no end-of-text token found (looked for {', '.join(self._EOS_CANDIDATES)})",
            )
        self.bos_id = self._find(("<|begin_of_text|>", "<s>", "<bos>"))
        self.name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf"

    def _find(self, names) -> int | None:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_id(self, name: str) -> int | None:
        return self._tok.token_to_id(name)

    def config(self) -> dict:
        """The tokenizer_config.json beside the tokenizer.json ({} where there is none or it is unreadable)."""
        path = os.path.join(os.path.dirname(self.path), "tokenizer_config.json")
        if os.path.basename(self.path) != TOKENIZER_JSON or not os.path.isfile(path):
            return {}
        try:
            with open(path) as fh:
                out = json.load(fh)
        except (OSError, ValueError):
            return {}
        return out if isinstance(out, dict) else {}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    def fingerprint(self) -> str:
        with open(self.path, "rb") as fh:
            return "hf-" + hashlib.blake2b(fh.read(), digest_size=8).hexdigest()


def build_tokenizer(spec: str):
    return ByteTokenizer() if is_byte(spec) else HFTokenizer(spec)
