"""DPO data: preference pairs (``prompt``, ``chosen``, ``rejected``) read from jsonl / parquet / saved datasets, as
plain strings or TRL's conversational format, rendered with the chat template SFT uses; the embedded default built
from this Python's standard library; and the pair loader.

A pair is stored as two documents of an SFT-style token file (mask mode ``dpo``): prompt + chosen, then prompt +
rejected, each flagged where its completion's tokens are (``FLAG_LOSS``) and where it starts (``FLAG_START``). The
file does not depend on ``training.seq_len``: the loader truncates each sequence to ``seq_len`` tokens keeping the
start (TRL's ``keep_start``), leaves out pairs that keep no completion token, and pads the rest."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from loom.config.errors import ConfigError, UserError
from loom.data.chat import FLAG_LOSS, FLAG_START, ChatEncoder, ChatError
from loom.data.loader import MicroBatch, StepData, _mix, _share_read, visit_order
from loom.data.sft import checked_messages, docstring_pairs
from loom.data.sources import SourceSpec, no_surrogates, rows
from loom.data.token_file import TokenFile, TokenFileWriter
from loom.numerics import IGNORE

COLUMNS = ("prompt", "chosen", "rejected")
MASK = "dpo"  # the token file's mask mode: documents are pairs of sequences
KTO_MASK, FLAG_DESIRABLE = "kto", 4  # a KTO file (loom.data.kto): its examples' labels, on their first token
# the embedded default keeps functions this short (characters of code), so that most pairs fit the debug run's window
MAX_CODE = 400


@dataclass
class Pair:
    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    where: str  # the file and line or row, for errors


def pairs(spec: SourceSpec) -> Iterator[Pair]:
    """Every preference pair of ``spec``, in a fixed order."""
    if spec.kind == "stdlib":
        yield from docstring_preferences(spec.paths, spec.extra.get("rejected", "docstring"))
        return
    if spec.kind not in ("jsonl", "parquet", "hf_dataset"):
        raise ConfigError(
            "data.source",
            spec.label or spec.paths[0],
            "training.objective dpo reads preference pairs: "
            "jsonl, parquet or a saved Hugging Face dataset with 'prompt', 'chosen' and 'rejected' "
            f"(this source is {spec.kind})",
        )
    for path, where, row in rows(spec, COLUMNS):
        yield from_row(row, f"{path} {where}", spec.encoding_errors)


def from_row(row: dict, where: str, errors: str = "strict") -> Pair:
    """One row as a pair. Three strings: the prompt is a user message, chosen and rejected assistant messages (so
    that they go through the chat template, as SFT's prompt-completion strings do). Lists of messages (TRL's
    conversational format): the prompt's messages, then the chosen or the rejected ones. Without 'prompt' (TRL's
    implicit-prompt format: chosen and rejected are whole conversations, or texts, with a shared beginning) the
    prompt is their common prefix, as TRL's ``extract_prompt`` takes it."""
    if "prompt" not in row and "chosen" in row and "rejected" in row:
        row = implicit_prompt(row, where)
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise ConfigError(
            "data.source",
            where,
            f"a preference pair needs 'prompt', 'chosen' and 'rejected'; it has {sorted(row)[:8]}",
        )
    values = [row[c] for c in COLUMNS]
    if all(isinstance(v, str) for v in values):
        p, c, r = (no_surrogates(v, errors, where, "") for v in values)
        return Pair(
            [{"role": "user", "content": p}],
            [{"role": "assistant", "content": c}],
            [{"role": "assistant", "content": r}],
            where,
        )
    if all(isinstance(v, list) for v in values):
        return Pair(*(checked_messages(v, where, c, errors) for v, c in zip(values, COLUMNS)), where)
    raise ConfigError(
        "data.source",
        where,
        "'prompt', 'chosen' and 'rejected' must all be strings or all lists of "
        f"messages; got {', '.join(type(v).__name__ for v in values)}",
    )


def implicit_prompt(row: dict, where: str) -> dict:
    """``row`` with 'prompt' the longest common prefix of 'chosen' and 'rejected' (messages, or characters of two
    texts, a space before the split going with the completions) and each of them the rest: TRL's extract_prompt."""
    chosen, rejected = row["chosen"], row["rejected"]
    if not (
        isinstance(chosen, list)
        and isinstance(rejected, list)
        or isinstance(chosen, str)
        and isinstance(rejected, str)
    ):
        return row  # the missing 'prompt' is reported with the other columns' types
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    if n == 0 or n == len(chosen) or n == len(rejected):
        what = "messages" if isinstance(chosen, list) else "characters"
        raise ConfigError(
            "data.source",
            where,
            "no 'prompt': chosen and rejected must then share a beginning (the "
            f"prompt, TRL's implicit-prompt format) and differ after it; they share {n} {what} of "
            f"{len(chosen)} and {len(rejected)}",
        )
    return {**row, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def docstring_preferences(paths: list[str], rejected: str = "docstring") -> Iterator[Pair]:
    """SFT's docstring pairs (loom.data.sft) as preferences: the prompt asks for a function's docstring, chosen is
    its own. ``rejected``: 'docstring' = the docstring of the function half the list away (another file's, the same
    on every run); 'code' = the function's code echoed back as the answer, fenced as the prompt shows it.

    'docstring': functions i and i + n/2 swap docstrings, and their two pairs come one after the other: every
    docstring is chosen once and rejected once, in neighbouring pairs, so the held-out split (the last pairs) never
    holds a docstring that training saw with the other label (half the list apart, a model that memorized
    docstrings would score below chance there). 'code': one pair per function, in list order."""
    convs = [c for c in docstring_pairs(paths) if len(c.messages[0]["content"]) <= MAX_CODE + 64]
    if rejected == "code":
        for conv in convs:
            ask = conv.messages[0]["content"]
            yield Pair(
                conv.messages[:1],
                conv.messages[1:],
                [{"role": "assistant", "content": echoed_code(ask)}],
                conv.where,
            )
        return
    n, half = len(convs), len(convs) // 2
    order = [k for i in range(half) for k in (i, i + half)] + ([n - 1] if n % 2 else [])
    for k in order:
        conv = convs[k]
        other = convs[k + half if k < half else k - half].messages[1]
        if other["content"] == conv.messages[1]["content"]:
            continue
        yield Pair(conv.messages[:1], conv.messages[1:], [other], conv.where)


def echoed_code(ask: str) -> str:
    """The fenced code block of an embedded prompt (loom.data.sft.ASK), as an answer that repeats the question."""
    return ask[ask.index("```python") :]


def encoder_fingerprint(encoder: ChatEncoder) -> str:
    """The cache key of a DPO token file: the chat template (SFT's encoder) and this format's version."""
    return hashlib.blake2b(f"loom-dpo-v2|{encoder.fingerprint()}".encode(), digest_size=8).hexdigest()


def write_pairs(spec: SourceSpec, encoder: ChatEncoder, writer: TokenFileWriter) -> None:
    """Each pair as two flagged sequences; a pair whose completions hold no token to train on is left out."""
    for pair in pairs(spec):
        try:
            seqs = [
                encoder.encode(pair.prompt + completion, len(pair.prompt))
                for completion in (pair.chosen, pair.rejected)
            ]
        except ChatError as err:
            raise ConfigError("data.source", pair.where, str(err)) from None
        if all(any(f & FLAG_LOSS for f in flags) for _, flags in seqs):
            for ids, flags in seqs:
                writer.add(ids, flags)


# ---- the loader ------------------------------------------------------------------------------------------------


class PairFile:
    """The pairs of a DPO token file at one ``seq_len``: where each sequence starts and ends, which pairs keep a
    completion token after truncation, and the training / validation split of those (the last ``val_fraction``)."""

    def __init__(self, tokens: TokenFile, seq_len: int, val_fraction: float, label: str):
        self.tokens, self.seq_len, self.label = tokens, seq_len, label
        mask = tokens.mask
        self.starts = torch.nonzero(mask & FLAG_START).flatten()  # (2P,)
        # every sequence is followed by the EOS separator, which is not part of it
        self.ends = torch.cat([self.starts[1:], torch.tensor([len(tokens)])]) - 1
        loss_at = torch.nonzero(mask & FLAG_LOSS).flatten()
        first = torch.searchsorted(loss_at, self.starts)  # each sequence's first completion token
        first_pos = torch.cat([loss_at, torch.tensor([len(tokens)])])[first]
        fits = (first_pos < self.ends) & (first_pos - self.starts < seq_len)  # (2P,)
        self.kept = torch.nonzero(fits.view(-1, 2).all(dim=1)).flatten()  # pair indices of the file
        self.n_pairs = len(self.starts) // 2
        n = len(self.kept)
        # as windows are split
        self.n_val = max(1, int(n * val_fraction)) if val_fraction > 0 and n >= 2 else 0
        self.n_train = n - self.n_val
        if self.n_train < 1:
            raise UserError(
                f"data source {label} ({tokens.path}): no preference pair keeps a completion token "
                f"within training.seq_len {seq_len} (raise training.seq_len or shorten the prompts)"
            )
        # a pair whose chosen and rejected sequences are the same tokens (within seq_len) has no signal: its
        # margin is 0 whatever the model, so it trains nothing
        self.no_signal = sum(
            torch.equal(self.sequence(2 * int(p))[0], self.sequence(2 * int(p) + 1)[0]) for p in self.kept
        )
        if self.no_signal == len(self.kept):
            raise UserError(
                f"data source {label} ({tokens.path}): in every one of the {len(self.kept):,} preference "
                f"pairs chosen equals rejected (within training.seq_len {seq_len}): nothing to learn"
            )

    def sequence(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (int64) and flags (uint8) of sequence ``s`` of the file, truncated to ``seq_len``."""
        start = int(self.starts[s])
        stop = min(int(self.ends[s]), start + self.seq_len)
        return self.tokens.slice(start, stop), self.tokens.flags(start, stop)

    def train_ids(self, k: torch.Tensor, seed: int) -> torch.Tensor:
        """The k-th training pairs visited (indices into ``kept``), one permutation per epoch."""
        return visit_order(k, self.n_train, seed)


def pair_batch(source: PairFile, ids: list[int], pad_id: int, ref: torch.Tensor | None) -> MicroBatch:
    """The micro-batch of kept pairs ``ids``: rows chosen 0..B-1, then rejected 0..B-1 (TRL's order), each
    padded to ``seq_len``; a label takes loss where its token is a completion token; document ids are 0 on a row's
    tokens and 1 on its padding (a reward model reads each row's last token: loom.methods.reward). ``ref``: the
    reference log-probabilities (kept pairs, 2) of every pair, or None."""
    b, s = len(ids), source.seq_len
    inputs = torch.full((2 * b, s), pad_id, dtype=torch.int64)
    labels = torch.full((2 * b, s), IGNORE, dtype=torch.int64)
    documents = torch.ones((2 * b, s), dtype=torch.int64)
    desirable = torch.zeros(b, dtype=torch.bool)  # a KTO file's labels (loom.data.kto)
    for half in range(2):
        for i, k in enumerate(ids):
            tokens, flags = source.sequence(2 * int(source.kept[k]) + half)
            if half == 0:
                desirable[i] = bool(flags[0] & FLAG_DESIRABLE)
            row, n = half * b + i, len(tokens)
            inputs[row, :n], documents[row, :n] = tokens, 0
            labels[row, : n - 1] = torch.where((flags[1:] & FLAG_LOSS) > 0, tokens[1:], IGNORE)
    positions = torch.arange(s).expand(2 * b, s).contiguous()
    # (2B,)
    refs = None if ref is None else ref[torch.tensor(ids, dtype=torch.int64)].T.flatten().contiguous()
    labelled = source.tokens.meta.mask == KTO_MASK
    return MicroBatch(inputs, labels, positions, documents, refs, desirable if labelled else None)


class PairLoader:
    """The LM loader's contract (loom.data.loader.Loader) over preference pairs: the global batch of step t is the
    pairs ``consumed .. consumed + global_batch`` of a seeded permutation per epoch, whatever the layout; a rank
    takes micro-batch j's pairs at ``(j x dp + rank) x micro_batch``. ``training.global_batch_size`` counts pairs."""

    def __init__(
        self,
        source: PairFile,
        *,
        seed: int,
        pad_id: int,
        dp_rank: int,
        dp_size: int,
        micro_batch: int,
        accumulation: int,
    ):
        self.source, self.seed, self.pad_id = source, seed, pad_id
        self.sources = [source]
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.consumed = 0
        self.reference: torch.Tensor | None = None  # (kept pairs, 2) float32: chosen, rejected

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp_size

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    def describe(self, global_batch: int, steps: int) -> list[str]:
        src = self.source
        epochs = steps * global_batch / src.n_train
        dropped = src.n_pairs - len(src.kept)
        what = "KTO examples" if src.tokens.meta.mask == KTO_MASK else "preference pairs"
        lines = [
            f"data: {src.label}: {src.n_pairs:,} {what} ({dropped:,} without a completion token within "
            f"seq_len {src.seq_len} left out), {src.n_train} training"
            f"{f', {src.n_val} validation' if src.n_val else ''}; the run reads {_share_read(epochs)} of them"
        ]
        if epochs > 1:
            lines.append(f"warning: {src.label} will be repeated: {epochs:.1f} epochs")
        if src.no_signal:
            lines.append(
                f"warning: {src.label}: {src.no_signal:,} of {len(src.kept):,} preference pairs have chosen "
                "equal to rejected (no signal: they train nothing)"
            )
        return lines

    def _global_plan(self) -> list[int]:
        idx = torch.arange(self.consumed, self.consumed + self.global_batch, dtype=torch.int64)
        return self.source.train_ids(idx, _mix(self.seed, 0)).tolist()

    def next_step(self, with_hash: bool = False) -> StepData:
        plan = self._global_plan()
        mb, dp = self.micro_batch, self.dp_size
        micro = []
        for j in range(self.accumulation):
            start = (j * dp + self.dp_rank) * mb
            micro.append(pair_batch(self.source, plan[start : start + mb], self.pad_id, self.reference))
        digest = None
        if with_hash:
            h = hashlib.blake2b(digest_size=16)
            for k in plan:
                for half in range(2):
                    h.update(
                        self.source.sequence(2 * int(self.source.kept[k]) + half)[0]
                        .to(torch.int32)
                        .numpy()
                        .tobytes()
                    )
            digest = h.hexdigest()
        self.consumed += len(plan)
        return StepData(micro, digest)

    def validation(self, batches: int) -> list[MicroBatch]:
        """The same held-out pairs every time, split over data-parallel ranks."""
        src = self.source
        if not src.n_val:
            return []
        out = []
        for j in range(batches):
            start = (j * self.dp_size + self.dp_rank) * self.micro_batch
            ids = [src.n_train + k % src.n_val for k in range(start, start + self.micro_batch)]
            out.append(pair_batch(src, ids, self.pad_id, self.reference))
        return out

    def reference_batches(self) -> Iterator[tuple[MicroBatch, torch.Tensor]]:
        """Every kept pair (training and validation) once, in micro-batches spread over the data-parallel ranks:
        (micro-batch, its kept-pair indices, -1 where a rank's last batch is filled up with pair 0). Every rank
        runs the same number of batches (FSDP and TP gather inside the forward)."""
        n, mb, dp = len(self.source.kept), self.micro_batch, self.dp_size
        for first in range(0, n, mb * dp):
            start = first + self.dp_rank * mb
            ids = [k if k < n else -1 for k in range(start, start + mb)]
            yield pair_batch(self.source, [max(k, 0) for k in ids], self.pad_id, None), torch.tensor(ids)

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "counts": [self.consumed],
            "seed": self.seed,
            "sources": [self.source.label],
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        """The position: pairs handed out (at another ``seq_len`` the kept pairs may differ; the count goes on)."""
        if int(state["seed"]) != self.seed:
            raise UserError(
                f"checkpoint's data order was drawn with run.seed {state['seed']}, this run has "
                f"{self.seed}: resume with the same seed"
            )
        self.consumed = int(state["consumed"])
