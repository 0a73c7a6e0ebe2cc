"""grpo.prompts: the rows GRPO and PPO sample completions for, read from a .jsonl file, parquet or a Hugging Face
dataset saved to disk (``save_to_disk``). A row's ``prompt`` is a string (tokenized as it is) or, as in TRL's
conversational format, a list of ``{"role", "content"}`` messages (a ``messages`` column is read as the prompt when
there is no ``prompt``), rendered with the chat template and its generation prompt; every other field goes to the
reward functions. Rows are drawn in a seeded order that depends only on (seed, step, rank), so a resumed run draws
the same."""

from __future__ import annotations

import hashlib

import torch

from loom.config.errors import ConfigError
from loom.data.sft import checked_messages
from loom.data.sources import parse_source, rows

FIELD = "grpo.prompts"


def conversational(prompt) -> bool:
    """A prompt given as a list of messages (TRL's conversational format)."""
    return isinstance(prompt, list)


def checked_prompt(row: dict, where: str) -> dict:
    """The row with its ``prompt`` (a string or a list of messages), ``messages`` read as the prompt when there is
    no ``prompt``."""
    if "prompt" not in row and "messages" in row:
        row = {"prompt": row["messages"], **{k: v for k, v in row.items() if k != "messages"}}
    prompt = row.get("prompt")
    kind = "none" if prompt is None else type(prompt).__name__
    if isinstance(prompt, str) and prompt:
        return row
    if isinstance(prompt, list) and prompt:  # checked as SFT's and DPO's messages are
        return {**row, "prompt": checked_messages(prompt, where, "prompt", "strict")}
    raise ConfigError(
        FIELD,
        where,
        "rows need a 'prompt' (a non-empty string, or a list of {'role', 'content'} "
        f"messages; or a 'messages' list); this one has {kind}"
        f" (columns {sorted(row)[:8]})",
    )


class PromptRows:
    """The rows of grpo.prompts, drawn ``n`` at a time for a (step, rank) key."""

    def __init__(self, source: str, seed: int):
        try:  # the data layer's errors name data.source: here they are grpo.prompts'
            specs = parse_source(source)
            if len(specs) != 1 or specs[0].kind not in ("jsonl", "parquet", "hf_dataset"):
                raise ConfigError(
                    FIELD,
                    source,
                    "one .jsonl or .parquet file, or a Hugging Face dataset folder "
                    "(save_to_disk), of rows with a 'prompt'",
                )
            self.rows = [checked_prompt(row, f"{path} {where}") for path, where, row in rows(specs[0], None)]
        except ConfigError as err:
            if err.field != "data.source":
                raise
            raise ConfigError(FIELD, err.value, err.allowed) from None
        except OSError as err:
            raise ConfigError(FIELD, source, f"a readable file ({type(err).__name__}: {err})") from None
        if not self.rows:
            raise ConfigError(FIELD, source, "rows with a 'prompt' (the source has none)")
        self.path, self.seed = source, seed
        self.chat = any(conversational(r["prompt"]) for r in self.rows)

    def problems(self, n: int, key: tuple) -> list[dict]:
        """``n`` rows for (step, rank) ``key``: a pure function of it, so a resumed run draws the same."""
        g = torch.Generator().manual_seed(
            int(hashlib.sha256(repr((self.seed, key)).encode()).hexdigest()[:15], 16)
        )
        picks = torch.randint(len(self.rows), (n,), generator=g).tolist()
        return [self.rows[i] for i in picks]

    def describe(self) -> str:
        return f"{self.path} ({len(self.rows)} prompts{', chat messages' if self.chat else ''})"
