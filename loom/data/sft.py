"""SFT data: conversations read from jsonl / parquet / saved datasets (OpenAI-style ``messages``, or TRL's
``prompt`` / ``completion`` pairs), and the embedded default built from this Python's standard library: a function
with its docstring removed, asked for as a user message, and its docstring as the assistant's answer."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from loom.config.errors import ConfigError
from loom.data.sources import SourceSpec, no_surrogates, read_text, rows

COLUMNS = ("messages", "prompt", "completion")
ROLES_HINT = "each message an object with 'role' and 'content' (OpenAI style)"
# the embedded default keeps functions whose code and docstring fit these sizes (characters): short pairs keep most
# conversations within a window of the debug run
MAX_CODE, MAX_DOC, MIN_DOC = 1200, 600, 16
ASK = "Write the docstring of this Python function.\n\n```python\n{code}\n```"


@dataclass
class Conversation:
    messages: list[dict]
    first: int  # assistant turns before this message take no loss (a prompt-completion pair's prompt)
    where: str  # the file and line or row, for errors


def conversations(spec: SourceSpec) -> Iterator[Conversation]:
    """Every conversation of ``spec``, in a fixed order."""
    if spec.kind == "stdlib":
        yield from docstring_pairs(spec.paths)
        return
    if spec.kind not in ("jsonl", "parquet", "hf_dataset"):
        raise ConfigError(
            "data.source",
            spec.label or spec.paths[0],
            "training.objective sft reads conversations: "
            "jsonl, parquet or a saved Hugging Face dataset with 'messages' (or 'prompt' and "
            "'completion'), or a token file of `loom data prepare --objective sft` "
            f"(this source is {spec.kind})",
        )
    for path, where, row in rows(spec, COLUMNS):
        conv = from_row(row, f"{path} {where}", spec.encoding_errors)
        if conv is not None:
            yield conv


def checked_messages(value, where: str, column: str, errors: str) -> list[dict]:
    """A list of messages, checked (SFT rows and DPO pairs alike); string contents go through the same UTF-8 rule as
    text."""
    if not isinstance(value, list):
        raise ConfigError(
            "data.source",
            where,
            f"'{column}' must be a list of messages ({ROLES_HINT}); got a {type(value).__name__}",
        )
    out = []
    for k, m in enumerate(value):
        if isinstance(m, dict) and "role" in m and "content" in m and not isinstance(m["role"], str):
            raise ConfigError(
                "data.source",
                where,
                f"'{column}' message {k}: 'role' must be a string (system, user, assistant ...); got a "
                f"{type(m['role']).__name__} ({str(m['role'])[:40]})",
            )
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            keys = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise ConfigError(
                "data.source",
                where,
                f"'{column}' message {k} needs 'role' and 'content' ({ROLES_HINT}); it has {keys}",
            )
        content = m["content"]
        if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}, ...]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise ConfigError(
                    "data.source",
                    where,
                    f"'{column}' message {k}: content parts must each be "
                    '{"type": "text", "text": <a string>} (only text is trained)',
                )
            content = "".join(p["text"] for p in content)  # as one string: every template renders it
        elif content is not None and not isinstance(content, str):
            raise ConfigError(
                "data.source",
                where,
                f"'{column}' message {k}: 'content' must be a string or a list "
                f"of text parts; got a {type(content).__name__} ({str(content)[:40]})",
            )
        if isinstance(content, str):
            m = {**m, "content": no_surrogates(content, errors, where, f"message {k}, ")}
        out.append(m)
    return out


def from_row(row: dict, where: str, errors: str = "strict") -> Conversation | None:
    """One row as a conversation (None for an empty one). ``messages``: every assistant turn trains. ``prompt`` /
    ``completion``: two strings are a user and an assistant message; two lists of messages (TRL's conversational
    prompt-completion) are joined; either way only the completion trains."""
    if row.get("messages") is not None:
        messages = checked_messages(row["messages"], where, "messages", errors)
        return Conversation(messages, 0, where) if messages else None
    if "prompt" not in row or "completion" not in row:
        raise ConfigError(
            "data.source",
            where,
            f"a conversation needs 'messages', or 'prompt' and 'completion'; it has {sorted(row)[:8]}",
        )
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        prompt, completion = (no_surrogates(t, errors, where, "") for t in (prompt, completion))
        return Conversation(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], 1, where
        )
    if isinstance(prompt, list) and isinstance(completion, list):
        head = checked_messages(prompt, where, "prompt", errors)
        return Conversation(
            head + checked_messages(completion, where, "completion", errors), len(head), where
        )
    raise ConfigError(
        "data.source",
        where,
        "'prompt' and 'completion' must both be strings or both lists of "
        f"messages; got {type(prompt).__name__} and {type(completion).__name__}",
    )


# ---- the embedded default: docstrings of the standard library ----------------------------------------------------


def _functions(body: list) -> Iterator[ast.AST]:
    """Function definitions in source order, nested ones after the one that holds them."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        for name in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, name, None)
            if isinstance(inner, list):
                yield from _functions(inner)


def _without_docstring(lines: list[str], fn: ast.AST) -> str | None:
    """The function's source (its ``def`` line to its end, dedented) with the docstring's lines removed; None when
    the docstring shares a line with other code or is the whole body."""
    doc = fn.body[0]
    if (
        len(fn.body) < 2
        or doc.lineno == fn.lineno
        or lines[doc.end_lineno - 1][doc.end_col_offset :].strip()
        or lines[doc.lineno - 1][: doc.col_offset].strip()
    ):
        return None
    kept = lines[fn.lineno - 1 : doc.lineno - 1] + lines[doc.end_lineno : fn.end_lineno]
    return "".join(_dedent(line, fn.col_offset) for line in kept).rstrip() + "\n"


def _dedent(line: str, n: int) -> str:
    """``line`` without the ``n`` columns of indentation its function has (a blank line is just a newline; a line
    indented less, inside a multi-line string, stays as it is)."""
    if not line.strip():
        return "\n"
    return line[n:] if not line[:n].strip() else line


def docstring_pairs(paths: list[str]) -> Iterator[Conversation]:
    """For every function of these files that has a docstring (within ``MAX_CODE`` / ``MAX_DOC``): the user asks
    for the docstring of its code (the docstring removed), the assistant answers with the docstring (cleaned as
    ``inspect.cleandoc`` does). Files in order, functions in source order: the same pairs on every run."""
    for path in paths:
        source = read_text(path, "replace")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):  # a file this Python cannot parse (e.g. a lib2to3 test fixture)
            continue
        lines = source.splitlines(keepends=True)
        for fn in _functions(tree.body):
            doc = ast.get_docstring(fn, clean=True)
            if doc is None or not MIN_DOC <= len(doc) <= MAX_DOC:
                continue
            code = _without_docstring(lines, fn)
            if code is None or len(code) > MAX_CODE:
                continue
            yield Conversation(
                [
                    {"role": "user", "content": ASK.format(code=code.rstrip("\n"))},
                    {"role": "assistant", "content": doc},
                ],
                0,
                f"{path} line {fn.lineno}",
            )
