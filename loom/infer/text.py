"""Prompts to token ids and generated ids back to text: plain prompts and chat ``messages`` (rendered with the
model's chat template, ``loom.data.chat``), incremental detokenizing for streaming, and the per-sequence stop rules
(EOS, stop ids, stop strings, the token budget)."""

from __future__ import annotations

import re
from collections.abc import Callable

from loom.config.errors import ConfigError


class Codec:
    """One tokenizer's prompts and outputs.

    ``prefix``: ids put before a plain prompt (a loom run's EOS: its documents follow one; a Hugging Face folder's
    tokenizer adds its own BOS, as ``tokenizer(text)`` does). ``template``: the chat template (``ChatTemplate``), or
    None; a rendered conversation is tokenized with the special tokens it writes as their ids and nothing added,
    as ``apply_chat_template`` does. Text out skips special tokens."""

    def __init__(
        self, tokenizer, template=None, prefix: tuple[int, ...] = (), add_special_tokens: bool = False
    ):
        self.tokenizer, self.template = tokenizer, template
        self.prefix, self.add_special_tokens = tuple(prefix), add_special_tokens
        self._hf = None
        # loom's byte tokenizer: an id below 128 is its ASCII character, whatever precedes it (Detokenizer's fast path)
        self.ascii_ids = False
        if getattr(
            tokenizer, "path", None
        ):  # an HF tokenizer.json: a second instance that reads special tokens
            from tokenizers import Tokenizer

            self._hf = Tokenizer.from_file(tokenizer.path)
        else:
            from loom.data.tokenizers import ByteTokenizer

            self.ascii_ids = isinstance(tokenizer, ByteTokenizer)
            self._special = {
                tokenizer.token(i): i for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
            }
            self._split = re.compile("(" + "|".join(re.escape(s) for s in self._special) + ")")

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        ids: list[int] = []  # the byte tokenizer: special tokens' names are their ids, the rest UTF-8 bytes
        for piece in self._split.split(text):
            ids += [self._special[piece]] if piece in self._special else list(piece.encode("utf-8"))
        return ids

    def encode(self, prompt) -> list[int]:
        """A plain prompt (str) or a conversation (a list of {"role", "content"} messages) -> ids."""
        if isinstance(prompt, str):
            return list(self.prefix) + self._encode(prompt, self.add_special_tokens)
        if isinstance(prompt, dict) and "messages" in prompt:
            prompt = prompt["messages"]
        if not (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
            raise ConfigError(
                "prompt", repr(prompt)[:60], "a string, or a list of {'role', 'content'} messages"
            )
        if self.template is None:
            raise ConfigError(
                "prompt",
                "messages",
                "this model has no chat template (give plain text, or a template: "
                "chat_template=PATH / --chat-template PATH)",
            )
        from loom.data.chat import ChatError

        try:
            text = self.template.render(prompt, add_generation_prompt=True)
        except ChatError as err:
            raise ConfigError("messages", repr(prompt)[:60], str(err)) from None
        return self._encode(text, False)

    def decode(self, ids) -> str:
        if self._hf is not None:
            return self._hf.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(ids)


class Detokenizer:
    """Text of a growing list of ids, decided piece by piece: a piece is final once decoding it no longer ends in an
    incomplete character (U+FFFD); ids are re-decoded from a few tokens back so that tokenizers whose pieces depend
    on their neighbours (leading spaces) come out as a whole decode would. ``ascii_ids``: an id below 128 decodes to
    its ASCII character whatever precedes it (loom's byte tokenizer), so one that follows decided text is decided
    without decoding (the same text: a decided piece ends at a whole character); a rollout step of 1,024 tokens
    decoded twice each cost its host milliseconds."""

    def __init__(self, decode: Callable[[list[int]], str], ascii_ids: bool = False):
        self.decode, self.ascii_ids = decode, ascii_ids
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0

    def add(self, token: int) -> str:
        """Append ``token``; returns the text this decided (maybe empty)."""
        if self.ascii_ids and token < 128 and self._read == len(self.ids):  # nothing undecided before it
            self.ids.append(token)
            delta = chr(token)
            self.text += delta
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        self.ids.append(token)
        before = self.decode(self.ids[self._prefix : self._read])
        now = self.decode(self.ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            delta = now[len(before) :]
            self.text += delta
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is left undecided (an incomplete character at the end) as it decodes."""
        rest = self.decode(self.ids[self._prefix :])[len(self.decode(self.ids[self._prefix : self._read])) :]
        self.text += rest
        self._prefix = self._read = len(self.ids)
        return rest


class Sequence:
    """One prompt's generation: its ids, its text (when a codec is given) and why it stopped.

    Stops at an EOS id (``eos_ids``, unless ``params.ignore_eos``) or a stop id (``finish_reason`` "eos" / "stop";
    the id is kept in ``token_ids``, not in the text), at a stop string ("stop"; the text ends before it), or after
    ``params.max_new_tokens`` ("length"). ``on_text(delta)``: streaming; text that could still become a stop
    string is held back until it cannot."""

    def __init__(
        self, params, eos_ids=(), codec: Codec | None = None, on_text: Callable[[str], None] | None = None
    ):
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._detok = Detokenizer(codec.decode, codec.ascii_ids) if codec is not None else None
        self._text = ""  # decided text, cut at a stop string
        self._sent = 0
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self.on_text = on_text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    def add(self, token: int) -> bool:
        """Take the next token; returns whether the sequence is done."""
        self.token_ids.append(token)
        if token in self.stop_ids:
            self._finish("eos" if token not in self.params.stop_token_ids else "stop")
            return True
        if self._detok is not None:
            before = len(self._text)
            self._text += self._detok.add(token)
            if self.params.stop and self._cut(max(0, before - self._hold)):
                return True
        if len(self.token_ids) >= self.params.max_new_tokens:
            if self._detok is not None:
                before = len(self._text)
                self._text += self._detok.flush()
                if self.params.stop and self._cut(max(0, before - self._hold)):
                    return True
            self._finish("length")
            return True
        self._stream(len(self._text) - self._hold if self.params.stop else len(self._text))
        return False

    def _cut(self, start: int) -> bool:
        """Whether a stop string occurs at or after ``start``; the text ends before the first one."""
        found = [i for i in (self._text.find(s, start) for s in self.params.stop) if i >= 0]
        if not found:
            return False
        self._text = self._text[: min(found)]
        self._finish("stop")
        return True

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._stream(len(self._text))

    def _stream(self, upto: int) -> None:
        if self.on_text is not None and upto > self._sent:
            self.on_text(self._text[self._sent : upto])
            self._sent = upto
