"""loom's trainer on a Ray cluster: Ray Train's TorchTrainer starts one worker per GPU and joins them in a process
group; each worker builds ``loom.train.trainer.Trainer(cfg)`` and calls ``fit()``.

    pip install "ray[train]"
    python examples/ray_train.py --workers 8 --gpus -- --config recipes/my_run.toml --run.dir /shared/runs/a

What Ray does before ``train_loop_per_worker`` runs (ray.train.torch's backend): it sets MASTER_ADDR / MASTER_PORT
(worker 0's address and a free port), RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and NODE_RANK, makes the
GPUs of a node visible to each of its workers and sets each worker's CUDA device, and calls
``init_process_group`` itself (nccl with GPUs, else gloo; ``TorchConfig(backend=..., timeout_s=...)`` changes
both). loom's ``init_distributed`` reads the same variables and keeps the group that is already there, so the
trainer needs nothing Ray-specific. The run dir (checkpoints, metrics) must be on storage every node mounts;
``checkpoint.resume = auto`` (the default) continues from its newest complete checkpoint when Ray restarts the
workers (``FailureConfig(max_failures=...)``).

Not tested in loom's suite: Ray is not one of its dependencies.
"""

from __future__ import annotations

import argparse


def train_loop_per_worker(config: dict) -> None:
    """One Ray worker: the config from loom's own parser (defaults < --config FILE < overrides), then the trainer."""
    import ray.train

    from loom.config import build_config, parse_overrides
    from loom.train.trainer import Trainer

    argv = list(config["loom_args"])
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        path = argv[i + 1]
        del argv[i : i + 2]
    cfg = build_config(path, parse_overrides(argv))
    records = Trainer(cfg).fit()  # rank 0's logged records; the other ranks return none
    if ray.train.get_context().get_world_rank() == 0 and records:
        ray.train.report({"loss": records[-1]["loss"], "step": records[-1]["step"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray workers (ranks): one per GPU with --gpus")
    parser.add_argument(
        "--gpus", action="store_true", help="one GPU per worker (nccl); without it, CPU (gloo)"
    )
    parser.add_argument("--max-failures", type=int, default=0, help="restarts of the worker group by Ray")
    parser.add_argument("loom_args", nargs=argparse.REMAINDER, help="after --: loom train's arguments")
    args = parser.parse_args()
    loom_args = args.loom_args[1:] if args.loom_args[:1] == ["--"] else args.loom_args

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"loom_args": loom_args},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpus),
        torch_config=TorchConfig(backend="nccl" if args.gpus else "gloo"),
        run_config=RunConfig(failure_config=FailureConfig(max_failures=args.max_failures)),
    )
    result = trainer.fit()
    print(f"final metrics: {result.metrics}")


if __name__ == "__main__":
    main()
