"""Chat templates: conversations rendered exactly as transformers' ``apply_chat_template`` renders them, tokenized
with the template's special tokens, and the tokens of the assistant's turns found (the ones SFT trains on).

The template comes from ``data.chat_template`` (a ``.jinja`` file), else from the tokenizer's folder
(``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``: a string, or named templates of which
``default`` is used); the byte tokenizer has a built-in one (``BUILTIN_TEMPLATE``). Rendering copies transformers'
Jinja environment (sandboxed, ``trim_blocks`` / ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, its
``tojson``, ``{% generation %}``), so a template renders here what it renders there; transformers is only the tests'
reference.

Which characters are the assistant's: the ``{% generation %}`` blocks where the template has them (transformers'
``return_assistant_tokens_mask``); otherwise each assistant turn is what rendering ``messages[:i + 1]`` adds to
``messages[:i]`` with the generation prompt (the turn's text and its end-of-turn token; the whitespace after it
separates turns and is not trained). Tokens overlapping those characters (tokenizer offsets) take loss.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache

from loom.config.errors import ConfigError

# The byte tokenizer's template: role headers as text, BOS before a conversation, EOS closing each assistant turn
# (the end-of-turn token a model learns to emit), "\n" between turns.
BUILTIN_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}\n"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}\n"
    "{{- '\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}\n"
)
BUILTIN = "<built-in>"
# the special-token variables transformers hands every template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatError(ValueError):
    """A conversation the template refuses (``raise_exception``) or renders in a way its turns cannot be found in."""


# ---- the Jinja environment (transformers' _cached_compile_jinja_template) -------------------------------------


@lru_cache(maxsize=16)
def compile_template(source: str):
    """``source`` compiled in the environment transformers renders chat templates in."""
    from contextlib import contextmanager
    from contextvars import ContextVar
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(jinja2.ext.Extension):
        """``{% generation %} ... {% endgeneration %}``: records the character span its body renders to."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._tracking = ContextVar("loom_assistant_tracker", default=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(
                lineno
            )

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller) -> str:
            rv = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(rv)))
            return rv

        @contextmanager
        def activate_tracker(self, blocks: list, spans: list):
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: Jinja's own escapes HTML characters
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` without attribute access to the real type (transformers' sandbox hardening)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore attributes (transformers' sandbox hardening)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore attributes ({name!r})"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=TemplateDict(),
        namespace=TemplateNamespace,
    )
    return env.from_string(source)


def _plain(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None dropped, a reasoning field under
    every name templates read it by (``reasoning_content``, ``thinking``)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A template, where it came from, and the special-token variables it is rendered with."""

    source: str
    origin: str  # a path, or BUILTIN
    variables: tuple[tuple[str, str], ...]  # (name, token text), e.g. ("eos_token", "<|im_end|>")

    @property
    def has_generation(self) -> bool:
        return bool(_GENERATION_TAG.search(self.source))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text, exactly as ``apply_chat_template(..., tokenize=False)``."""
        return self._render(messages, add_generation_prompt, None)

    def render_tracked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text and the character spans of its ``{% generation %}`` blocks."""
        spans: list[tuple[int, int]] = []
        return self._render(messages, False, spans), spans

    def _render(self, messages, add_generation_prompt, spans):
        import jinja2

        template = compile_template(self.source)
        kwargs = dict(
            self.variables,
            messages=_plain(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            if spans is None:
                return template.render(**kwargs)
            blocks: list[str] = []
            with template.environment.activate_tracker(blocks, spans):
                for block in template.generate(**kwargs):
                    blocks.append(block)
            return "".join(blocks)
        except jinja2.exceptions.TemplateError as err:
            raise ChatError(f"the chat template refused it: {err}") from None

    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=8)
        h.update(self.source.encode())
        h.update(repr(self.variables).encode())
        return h.hexdigest()


# ---- where a template comes from ------------------------------------------------------------------------------


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            out = json.load(fh)
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _folder_template(config: dict, folder: str) -> tuple[str, str] | None:
    """(template, origin) of a tokenizer folder: ``chat_template.jinja`` first (transformers prefers it), else
    tokenizer_config.json's ``chat_template`` (a string; or named templates, of which ``default``)."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read(), path
        except UnicodeDecodeError as err:
            raise ConfigError(
                "data.chat_template",
                path,
                f"not UTF-8 text (byte {err.start}): a Jinja chat template is a UTF-8 text file",
            ) from None
    found = config.get("chat_template")
    origin = os.path.join(folder, "tokenizer_config.json")
    if isinstance(found, list):  # [{"name": ..., "template": ...}, ...]
        found = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
    if isinstance(found, dict):
        if "default" not in found:
            raise ConfigError(
                "data.chat_template",
                "",
                f"{origin} has named chat templates {sorted(found)} but no "
                "'default': pass one as a .jinja file",
            )
        found = found["default"]
    return (found, origin) if isinstance(found, str) and found else None


def load_template(spec: str, tokenizer) -> ChatTemplate:
    """The template of ``data.chat_template`` = ``spec`` for ``tokenizer``: the file ``spec``, or ('') the
    tokenizer folder's, or for the byte tokenizer the built-in one. Its special-token variables come from the
    tokenizer folder (tokenizer_config.json, then special_tokens_map.json) as transformers reads them."""
    path = getattr(tokenizer, "path", None)  # an HFTokenizer's tokenizer.json
    config: dict = {}
    folder = None
    if path is not None and os.path.basename(path) == "tokenizer.json":
        folder = os.path.dirname(path)
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    # the byte tokenizer: its special tokens under the names its tokenizer.json export gives them
    if path is None:
        variables = {
            "bos_token": tokenizer.token(tokenizer.bos_id),
            "eos_token": tokenizer.token(tokenizer.eos_id),
            "pad_token": tokenizer.token(tokenizer.pad_id),
        }
    else:
        mapped = _read_json(os.path.join(folder, "special_tokens_map.json")) if folder else {}
        variables = {}
        for name in SPECIAL_TOKENS:
            text = _token_text(config.get(name))
            text = text if text is not None else _token_text(mapped.get(name))
            if text is not None:
                variables[name] = text
    if spec:
        if not os.path.isfile(spec):
            raise ConfigError(
                "data.chat_template",
                spec,
                "no such file (a Jinja chat template, e.g. chat_template.jinja; '' = the tokenizer folder's)",
            )
        try:
            with open(spec, encoding="utf-8") as fh:
                source, origin = fh.read(), os.path.abspath(spec)
        except UnicodeDecodeError as err:
            raise ConfigError(
                "data.chat_template",
                spec,
                f"not UTF-8 text (byte {err.start}): a Jinja chat template is a UTF-8 text file",
            ) from None
    elif path is None:
        source, origin = BUILTIN_TEMPLATE, BUILTIN
    else:
        found = _folder_template(config, folder) if folder else None
        if found is None:
            raise ConfigError(
                "data.chat_template",
                "",
                f"the tokenizer {path} has no chat template (no "
                "chat_template.jinja or tokenizer_config.json chat_template beside it): pass a .jinja "
                "file (docs/finetuning.md)",
            )
        source, origin = found
    template = ChatTemplate(source, origin, tuple(sorted(variables.items())))
    try:
        compile_template(source)
    except Exception as err:  # a TemplateSyntaxError, or an unknown tag
        raise ConfigError(
            "data.chat_template", spec or origin, f"not a valid Jinja template ({err})"
        ) from None
    probe_template(template, spec or origin)
    return template


# a conversation of unique markers: a template that renders without one drops that message's content
PROBE_MARKERS = {
    "system": "LoomProbeSystemQx7",
    "user": "LoomProbeUserKz3",
    "assistant": "LoomProbeAssistantVw5",
}


def probe_template(template: ChatTemplate, name: str) -> None:
    """Render one probe conversation (system, user, assistant; without the system message where the template refuses
    one) and refuse (a ConfigError naming the template) one whose text lacks a user's or the assistant's content,
    e.g. ``m.text`` for ``m.content`` (it would train on role names or EOS only), or whose assistant mask misses the
    assistant's reply; a template that leaves the system message out is a warning (some do so by design). A template
    that refuses both conversations is left to the data's own errors."""
    conversations = [
        [{"role": r, "content": PROBE_MARKERS[r]} for r in ("system", "user", "assistant")],
        [{"role": r, "content": PROBE_MARKERS[r]} for r in ("user", "assistant")],
    ]
    for messages in conversations:
        try:
            text = template.render(messages)
        except Exception:  # a ChatError (raise_exception), or the template's own runtime error
            continue
        missing = [(i, m["role"]) for i, m in enumerate(messages) if m["content"] not in text]
        for i, role in missing:
            if role != "system":
                raise ConfigError(
                    "data.chat_template",
                    name,
                    f"the template renders a conversation without message "
                    f"{i}'s content (role {role}): it must print each message's 'content'",
                )
        if missing:  # some real templates leave system messages out by design: said once, not refused
            import warnings

            warnings.warn(
                f"data.chat_template {name}: the template leaves a system message's content out of the "
                "conversation (system messages in the data are neither seen nor trained on)",
                stacklevel=2,
            )
        try:
            _, spans = assistant_spans(template, messages)
        except Exception:
            return  # the data's own conversations report it (ChatError) where it matters
        where = text.find(PROBE_MARKERS["assistant"])
        end = where + len(PROBE_MARKERS["assistant"])
        if not any(a <= where and end <= b for a, b in spans):
            raise ConfigError(
                "data.chat_template",
                name,
                "the assistant mask does not cover the assistant's reply "
                "(its {% generation %} block, or what an assistant turn adds, misses the content)",
            )
        return


# ---- which characters are the assistant's ----------------------------------------------------------------------


def assistant_spans(
    template: ChatTemplate, messages: list[dict], first: int = 0
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns from message ``first`` on (a
    prompt-completion pair trains its completion only). ``{% generation %}`` blocks where the template has them;
    otherwise incremental rendering, which needs a template that renders a conversation's beginning the same
    whatever follows (a ChatError otherwise)."""
    if template.has_generation:
        text, spans = template.render_tracked(messages)
        skip = len(template.render_tracked(messages[:first])[1]) if first else 0  # the prompt's own blocks
        return text, spans[skip:]
    text = template.render(messages)
    spans = []
    for i in range(first, len(messages)):
        if messages[i].get("role") != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[: i + 1])
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ChatError(
                f"message {i}: the chat template renders the conversation's beginning differently once "
                "later messages follow, so the assistant's turns cannot be located; use a template with "
                "{% generation %} blocks (data.chat_template)"
            )
        spans.append((len(before), max(len(before), len(upto.rstrip()))))
    return text, spans


def overlap_mask(offsets, spans: list[tuple[int, int]]):
    """Whether each token (character ``offsets`` (N, 2), in order) overlaps a span (in order): transformers' rule
    for ``return_assistant_tokens_mask`` (the first span ending after the token's start must begin before its end),
    as a bool array (N,)."""
    import numpy as np

    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not spans:
        return np.zeros(len(offsets), dtype=bool)
    starts, ends = np.asarray(spans, dtype=np.int64).T  # (K,) each
    k = np.searchsorted(ends, offsets[:, 0], side="right")  # the first span with end > token start
    inside = k < len(spans)
    return inside & (starts[np.minimum(k, len(spans) - 1)] < offsets[:, 1])


# ---- tokens with their character offsets -----------------------------------------------------------------------


class _ByteChat:
    """The byte tokenizer on rendered chats: the special tokens' names (``<s>``, ``</s>``, ``<pad>``) are their ids,
    as in the byte tokenizer's tokenizer.json export; every other character is its UTF-8 bytes."""

    def __init__(self, tokenizer):
        self.special = {tokenizer.token(i): i for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)}
        self._split = re.compile(
            "(" + "|".join(re.escape(s) for s in sorted(self.special, key=len, reverse=True)) + ")"
        )

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets, pos = [], [], 0
        for piece in self._split.split(text):
            if piece in self.special:
                ids.append(self.special[piece])
                offsets.append((pos, pos + len(piece)))
            elif piece.isascii():
                ids += piece.encode()
                offsets += [(pos + i, pos + i + 1) for i in range(len(piece))]
            else:
                for i, ch in enumerate(piece):
                    b = ch.encode("utf-8", "surrogatepass")
                    ids += b
                    offsets += [(pos + i, pos + i + 1)] * len(b)
            pos += len(piece)
        return ids, offsets


class _HFChat:
    """A Hugging Face tokenizer on rendered chats: special tokens written by the template are their ids (the
    ``tokenizers`` default that transformers keeps), no BOS/EOS added around the text."""

    def __init__(self, tokenizer):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(tokenizer.path)  # loom's own instance encodes special tokens as text

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets


LOSS_TOKENS = ("assistant", "all")
FLAG_LOSS, FLAG_START = (
    1,
    2,
)  # per-token flags of an SFT token file: takes loss as a target; starts a conversation


class ChatEncoder:
    """Conversations to token ids and per-token flags (``FLAG_LOSS``: the token is a target that takes loss;
    ``FLAG_START``: the conversation's first token). ``loss_tokens``: 'assistant' = the assistant's turns,
    'all' = every token after the first."""

    VERSION = "loom-sft-v1"  # changes whenever the same inputs would give other tokens or flags

    def __init__(self, template: ChatTemplate, tokenizer, loss_tokens: str = "assistant"):
        if loss_tokens not in LOSS_TOKENS:
            raise ConfigError("data.loss_tokens", loss_tokens, "allowed: " + " | ".join(LOSS_TOKENS))
        self.template, self.loss_tokens = template, loss_tokens
        self._enc = _HFChat(tokenizer) if getattr(tokenizer, "path", None) else _ByteChat(tokenizer)

    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{self.VERSION}|{self.loss_tokens}|{self.template.fingerprint()}".encode())
        return h.hexdigest()

    def encode(self, messages: list[dict], first: int = 0) -> tuple[list[int], bytearray]:
        """(ids, flags) of one conversation; assistant turns before message ``first`` take no loss."""
        if self.loss_tokens == "all":
            text, spans = self.template.render(messages), None
        else:
            text, spans = assistant_spans(self.template, messages, first)
        ids, offsets = self._enc.encode(text)
        flags = (
            bytearray([FLAG_LOSS]) * len(ids)
            if spans is None
            else bytearray((overlap_mask(offsets, spans) * FLAG_LOSS).astype("uint8").tobytes())
        )
        if ids:
            flags[0] = (
                FLAG_START  # a conversation's first token is never a target: nothing before it is its context
            )
        return list(ids), flags
