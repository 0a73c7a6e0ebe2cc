"""Weights & Biases (offline) and MLflow (local file store) get metrics.jsonl's scalars at its steps and the
resolved config; a missing package stops the run in one line; TensorBoard's absence is said, not silent."""

from __future__ import annotations

import glob
import json
import os
import struct
import sys

import pytest

from loom.config.errors import UserError
from loom.metrics.logger import MetricsLogger, flat_config, scalars
from tests.distributed.harness import run_one
from tests.tiny import tiny_config, tiny_overrides


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline with its settings under tmp_path, no tracking URI from the environment; nothing is sent."""
    for name in (
        "WANDB_DIR",
        "WANDB_ENTITY",
        "WANDB_PROJECT",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")  # the logger sets it for a file store
    yield
    if before is None:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    else:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


def record(step: int) -> dict:
    return {
        "step": step,
        "loss": 1.0 / step,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 1.0,
        "tokens_per_s_per_device": 1.0,
        "mem_gib": 0.1,
    }


def read_jsonl(path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def read_json(path) -> dict:
    with open(path) as fh:
        return json.load(fh)


def wandb_records(path):
    """The protobuf records of an offline run's ``run-<id>.wandb``: a 7-byte W&B header, then LevelDB's log
    format (32 KiB blocks of chunks with a 7-byte header: crc32c, length, type FULL=1 / FIRST / MIDDLE / LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:4] == b":W&B"
    pos, chunks, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_run(run_dir) -> tuple[dict, dict[int, dict]]:
    """(config, {step: scalars}) of the run's one offline W&B run."""
    files = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    config, history = {}, {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
    config.pop("_wandb", None)
    return config, history


def mlflow_run(run_dir):
    from mlflow.tracking import MlflowClient

    with open(os.path.join(run_dir, "trackers.json")) as fh:
        run_id = json.load(fh)["mlflow"]["run_id"]
    client = MlflowClient(f"file://{os.path.abspath(os.path.join(run_dir, 'mlruns'))}")
    return client, client.get_run(run_id)


def test_wandb_and_mlflow_get_the_records_and_the_config(tmp_path, offline):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(
        run_dir,
        tmp_path / "cache",
        **{"metrics.wandb": "true", "metrics.mlflow": "true", "training.eval_every": 2},
    )
    run_one(overrides)
    lines = read_jsonl(run_dir / "metrics.jsonl")
    expected = {
        r["step"]: {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float))} for r in lines
    }
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and all("val_loss" in expected[s] for s in (2, 4))
    cfg = flat_config(
        tiny_config(
            run_dir,
            tmp_path / "cache",
            **{"metrics.wandb": "true", "metrics.mlflow": "true", "training.eval_every": 2},
        )
    )

    config, history = wandb_run(run_dir)
    assert history == expected
    assert config == cfg and config["run.dir"] == str(run_dir) and config["metrics.wandb"] is True

    client, run = mlflow_run(run_dir)
    assert run.info.run_name == "run" and run.info.status == "FINISHED"  # the run dir's last folder name
    assert client.get_experiment(run.info.experiment_id).name == "loom"
    for key in {k for rec in expected.values() for k in rec}:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == {step: rec[key] for step, rec in expected.items() if key in rec}, key
    params = run.data.params
    assert set(params) == set(cfg)
    assert params["training.steps"] == "4" and params["run.dir"] == str(run_dir)
    assert (
        params["optimizer.betas"] == json.dumps(cfg["optimizer.betas"]) and params["metrics.mlflow"] == "true"
    )


def test_scalars_of_a_record():
    rec = {
        "step": 3,
        "loss": 2.0,
        "mfu": None,
        "batch_hash": "ab12",
        "pp_idle": [0.25, 0.5],
        "skipped_steps": 0,
        "grad_norm": float("inf"),
    }
    assert scalars(rec) == {
        "loss": 2.0,
        "pp_idle/0": 0.25,
        "pp_idle/1": 0.5,
        "skipped_steps": 0.0,
        "grad_norm": float("inf"),
    }


def test_a_resumed_run_continues_the_mlflow_and_wandb_runs(tmp_path, offline):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    cfg = tiny_config(tmp_path / "run", **{"metrics.wandb": "true", "metrics.mlflow": "true"})
    os.makedirs(cfg.run.dir)

    first = MetricsLogger(cfg.run.dir, 4, tensorboard=False, progress=False, start_step=0, config=cfg)
    for step in (1, 2, 3):
        first.log(record(step))
    first.close()
    ids = read_json(os.path.join(cfg.run.dir, "trackers.json"))
    cfg.training.steps = 5  # a changed field: MLflow keeps the first value (params are set once)
    resumed = MetricsLogger(cfg.run.dir, 5, tensorboard=False, progress=False, start_step=2, config=cfg)
    for step in (3, 4):  # step 3 again: W&B keeps its first value
        resumed.log(record(step))
    with pytest.raises(KeyError):
        try:
            raise KeyError("boom")
        finally:
            resumed.close()  # an exception on its way out: the runs are marked failed
    assert read_json(os.path.join(cfg.run.dir, "trackers.json")) == ids

    client, run = mlflow_run(cfg.run.dir)
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.status == "FAILED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, 1 / 3),
        (3, 1 / 3),
        (4, 0.25),
    ]
    assert run.data.params["training.steps"] == "4"
    runs = glob.glob(os.path.join(cfg.run.dir, "wandb", "offline-run-*"))
    assert len(runs) == 2 and all(
        p.endswith(ids["wandb"]["id"]) or p.endswith(ids["wandb"]["id"] + "-1") for p in runs
    )


@pytest.mark.parametrize("option,package", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_package_is_one_line_before_anything_is_written(tmp_path, monkeypatch, option, package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    cfg = tiny_config(tmp_path / "run", **{f"metrics.{option}": "true"})
    os.makedirs(cfg.run.dir)
    with pytest.raises(UserError) as err:
        MetricsLogger(cfg.run.dir, 4, tensorboard=False, progress=False, start_step=0, config=cfg)
    assert str(err.value) == (
        f"metrics.{option} = true needs the {package!r} package (pip install 'loom-train[{option}]')"
    )
    assert os.listdir(cfg.run.dir) == []


def test_the_default_tensorboard_without_the_package_says_so_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    logger = MetricsLogger(str(tmp_path), 4, tensorboard=True, progress=False, start_step=0)
    logger.log(record(1))
    logger.rewind(0)  # reopens TensorBoard: no second note
    logger.close()
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("metrics.tensorboard")]
    assert notes == [
        "metrics.tensorboard: the 'tensorboard' package is not installed, so no TensorBoard events "
        "(pip install tensorboard, or --metrics.tensorboard false)"
    ]
    assert not os.path.exists(tmp_path / "tensorboard")


def test_a_tracker_that_cannot_start_is_one_line(tmp_path, offline):
    pytest.importorskip("mlflow")
    cfg = tiny_config(
        tmp_path / "run", **{"metrics.mlflow": "true", "metrics.mlflow_tracking_uri": "bogus://x"}
    )
    os.makedirs(cfg.run.dir)
    with pytest.raises(UserError) as err:
        MetricsLogger(cfg.run.dir, 4, tensorboard=False, progress=False, start_step=0, config=cfg)
    assert str(err.value).startswith("metrics.mlflow: MLflow could not start the run at bogus://x: ")
    assert "\n" not in str(err.value) and not os.path.exists(os.path.join(cfg.run.dir, "metrics.jsonl"))
