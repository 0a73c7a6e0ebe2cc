"""Rank-0 outputs: metrics.jsonl, TensorBoard (when installed), a compact console line, a progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
import time


def _fmt_count(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def format_line(rec: dict, total_steps: int) -> str:
    parts = [f"step {rec['step']:>{len(str(total_steps))}}/{total_steps}", f"loss {rec['loss']:.4f}"]
    if rec.get("val_loss") is not None:
        parts.append(f"val {rec['val_loss']:.4f}")
    if rec.get("moe_balance") is not None:
        parts.append(f"balance {rec['moe_balance']:.3f}")
    parts += [f"gnorm {rec['grad_norm']:.3f}", f"lr {rec['lr']:.2e}",
              f"tok/s {_fmt_count(rec['tokens_per_s'])} ({_fmt_count(rec['tokens_per_s_per_device'])}/dev)"]
    if rec.get("mfu") is not None:
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    parts.append(f"mem {rec['mem_gib']:.2f}GiB")
    if rec.get("skipped_steps"):
        parts.append(f"skipped {rec['skipped_steps']}")
    if rec.get("nonfinite_steps"):
        parts.append(f"non-finite {rec['nonfinite_steps']}")
    return " | ".join(parts)


def strict_json(rec: dict) -> dict:
    """Non-finite floats (an fp16 step that overflowed has an infinite grad norm) become null: standard
    JSON has no NaN / Infinity, and jq, JavaScript and most JSON readers reject them."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}


class Progress:
    """A one-line progress bar with ETA on a terminal; silent elsewhere (logs get the metric lines)."""

    def __init__(self, total: int, enabled: bool, start_step: int = 0):
        self.total, self.start = total, start_step
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int) -> None:
        if not self.enabled:
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - step) if done else math.nan
        width = 30
        fill = int(width * step / self.total)
        eta_s = _fmt_time(eta) if math.isfinite(eta) else "?"
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {step}/{self.total} "
                         f"elapsed {_fmt_time(elapsed)} eta {eta_s} ")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 80 + "\r")


def rewind_metrics(path: str, step: int) -> int:
    """Drop the records of ``path`` (metrics.jsonl) after ``step``, so a run resumed or rolled back to ``step``
    appends each later step once; returns how many were dropped. Rewritten through a temporary file and
    ``os.replace``: a kill leaves the old file or the new one. Lines that are not JSON (a write cut short by a
    kill) go too; records without an integer step stay."""
    try:
        with open(path, "rb") as fh:
            lines = fh.read().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # not a record: a line cut short by a kill
        if not (isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step):
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    if len(kept) == len(lines) and all(line.endswith(b"\n") for line in lines):
        return 0
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.writelines(kept)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return len(lines) - len(kept)


class MetricsLogger:
    def __init__(self, run_dir: str, total_steps: int, *, tensorboard: bool, progress: bool, start_step: int):
        self.total = total_steps
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._fh = open(self.path, "a")
        self.progress = Progress(total_steps, progress, start_step)
        self._tb_dir = os.path.join(run_dir, "tensorboard") if tensorboard else None
        self._tb = self._open_tensorboard(start_step)

    def _open_tensorboard(self, step: int):
        """A TensorBoard writer (None when off or not installed); past ``step`` > 0 it hides the events of later
        steps that an earlier run (or this one, before a rollback) wrote: TensorBoard's ``purge_step``."""
        if self._tb_dir is None:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter(self._tb_dir, purge_step=step + 1 if step > 0 else None)
        except Exception:  # tensorboard is optional
            return None

    def rewind(self, step: int) -> int:
        """Back to ``step`` inside a run (a rollback to an earlier checkpoint): later records leave
        metrics.jsonl and TensorBoard, so the replayed steps appear once; returns the records dropped."""
        self._fh.close()
        dropped = rewind_metrics(self.path, step)
        self._fh = open(self.path, "a")
        if self._tb is not None:
            self._tb.close()
            self._tb = self._open_tensorboard(step)
        return dropped

    def log(self, rec: dict) -> None:
        self._fh.write(json.dumps(strict_json(rec)) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self._tb.add_scalar(k, v, rec["step"])
        self.progress.clear()
        print(format_line(rec, self.total), flush=True)

    def close(self) -> None:
        self.progress.clear()
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
