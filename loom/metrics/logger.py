"""Rank-0 outputs: metrics.jsonl, TensorBoard (when installed), Weights & Biases and MLflow (when asked for), a
compact console line, a progress bar."""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
from urllib.parse import urlparse

from loom.config.errors import UserError, require
from loom.config.sections import config_dict


def _fmt_count(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# A console field: (label, record key, format spec). The objective chooses its own (its ``console`` attribute, e.g.
# DPO's accuracy and margin, GRPO's reward and accuracy); a key ending in "/*" stands for every record key under that
# prefix not shown yet (each shown under its own name, "_std" spreads left out); the spec "flag" shows the label
# alone where the value is true (GRPO's warm-up steps).
ConsoleField = tuple[str, str, str]


def console_parts(rec: dict, fields: tuple[ConsoleField, ...]) -> list[str]:
    """The objective's part of a console line: each field the record holds a number for, in ``fields`` order."""
    parts, shown = [], set()
    for label, key, spec in fields:
        if key.endswith("/*"):
            prefix = key[:-1]
            keys = [k for k in rec if k.startswith(prefix) and not k.endswith("_std") and k not in shown]
            named = [(k[len(prefix) :], k) for k in keys]
        else:
            named = [(label, key)]
        for name, k in named:
            value = rec.get(k)
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            shown.add(k)
            if spec == "flag":
                if value:
                    parts.append(name)
            else:
                parts.append(f"{name} {value:{spec}}")
    return parts


def format_line(rec: dict, total_steps: int, fields: tuple[ConsoleField, ...] = ()) -> str:
    """The console line of a record: step, loss, validation loss, ``fields`` (the objective's), then the run's
    figures (grad norm, LR, throughput, MFU, memory, skipped steps)."""
    parts = [f"step {rec['step']:>{len(str(total_steps))}}/{total_steps}", f"loss {rec['loss']:.4f}"]
    if rec.get("val_loss") is not None:
        parts.append(f"val {rec['val_loss']:.4f}")
    parts += console_parts(rec, fields)
    if rec.get("moe_balance") is not None:
        parts.append(f"balance {rec['moe_balance']:.3f}")
    parts += [
        f"gnorm {rec['grad_norm']:.3f}",
        f"lr {rec['lr']:.2e}",
        f"tok/s {_fmt_count(rec['tokens_per_s'])} ({_fmt_count(rec['tokens_per_s_per_device'])}/dev)",
    ]
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
        sys.stderr.write(
            f"\r[{'#' * fill}{'.' * (width - fill)}] {step}/{self.total} "
            f"elapsed {_fmt_time(elapsed)} eta {eta_s} "
        )
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


def flat_config(cfg) -> dict:
    """``{"section.field": value}`` of a resolved config: what W&B and MLflow record as the run's config."""
    return {
        f"{section}.{name}": value
        for section, body in config_dict(cfg).items()
        for name, value in body.items()
    }


def scalars(rec: dict) -> dict[str, float]:
    """A record's numbers as the scalars TensorBoard, W&B and MLflow get: ``step`` is their x axis, None and text
    (``batch_hash``) are left out, a list (``pp_idle``) becomes one scalar per entry (``pp_idle/0``, ...); a list of
    rank numbers (``straggler_ranks``) becomes its length (``stragglers``)."""
    out = {}
    for key, value in rec.items():
        if key == "step":
            continue
        if key.endswith("_ranks") and isinstance(value, list):
            out[key[: -len("_ranks")] + "s"] = float(len(value))
        elif isinstance(value, list):
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value) if _is_number(v)})
        elif _is_number(value):
            out[key] = float(value)
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def run_name(metrics, run_dir: str) -> str:
    """The run's name in W&B and MLflow: ``metrics.run_name``, else the last folder name of the run dir."""
    return metrics.run_name or os.path.basename(os.path.normpath(os.path.abspath(run_dir)))


def check_trackers(metrics) -> None:
    """The packages ``metrics.wandb`` / ``metrics.mlflow`` need, or the one-line UserError (exit 2) naming the
    extra that installs them; called before training starts."""
    if metrics.wandb:
        require("wandb", "wandb", purpose="metrics.wandb = true")
    if metrics.mlflow:
        require("mlflow", "mlflow", purpose="metrics.mlflow = true")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class WandbTracker:
    """One W&B run. ``wandb.init`` reads W&B's own settings (WANDB_MODE=offline, WANDB_API_KEY, ...); its files go
    to WANDB_DIR, else the run dir. W&B's history only grows, so steps replayed after a rollback are not sent."""

    name = "wandb"

    def __init__(self, metrics, run_dir: str, params: dict, resume: dict | None):
        wandb = require("wandb", "wandb", purpose="metrics.wandb = true")
        self.where = {"project": metrics.wandb_project, "entity": metrics.wandb_entity}
        same = (
            resume is not None
            and resume.get("project") == self.where["project"]
            and resume.get("entity") == self.where["entity"]
        )
        try:
            self.run = wandb.init(
                project=metrics.wandb_project,
                entity=metrics.wandb_entity or None,
                name=run_name(metrics, run_dir),
                dir=os.environ.get("WANDB_DIR") or run_dir,
                config=params,
                id=resume["id"] if same else None,
                resume="allow" if same else None,
                allow_val_change=True,
            )
        except wandb.errors.Error as err:  # no login, a refused entity: the user's to fix
            raise UserError(
                f"metrics.wandb: W&B could not start the run: {_first_line(err)} (`wandb login`, "
                "or WANDB_MODE=offline)"
            ) from None
        self.last_step = self.run.step - 1  # a resumed online run starts after the steps W&B already has
        self.dropped: list[int] = []

    def state(self) -> dict:
        return {"id": self.run.id, **self.where}

    def log(self, values: dict, step: int) -> None:
        if step <= self.last_step:  # replayed after a rollback or a resume from an earlier checkpoint
            if not self.dropped:
                print(
                    f"wandb: step {step} was already sent; W&B keeps the first values of replayed steps "
                    "(metrics.jsonl and TensorBoard have the replayed ones)",
                    flush=True,
                )
            self.dropped.append(step)
            return
        self.run.log(values, step=step)
        self.last_step = step

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def mlflow_tracking_uri(metrics, run_dir: str) -> str:
    """``metrics.mlflow_tracking_uri``, else MLFLOW_TRACKING_URI, else the file store ``<run.dir>/mlruns``."""
    return (
        metrics.mlflow_tracking_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or pathlib.Path(run_dir, "mlruns").absolute().as_uri()
    )


def _is_file_store(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


class MlflowTracker:
    """One MLflow run, through ``MlflowClient`` (no process-wide active run that the user's own code would
    inherit). Params are strings of at most 6000 characters, set once per run: a resumed run keeps the first
    value of a field it changed (the config.toml of each checkpoint has the values it ran with)."""

    name = "mlflow"
    MAX_VALUE = 6000  # MLflow's limit on a param value
    PER_BATCH = 100  # MLflow's limit on params per log_batch

    def __init__(self, metrics, run_dir: str, params: dict, resume: dict | None):
        require("mlflow", "mlflow", purpose="metrics.mlflow = true")
        self.uri = mlflow_tracking_uri(metrics, run_dir)
        if _is_file_store(self.uri):
            # MLflow 3 refuses a file store unless this is set ("maintenance mode"); it needs no database
            # package, and earlier MLflow versions ignore the variable
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        try:
            self.client = MlflowClient(self.uri)
            exp = self.client.get_experiment_by_name(metrics.mlflow_experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(metrics.mlflow_experiment)
            old = resume.get("run_id") if resume and resume.get("tracking_uri") == self.uri else None
            if old:
                self.run_id = old
                self.client.update_run(old, status="RUNNING")
                have = self.client.get_run(old).data.params
            else:
                run = self.client.create_run(
                    exp_id,
                    run_name=run_name(metrics, run_dir),
                    tags={"loom.run_dir": os.path.abspath(run_dir)},
                )
                self.run_id, have = run.info.run_id, {}
            new = [Param(k, v) for k, v in ((k, self._text(v)) for k, v in params.items()) if k not in have]
            for i in range(0, len(new), self.PER_BATCH):
                self.client.log_batch(self.run_id, params=new[i : i + self.PER_BATCH])
        except MlflowException as err:
            raise UserError(
                f"metrics.mlflow: MLflow could not start the run at {self.uri}: {_first_line(err)}"
            ) from None
        view = (
            f" (to view: MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {self.uri})"
            if _is_file_store(self.uri)
            else ""
        )
        print(
            f"mlflow: run {self.run_id} ({run_name(metrics, run_dir)!r}) in experiment "
            f"{metrics.mlflow_experiment!r} at {self.uri}{view}",
            flush=True,
        )
        self.failed = False

    def _text(self, value) -> str:
        text = value if isinstance(value, str) else json.dumps(value)
        return text if len(text) <= self.MAX_VALUE else text[: self.MAX_VALUE - 3] + "..."

    def state(self) -> dict:
        return {"tracking_uri": self.uri, "run_id": self.run_id}

    def log(self, values: dict, step: int) -> None:
        if self.failed:
            return
        now = int(time.time() * 1000)
        try:
            self.client.log_batch(
                self.run_id, metrics=[self._metric(k, v, now, step) for k, v in values.items()]
            )
        except Exception as err:  # a tracking server gone mid-run must not end days of training
            self.failed = True
            print(
                f"mlflow: logging failed at step {step} ({_first_line(err)}); no more MLflow records in this "
                "run (metrics.jsonl has them all)",
                flush=True,
            )

    def close(self, failed: bool) -> None:
        try:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
        except Exception as err:  # the run's records are already on the server, or lost with it
            print(f"mlflow: could not mark the run finished ({_first_line(err)})", flush=True)


TRACKERS_FILE = "trackers.json"  # in the run dir: the W&B and MLflow run a resumed run continues


def open_trackers(metrics, run_dir: str, params: dict, start_step: int) -> list:
    """The W&B / MLflow runs ``metrics`` asks for. A run resumed past step 0 continues the runs named in
    ``<run.dir>/trackers.json``; a fresh start opens new ones."""
    check_trackers(metrics)
    path = os.path.join(run_dir, TRACKERS_FILE)
    saved = {}
    if start_step > 0 and os.path.exists(path):
        try:
            with open(path) as fh:
                saved = json.load(fh)
        except (OSError, ValueError):
            saved = {}
    trackers = []
    try:
        for wanted, cls in ((metrics.wandb, WandbTracker), (metrics.mlflow, MlflowTracker)):
            if wanted:
                trackers.append(cls(metrics, run_dir, params, saved.get(cls.name)))
    except BaseException:  # the W&B run stays not open when MLflow refuses to start
        for tracker in trackers:
            tracker.close(failed=True)
        raise
    if trackers:
        with open(path, "w") as fh:
            json.dump({**saved, **{t.name: t.state() for t in trackers}}, fh, indent=1)
    return trackers


class MetricsLogger:
    """metrics.jsonl, TensorBoard, the console line and, given the resolved ``config``, W&B and MLflow as its
    ``metrics`` section asks (the flattened config is their run config)."""

    def __init__(
        self,
        run_dir: str,
        total_steps: int,
        *,
        tensorboard: bool,
        progress: bool,
        start_step: int,
        config=None,
        console: tuple[ConsoleField, ...] = (),
    ):
        self.total, self.console = total_steps, tuple(console)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        # first: a missing package or a refused login stops the run before anything is written
        self._trackers = (
            [] if config is None else open_trackers(config.metrics, run_dir, flat_config(config), start_step)
        )
        self._fh = open(self.path, "a")
        self.progress = Progress(total_steps, progress, start_step)
        self._tb_dir = os.path.join(run_dir, "tensorboard") if tensorboard else None
        self._tb_note = True
        self._tb = self._open_tensorboard(start_step)

    def _open_tensorboard(self, step: int):
        """A TensorBoard writer (None when off or not installed, said once); past ``step`` > 0 it hides the events
        of later steps that an earlier run (or this one, before a rollback) wrote: TensorBoard's ``purge_step``."""
        if self._tb_dir is None:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter(self._tb_dir, purge_step=step + 1 if step > 0 else None)
        except Exception as err:  # tensorboard is optional: the run goes on, and says so once
            if self._tb_note:
                why = (
                    "the 'tensorboard' package is not installed"
                    if isinstance(err, ImportError)
                    else f"TensorBoard could not start ({_first_line(err)})"
                )
                print(
                    f"metrics.tensorboard: {why}, so no TensorBoard events (pip install tensorboard, or "
                    "--metrics.tensorboard false)",
                    flush=True,
                )
                self._tb_note = False
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
        values = scalars(rec)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, rec["step"])
        for tracker in self._trackers:
            tracker.log(values, rec["step"])
        self.progress.clear()
        print(format_line(rec, self.total, self.console), flush=True)

    def close(self) -> None:
        """Called from the trainer's ``finally``: an exception on its way out marks the W&B / MLflow run failed."""
        failed = sys.exc_info()[0] is not None
        self.progress.clear()
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.close(failed)
