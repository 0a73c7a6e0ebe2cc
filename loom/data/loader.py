"""Packed windows, a deterministic layout-independent sampler, and the stateful loader.

Every token file is cut into windows of ``seq_len + 1`` tokens (stride ``seq_len``); the last
``val_fraction`` of the windows are held out for validation. Training visits the other windows in
an order given by a seeded bijection (a Feistel permutation, so nothing of size "number of windows"
is stored), one fresh permutation per epoch.

The sampler decides the *global* batch of every step from the global sample index alone; a rank
only picks its slice. So the global batch of step t is the same for every layout, and the
loader's whole state is two counters that do not depend on the layout either.

An SFT token file (``training.objective sft``) carries per-token flags: a label whose token is not the assistant's
is IGNORE, and positions restart at every conversation's first token (flagged, not found by EOS: a turn may end in
the EOS id).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, replace

import torch

from loom.config.errors import UserError
from loom.data.chat import FLAG_LOSS, FLAG_START
from loom.data.token_file import TokenFile
from loom.numerics import IGNORE

_MASK31 = (1 << 31) - 1


# ---- a stateless permutation of [0, n) -----------------------------------------


def _round(x: torch.Tensor, key: int, mask: int) -> torch.Tensor:
    x = ((x * 0x2545F491 + key) & _MASK31) ^ (x >> 5)
    x = ((x * 0x1B873593) & _MASK31) ^ (x >> 13)
    return x & mask


def _feistel(x: torch.Tensor, half_bits: int, keys: list[int]) -> torch.Tensor:
    mask = (1 << half_bits) - 1
    left, right = x >> half_bits, x & mask
    for k in keys:
        left, right = right, left ^ _round(right, k, mask)
    return (left << half_bits) | right


def permute(idx: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """A bijection of [0, n) chosen by ``seed``, applied to ``idx`` (int64). Cycle-walks out-of-range values."""
    half_bits = max(1, ((max(n - 1, 1)).bit_length() + 1) // 2)
    assert half_bits <= 31, "more than 2**62 windows"
    keys = [_mix(seed, r) for r in range(4)]
    out = _feistel(idx, half_bits, keys)
    while bool((out >= n).any()):
        bad = out >= n
        out = torch.where(bad, _feistel(out, half_bits, keys), out)
    return out


def _mix(*ints: int) -> int:
    h = hashlib.blake2b(repr(ints).encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & _MASK31


def uniform(idx: torch.Tensor, seed: int) -> torch.Tensor:
    """A deterministic uniform in [0, 1) per global sample index."""
    keys = [_mix(seed, 101 + r) for r in range(3)]
    return (_feistel(idx, 31, keys) & _MASK31).double() / 2**31


# ---- windows of one source -----------------------------------------------------


def split_windows(n_tokens: int, seq_len: int, val_fraction: float) -> tuple[int, int]:
    """(training, validation) windows of ``seq_len + 1`` tokens (stride ``seq_len``) in ``n_tokens`` tokens."""
    n = (n_tokens - 1) // seq_len
    n_val = int(n * val_fraction) if n >= 2 else 0
    if val_fraction > 0 and n >= 2:
        n_val = max(1, n_val)
    return n - n_val, n_val


def visit_order(k: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """The k-th of ``n`` items visited: a fresh permutation of them in every epoch (k may run past one)."""
    epoch, j = k // n, k % n
    out = torch.empty_like(k)
    for e in epoch.unique().tolist():
        sel = epoch == e
        out[sel] = permute(j[sel], n, _mix(seed, e))
    return out


class Windows:
    def __init__(self, tokens: TokenFile, seq_len: int, val_fraction: float, label: str):
        self.tokens, self.seq_len, self.label, self.val_fraction = tokens, seq_len, label, val_fraction
        self.n_train, self.n_val = split_windows(len(tokens), seq_len, val_fraction)
        if self.n_train < 1:
            raise UserError(
                f"data source {label} ({tokens.path}): {len(tokens)} tokens are fewer than one "
                f"training window of {seq_len + 1} (lower training.seq_len or add data)"
            )

    def window(self, w: int) -> torch.Tensor:
        start = w * self.seq_len
        return self.tokens.slice(start, start + self.seq_len + 1)  # (S+1,)

    def flags(self, w: int) -> torch.Tensor | None:
        """An SFT file's per-token flags of window ``w`` (S+1,) uint8; None for plain text."""
        if self.tokens.mask is None:
            return None
        start = w * self.seq_len
        return self.tokens.flags(start, start + self.seq_len + 1)

    def train_window_ids(self, k: torch.Tensor, seed: int) -> torch.Tensor:
        """The k-th training windows visited (k may run past one epoch)."""
        return visit_order(k, self.n_train, seed)

    def val_window_id(self, k: int) -> int:
        return self.n_train + k % self.n_val

    def recut_count(self, taken: int, old_seq_len: int) -> int:
        """Training windows taken under ``old_seq_len``, as a count at this ``seq_len``: the same epoch and the
        same fraction of it (windows cut at another length are other windows, so no exact continuation exists)."""
        old_n = split_windows(len(self.tokens), old_seq_len, self.val_fraction)[0]
        if old_n < 1:
            return 0
        epoch, pos = divmod(taken, old_n)
        return epoch * self.n_train + (2 * pos * self.n_train + old_n) // (2 * old_n)  # rounded to nearest


def _share_read(epochs: float) -> str:
    return f"{epochs:.1f} epochs" if epochs >= 1 else f"{100 * epochs:.2g}%"


# ---- batches ------------------------------------------------------------------


@dataclass
class MicroBatch:
    inputs: torch.Tensor  # (B, S) int64
    labels: torch.Tensor  # (B, S) int64: the next token at every position
    positions: torch.Tensor  # (B, S) position within its document
    document_ids: torch.Tensor  # (B, S) document index within the window
    ref_logps: torch.Tensor | None = (
        None  # DPO (loom.data.dpo): the reference's log-probability of each row, (B,)
    )
    desirable: torch.Tensor | None = None  # KTO (loom.data.kto): each example's label, (B/2,) bool

    def to(self, device) -> MicroBatch:
        """A copy with every tensor field on ``device``, a subclass's fields too (the same type, the rest kept)."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(
            self,
            **{k: t.to(device, non_blocking=True) for k, t in tensors.items() if isinstance(t, torch.Tensor)},
        )


def positions_from_starts(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions that restart at every document start and per-token document ids. starts: (B, S) bool; the first
    token of a window always starts one."""
    starts = starts.clone()
    starts[:, 0] = True
    idx = torch.arange(starts.shape[1]).expand_as(starts)
    last_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - last_start, torch.cumsum(starts.to(torch.int64), dim=1) - 1


def document_positions(inputs: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions that restart after every EOS and per-token document ids. inputs: (B, S)."""
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[:, 1:] = inputs[:, :-1] == eos_id
    return positions_from_starts(starts)


def make_micro_batch(
    windows: list[torch.Tensor], eos_id: int, flags: list[torch.Tensor] | None = None
) -> MicroBatch:
    """Inputs, labels and per-document positions of windows (S+1,) each. ``flags`` (an SFT file's, (S+1,) each): a
    label takes loss only where its token is flagged, and documents start at flagged tokens instead of after EOS."""
    w = torch.stack(windows)  # (B, S+1)
    inputs, labels = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    if flags is None:
        pos, doc = document_positions(inputs, eos_id)
        return MicroBatch(inputs, labels, pos, doc)
    f = torch.stack(flags)  # (B, S+1) uint8
    labels = torch.where((f[:, 1:] & FLAG_LOSS) > 0, labels, IGNORE)
    pos, doc = positions_from_starts((f[:, :-1] & FLAG_START) > 0)
    return MicroBatch(inputs, labels, pos, doc)


@dataclass
class StepData:
    micro_batches: list[MicroBatch]
    global_hash: str | None  # hash of the whole global batch, same on every layout


class Loader:
    """Yields this rank's micro-batches for each step; ``state_dict`` holds the exact position."""

    def __init__(
        self,
        sources: list[Windows],
        weights: list[float],
        *,
        seed: int,
        eos_id: int,
        dp_rank: int,
        dp_size: int,
        micro_batch: int,
        accumulation: int,
    ):
        self.sources, self.seed, self.eos_id = sources, seed, eos_id
        total = sum(weights)
        self.cum_weights = torch.tensor(
            [sum(weights[: i + 1]) / total for i in range(len(weights))], dtype=torch.float64
        )
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.micro_batch, self.accumulation = micro_batch, accumulation
        self.consumed = 0  # global samples handed out
        self.counts = [0] * len(sources)  # training windows taken from each source

    def describe(self, global_batch: int, steps: int) -> list[str]:
        """The banner's data lines: each source's tokens and windows, and how often the run will go over it (a
        warning when the corpus is smaller than one step or repeats for several epochs)."""
        cum = [0.0] + self.cum_weights.tolist()
        lines = []
        for i, src in enumerate(self.sources):
            share = cum[i + 1] - cum[i]
            epochs = steps * global_batch * share / src.n_train
            val = f", {src.n_val} validation" if src.n_val else ""
            weight = f", weight {share:.2f}" if len(self.sources) > 1 else ""
            meta = src.tokens.meta
            trained = meta.trained_tokens / max(meta.tokens, 1)
            sft = (
                f" ({meta.documents:,} conversations, {trained:.0%} of the tokens take loss)"
                if meta.mask
                else ""
            )
            lines.append(
                f"data: {src.label}: {len(src.tokens):,} tokens{sft}, {src.n_train} training windows"
                f"{val}{weight}; the run reads {_share_read(epochs)} of it"
            )
            if src.n_train < global_batch * share:
                lines.append(
                    f"warning: {src.label} holds fewer windows ({src.n_train}) than one step takes from it "
                    f"({global_batch * share:.0f}): every step repeats windows"
                )
            elif epochs > 1:
                lines.append(
                    f"warning: {src.label} will be repeated: {epochs:.1f} epochs (more data, or "
                    "fewer training.steps, avoids training on the same windows again)"
                )
        return lines

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp_size

    def _global_plan(self) -> list[tuple[int, int]]:
        """(source, window id) for every sample of the next global batch, in global order."""
        idx = torch.arange(self.consumed, self.consumed + self.global_batch, dtype=torch.int64)
        if len(self.sources) == 1:
            src = torch.zeros_like(idx)
        else:
            src = torch.searchsorted(self.cum_weights, uniform(idx, self.seed), right=True)
            src = src.clamp_(max=len(self.sources) - 1)
        win = torch.empty_like(idx)
        for s in range(len(self.sources)):
            sel = src == s
            k = self.counts[s] + torch.arange(int(sel.sum()), dtype=torch.int64)
            win[sel] = self.sources[s].train_window_ids(k, _mix(self.seed, s))
        return list(zip(src.tolist(), win.tolist()))

    def _advance(self, plan: list[tuple[int, int]]) -> None:
        self.consumed += len(plan)
        for s, _ in plan:
            self.counts[s] += 1

    def next_step(self, with_hash: bool = False) -> StepData:
        plan = self._global_plan()
        mb, dp = self.micro_batch, self.dp_size
        micro = []
        for j in range(self.accumulation):
            start = (j * dp + self.dp_rank) * mb  # micro-batch j of this rank
            micro.append(self._micro_batch(plan[start : start + mb]))
        digest = None
        if with_hash:
            h = hashlib.blake2b(digest_size=16)
            for s, w in plan:
                h.update(self.sources[s].window(w).to(torch.int32).numpy().tobytes())
            digest = h.hexdigest()
        self._advance(plan)
        return StepData(micro, digest)

    def _micro_batch(self, picks: list[tuple[int, int]]) -> MicroBatch:
        """The micro-batch of (source, window) ``picks``."""
        windows = [self.sources[s].window(w) for s, w in picks]
        flags = [self.sources[s].flags(w) for s, w in picks]
        return make_micro_batch(windows, self.eos_id, None if flags and flags[0] is None else flags)

    def validation(self, batches: int) -> list[MicroBatch]:
        """The same held-out windows every time, split over data-parallel ranks (first source with any)."""
        i, src = next(((i, s) for i, s in enumerate(self.sources) if s.n_val > 0), (None, None))
        if src is None:
            return []
        out = []
        for j in range(batches):
            start = (j * self.dp_size + self.dp_rank) * self.micro_batch
            out.append(
                self._micro_batch([(i, src.val_window_id(k)) for k in range(start, start + self.micro_batch)])
            )
        return out

    @property
    def seq_len(self) -> int:
        return self.sources[0].seq_len

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "counts": list(self.counts),
            "seed": self.seed,
            "sources": [s.label for s in self.sources],
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        """The position of ``state_dict``. Saved at another ``seq_len`` (``state["seq_len"]``, absent in older
        checkpoints: the same), each source goes on from the same fraction of the same epoch (``recut_count``);
        another global batch size needs nothing: the position counts samples, whatever the batch."""
        if len(state["counts"]) != len(self.sources):
            raise UserError(
                f"checkpoint's data loader has {len(state['counts'])} sources, this run has "
                f"{len(self.sources)}: resume with the same data.source"
            )
        if int(state["seed"]) != self.seed:
            raise UserError(
                f"checkpoint's data order was drawn with run.seed {state['seed']}, this run has "
                f"{self.seed}: resume with the same seed"
            )
        self.consumed, self.counts = int(state["consumed"]), [int(c) for c in state["counts"]]
        old_seq_len = int(state.get("seq_len", self.seq_len))
        if old_seq_len != self.seq_len:
            self.counts = [s.recut_count(c, old_seq_len) for s, c in zip(self.sources, self.counts)]
            self.consumed = sum(self.counts)  # every sample takes one window of one source
