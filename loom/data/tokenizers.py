"""Tokenizers: a built-in byte-level one (no files) and any Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import os

from loom.config.errors import ConfigError


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; then BOS, EOS, PAD."""

    name = "byte"
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

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


class HFTokenizer:
    """Wraps ``tokenizers.Tokenizer``; EOS is the tokenizer's end-of-text token."""

    _EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("data.tokenizer", path, "needs the 'tokenizers' package (pip install 'loom-train[data]')") from None
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError("data.tokenizer", path, "allowed: byte | path to a tokenizer.json")
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
            raise ConfigError("data.tokenizer", path, "no end-of-text token found "
                              f"(looked for {', '.join(self._EOS_CANDIDATES)})")
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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    def fingerprint(self) -> str:
        with open(self.path, "rb") as fh:
            return "hf-" + hashlib.blake2b(fh.read(), digest_size=8).hexdigest()


def build_tokenizer(spec: str):
    return ByteTokenizer() if spec in ("", "byte") else HFTokenizer(spec)
