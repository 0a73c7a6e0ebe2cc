"""Judge rewards (RLAIF): a judge model (a loom checkpoint or run dir, an import, or a Hugging Face folder, loaded
through loom.infer as ``loom generate`` loads it, one whole copy per rank) reads a prompt rendered from
``grpo.judge_template`` and its output becomes a score. Two scorings (``grpo.judge_score``):

- ``number``: a greedy generation of up to ``grpo.judge_max_new_tokens`` tokens; the first match of
  ``grpo.judge_pattern``'s group is the score, clipped to ``grpo.judge_range``. An output without a match scores the
  range's low end and is counted (``judge/unparsed``: the share of this rank's last batch; a logged fallback, not an
  error: a policy can make its judge say anything).
- ``yes_no``: P(yes) / (P(yes) + P(no)) of the judge's next token after the prompt, the two tokens of
  ``grpo.judge_tokens`` (each one token of the judge's tokenizer), scaled onto ``grpo.judge_range``.

The template: ``str.format`` with ``{prompt}``, ``{completion}`` and the prompt row's other fields, or Jinja2 (a
``.jinja`` file, or text holding ``{{`` or ``{%``) with the same names. ``grpo.judge_template`` is the text, or a
path to a file holding it. A field the rows do not have, or a template Jinja2 cannot parse, is a ConfigError.
The judge is a reward function with the calling convention of loom.rl.rewards (``Rewards`` weighs it with
``grpo.judge_weight`` beside the others)."""

from __future__ import annotations

import os
import re
import string

import torch

from loom.config.errors import ConfigError

FIELD = "grpo.judge_template"


class Template:
    """A judge prompt template: ``render(prompt=..., completion=..., **fields) -> str``."""

    def __init__(self, spec: str):
        text = spec
        if spec and "\n" not in spec and os.path.isfile(spec):
            try:
                with open(spec, encoding="utf-8") as fh:
                    text = fh.read()
            except UnicodeDecodeError as err:
                raise ConfigError(FIELD, spec, f"not UTF-8 text (byte {err.start})") from None
        elif looks_like_path(spec):
            raise ConfigError(
                FIELD,
                spec,
                "no such file (a value that looks like a path is read as one; template "
                "text has {prompt} and {completion})",
            )
        if not text.strip():
            raise ConfigError(
                FIELD, spec, "a template with {prompt} and {completion} (text, or a file holding it)"
            )
        self.spec, self.text = spec, text
        self.jinja = spec.endswith(".jinja") or "{{" in text or "{%" in text
        if self.jinja:
            import jinja2

            try:
                self._template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(text)
            except jinja2.TemplateSyntaxError as err:
                raise ConfigError(
                    FIELD, spec, f"a Jinja2 template that parses (line {err.lineno}: {err.message})"
                ) from None
        else:
            try:
                names = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
            except ValueError as err:
                raise ConfigError(
                    FIELD, spec, f"a str.format template ({err}); use {{{{ and }}}} for braces"
                ) from None
            if any(not n or not n.isidentifier() for n in names):
                raise ConfigError(
                    FIELD, spec, "named fields only ({prompt}, {completion}, a prompt row's field)"
                )

    def render(self, **values) -> str:
        try:
            if self.jinja:
                return self._template.render(**values)
            return self.text.format(**values)
        except KeyError as err:
            raise ConfigError(
                FIELD, self.spec, f"fields from {sorted(values)} (the rows have no {err})"
            ) from None
        except Exception as err:  # jinja2.UndefinedError and the like: one line, naming the field
            if type(err).__name__ == "UndefinedError":
                raise ConfigError(FIELD, self.spec, f"fields from {sorted(values)} ({err})") from None
            raise


def looks_like_path(spec: str) -> bool:
    """A one-word value without template fields that names a file (a folder in it, or a template's extension)."""
    word = spec.strip()
    return (
        bool(word)
        and not any(c.isspace() for c in word)
        and not any(c in word for c in "{}")
        and (os.sep in word or word.endswith((".jinja", ".j2", ".txt", ".tmpl", ".template", ".md")))
    )


def parse_range(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise ConfigError("grpo.judge_range", text, "'low,high' (e.g. 0,10)") from None
    if not lo < hi:
        raise ConfigError("grpo.judge_range", text, "low < high")
    return lo, hi


def plain(text) -> str:
    """A prompt or completion as the judge's template reads it: a string as it is, chat messages (TRL's
    conversational format) as their contents, one per line."""
    return text if isinstance(text, str) else "\n".join(m["content"] for m in text)


class Judge:
    """A reward function scoring completions with a judge model (see the module's docstring). ``g``: the [grpo]
    section; the model loads on first use, on ``device`` (set it before: the trainer's)."""

    def __init__(self, g, device: str = "cpu"):
        self.g, self.device = g, device
        if os.path.isdir(g.judge):  # before training: a reward model cannot judge (it generates nothing)
            from loom.infer.load import refuse_reward_model

            refuse_reward_model(g.judge, "grpo.judge")
        self.template = Template(g.judge_template)
        self.low, self.high = parse_range(g.judge_range)
        try:
            self.pattern = re.compile(g.judge_pattern)
        except re.error as err:
            raise ConfigError(
                "grpo.judge_pattern", g.judge_pattern, f"a regular expression ({err})"
            ) from None
        if g.judge_score == "number" and self.pattern.groups != 1:
            raise ConfigError("grpo.judge_pattern", g.judge_pattern, "one capturing group: the number")
        words = [w for w in g.judge_tokens.split(",")]
        if len(words) != 2 or not all(words):
            raise ConfigError(
                "grpo.judge_tokens", g.judge_tokens, "two words 'yes,no' (each one judge token)"
            )
        self.words = words
        self.generator = None
        self.token_ids: tuple[int, int] | None = None
        self.unparsed = 0.0  # share of the last batch's outputs without a number

    def load(self):
        """The judge's generator (every rank its own copy: each scores its own completions)."""
        if self.generator is None:
            from loom.infer.generator import Generator

            self.generator = Generator(self.g.judge, device=self.device, compile=False, tp=False)
            if self.g.judge_score == "yes_no":
                self.token_ids = tuple(self._one_token(w) for w in self.words)
        return self.generator

    def _one_token(self, word: str) -> int:
        ids = self.generator.codec._encode(word, False) if self.generator.codec is not None else []
        if len(ids) != 1:
            raise ConfigError(
                "grpo.judge_tokens",
                self.g.judge_tokens,
                f"words that are one token of the judge's tokenizer ({word!r} is {len(ids)})",
            )
        return ids[0]

    def prompts(self, prompts: list[str], completions: list[str], fields: dict[str, list]) -> list[str]:
        """The judge's prompt text for each completion."""
        return [
            self.template.render(prompt=plain(p), completion=plain(c), **{k: v[i] for k, v in fields.items()})
            for i, (p, c) in enumerate(zip(prompts, completions))
        ]

    def parse(self, text: str) -> float | None:
        """The number of a judge's output, clipped to the range; None: no match."""
        m = self.pattern.search(text)
        if m is None:
            return None
        try:
            return min(max(float(m.group(1)), self.low), self.high)
        except ValueError:
            return None

    @torch.no_grad()
    def yes_probability(self, texts: list[str]) -> list[float]:
        """P(yes) / (P(yes) + P(no)) of the judge's next token after each text (fp32)."""
        gen = self.load()
        model, yes, no = gen.model, *self.token_ids
        out = []
        for start in range(0, len(texts), gen.max_batch):
            ids = [gen.encode(t) for t in texts[start : start + gen.max_batch]]
            lengths = torch.tensor([len(i) for i in ids])
            tokens = torch.zeros(
                len(ids), int(lengths.max()), dtype=torch.long
            )  # (B, S) right-padded (causal)
            for i, row in enumerate(ids):
                tokens[i, : len(row)] = torch.tensor(row)
            logits = model(tokens.to(gen.device))  # (B, S, V)
            last = logits[torch.arange(len(ids)), (lengths - 1).to(gen.device)].float()  # (B, V)
            pair = torch.stack([last[:, yes], last[:, no]], dim=1).softmax(dim=1)  # (B, 2)
            out += pair[:, 0].cpu().tolist()
        return out

    def __call__(
        self, prompts: list[str], completions: list[str], completion_ids=None, **fields
    ) -> list[float]:
        texts = self.prompts(prompts, completions, fields)
        gen = self.load()
        if self.g.judge_score == "yes_no":
            return [self.low + (self.high - self.low) * p for p in self.yes_probability(texts)]
        outs = gen.generate(texts, max_new_tokens=self.g.judge_max_new_tokens, temperature=0.0)
        scores = [self.parse(o.text) for o in outs]
        self.unparsed = sum(s is None for s in scores) / max(len(scores), 1)
        return [self.low if s is None else s for s in scores]
