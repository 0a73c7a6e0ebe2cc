"""parallel.cpu_offload on one GPU: FSDP2 on a 1-rank mesh keeps the weights (pinned), gradients and AdamW state on
the host, the process group is ``cuda:nccl,cpu:gloo``, the GPU's peak is a fraction of the run without offload, and
the losses are the run without offload's (fp32 closely, bf16 within its rounding); compiled blocks and a resume
from a checkpoint work offloaded. Activation offload (training.activation_offload) and NVMe offload of the moments
(optimizer.offload nvme) on one GPU: the same losses and a lower peak. Skipped without CUDA."""

from __future__ import annotations

import gc
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from loom.checkpoint.manager import step_dir_name
from loom.train.trainer import Trainer
from tests.tiny import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 6
# the 1B shape cut to 2 layers: its 128K-token embeddings and head make the state (16 bytes a parameter, ~6 GiB)
# much larger than a step's activations at this batch
SHAPE = {
    "model.flavor": "1B",
    "model.n_layers": 2,
    "run.device": "cuda",
    "run.seed": 5,
    "training.steps": STEPS,
    "training.seq_len": 128,
    "training.global_batch_size": 8,
    "training.micro_batch_size": 4,
    "optimizer.warmup_steps": 1,
    "optimizer.lr": 1e-3,
}
OFFLOAD = {"parallel.cpu_offload": "true"}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def train(run_dir, cache, **extra) -> tuple[Trainer, list[dict], float]:
    """The trainer, its records and the GPU's peak allocated GiB over its run, above what was allocated before it (an
    earlier run's trainer may not be collected yet)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    trainer = Trainer(tiny_config(run_dir, cache, **{**SHAPE, **extra}))
    records = trainer.fit()
    return trainer, records, (torch.cuda.max_memory_allocated() - before) / 2**30


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_offload_trains_on_one_gpu_like_the_run_without_it(tmp_path, cache, dtype, tol):
    _, plain, plain_peak = train(tmp_path / "plain", cache, **{"training.dtype": dtype})
    trainer, offload, peak = train(tmp_path / "offload", cache, **{"training.dtype": dtype}, **OFFLOAD)
    assert dist.get_backend() == "cuda:nccl,cpu:gloo"
    assert all(p.device.type == "cpu" and p.to_local().is_pinned() for p in trainer.params)
    states = [
        t for s in trainer.optimizer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t)
    ]
    assert states and all(t.device.type == "cpu" for t in states)
    assert all(
        b.device.type == "cuda" for b in trainer.parts[0].buffers()
    )  # RoPE's tables live where compute runs
    assert peak < 0.5 * plain_peak, (peak, plain_peak)
    assert max_rel([r["loss"] for r in offload], [r["loss"] for r in plain]) < tol
    assert offload[-1]["loss"] < offload[0]["loss"]


def test_offload_compiled_and_resumed(tmp_path, cache):
    """Compiled blocks offloaded follow the eager offloaded run; saved at step 3 and resumed, steps 4-6 repeat."""
    bf16 = {"training.dtype": "bfloat16", **OFFLOAD}
    _, eager, _ = train(tmp_path / "eager", cache, **bf16, **{"checkpoint.every": 3})
    _, compiled, _ = train(tmp_path / "compiled", cache, **bf16, **{"training.compile": "true"})
    assert max_rel([r["loss"] for r in compiled], [r["loss"] for r in eager]) < 2e-2
    shutil.rmtree(os.path.join(tmp_path, "eager", "checkpoints", step_dir_name(STEPS)))
    _, resumed, _ = train(tmp_path / "eager", cache, **bf16, **{"checkpoint.every": 3})
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert max_rel([r["loss"] for r in resumed], [r["loss"] for r in eager[3:]]) < 1e-3


# activations larger than the state: 4 blocks of the 1B shape at 8 x 2048 tokens, fp32, no recomputation
ACTIVATIONS = {
    "model.n_layers": 4,
    "training.seq_len": 2048,
    "training.global_batch_size": 8,
    "training.micro_batch_size": 8,
    "training.steps": 3,
    "training.dtype": "float32",
}


def test_activation_offload_on_one_gpu_lowers_the_peak_with_the_same_losses(tmp_path, cache):
    """Every block's saved tensors through pinned host memory on the side stream, prefetched in backward: the same
    fp32 losses, and the GPU's peak at least one block's resident saved bytes under the run without offload."""
    _, plain, plain_peak = train(tmp_path / "plain", cache, **ACTIVATIONS)
    trainer, offload, peak = train(
        tmp_path / "offload", cache, **ACTIVATIONS, **{"training.activation_offload": "all"}
    )
    # the memory a block's saved tensors keep alive (each storage once; packed_bytes counts every saved view: in fp32
    # SDPA's math path saves its S x S probabilities under two views)
    resident = trainer.parts[0].activation_offload.resident_bytes
    per_block = resident / (ACTIVATIONS["training.steps"] * 4) / 2**30
    assert per_block > 0.1, per_block
    assert peak < plain_peak - per_block, (peak, plain_peak, per_block)
    assert max_rel([r["loss"] for r in offload], [r["loss"] for r in plain]) < 1e-5


def test_nvme_offload_on_one_gpu_keeps_the_moments_in_files(tmp_path, cache):
    """The AdamW moments in files under tmp_path, stepped on the GPU chunk by chunk through pinned staging buffers:
    fp32 losses as without (PyTorch's fused kernel per chunk against loom's Triton AdamW), the GPU's peak lower by
    most of the moments' bytes, loom's folder removed at the end, and a resume from the checkpoint at step 3 (the
    moments saved from the files and loaded into new ones) repeats steps 4-6."""
    disk = tmp_path / "disk"
    disk.mkdir()
    fp32 = {"training.dtype": "float32"}
    _, plain, plain_peak = train(tmp_path / "plain", cache, **fp32)
    nvme = {
        "optimizer.offload": "nvme",
        "optimizer.offload_path": str(disk),
        "optimizer.offload_chunk_mb": 16,
        "checkpoint.every": 3,
    }
    trainer, records, peak = train(tmp_path / "nvme", cache, **fp32, **nvme)
    moments = 8 * sum(p.numel() for p in trainer.params) / 2**30
    assert peak < plain_peak - 0.5 * moments, (peak, plain_peak, moments)
    assert max_rel([r["loss"] for r in records], [r["loss"] for r in plain]) < 1e-4
    assert os.listdir(disk) == []
    del trainer
    shutil.rmtree(os.path.join(tmp_path, "nvme", "checkpoints", step_dir_name(STEPS)))  # resumed from step 3
    _, resumed, _ = train(tmp_path / "nvme", cache, **fp32, **nvme)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert max_rel([r["loss"] for r in resumed], [r["loss"] for r in records[3:]]) < 1e-5


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_offload_on_two_gpus_matches_one_gpu(tmp_path):
    """``loom train --nproc-per-node 2`` with dp_shard 2 and offload (the cuda:nccl,cpu:gloo group: the global norm
    of the host gradients reduces through gloo) against one GPU without offload, fp32."""
    import json
    import subprocess
    import sys

    def losses(run_dir, nproc: int, **extra) -> list[float]:
        over = {
            **SHAPE,
            "training.dtype": "float32",
            "run.dir": str(run_dir),
            "metrics.every": 1,
            "metrics.tensorboard": "false",
            "checkpoint.at_end": "false",
            **extra,
        }
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "NCCL_NVLS_ENABLE": "0"}
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                "from loom.cli.main import entry; entry()",
                "train",
                "--nproc-per-node",
                str(nproc),
            ]
            + [f"--{k}={v}" for k, v in over.items()],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            return [json.loads(line)["loss"] for line in fh]

    one = losses(tmp_path / "one", 1)
    two = losses(tmp_path / "two", 2, **{"parallel.dp_shard": 2, **OFFLOAD})
    assert max_rel(two, one) < 1e-4, (two, one)
