"""GRPO under tensor parallelism on two GPUs (NCCL, bf16): the embedded recipe runs with the real engine
tensor-parallel on the trainer's own shards (compiled steps without CUDA graphs, tokens broadcast over the tp group)
and its eval hook; nothing is synced (weight_sync_bytes 0 throughout), full fine-tuning and LoRA; PPO's recipe
likewise, with the value head (full fine-tuning, LoRA) and the critic model split by the TP plan. Four GPUs:
FSDP2 x TP (dp_shard 2 x tp 2), where each rollout fills the engine's TP shards from FSDP2's. Skipped without the
GPUs."""

from __future__ import annotations

import math

import pytest
import torch

from tests.gpu.test_rl_fsdp_gpu import train, warmup_matches_one_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
TP = {"parallel.dp_shard": 1, "parallel.tp": 2}


def finite_run(records: list[dict]) -> list[dict]:
    """The GRPO steps that sampled (after the warm-up), checked finite and in the reward's range (the warm-up
    steps are compared with one GPU's by ``warmup_matches_one_gpu``)."""
    sampled = [
        r for r in records if "reward" in r and "time/generation_s" in r and r["time/generation_s"] > 0
    ]
    assert len(records) == 30 and sampled and all("eval/accuracy" in r for r in records[9::10])
    assert all(math.isfinite(r["loss"]) and 0 <= r["reward"] <= 1.5 for r in sampled)
    return sampled


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_under_tp_on_two_gpus(tmp_path, lora):
    extra = {"lora.rank": 8} if lora else {}
    records = train(tmp_path / "run", **TP, **extra)
    warmup_matches_one_gpu(records, tmp_path / "one", "grpo_debug.toml", **extra)
    sampled = finite_run(records)
    assert all(not r.get("weight_sync_bytes") for r in sampled)  # the engine shares the trainer's shards
    print(
        f"tp=2 lora={lora}: generation {sampled[1]['time/generation_s']:.4f} s, "
        f"{sampled[1]['rollout_tokens_per_s']:.0f} tokens/s"
    )


@pytest.mark.parametrize("critic,lora", [("head", False), ("head", True), ("model", False)])
def test_ppo_under_tp_on_two_gpus(tmp_path, critic, lora):
    extra = {"ppo.critic": critic, **({"lora.rank": 8} if lora else {})}
    records = train(tmp_path / "run", "ppo_debug.toml", **TP, **extra)
    warmup_matches_one_gpu(records, tmp_path / "one", "ppo_debug.toml", **extra)
    sampled = finite_run(records)
    assert all(not r.get("weight_sync_bytes") for r in sampled)  # the engine holds the policy's shards only
    assert all(math.isfinite(r["ppo/value_loss"]) and math.isfinite(r["ppo/values"]) for r in sampled)
    print(
        f"ppo tp=2 critic={critic} lora={lora}: generation {sampled[1]['time/generation_s']:.4f} s, "
        f"value loss {sampled[0]['ppo/value_loss']:.4f} -> {sampled[-1]['ppo/value_loss']:.4f}"
    )


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
def test_grpo_under_fsdp2_x_tp_on_four_gpus(tmp_path):
    records = train(tmp_path / "run", nproc=4, **{**TP, "parallel.dp_shard": 2})
    warmup_matches_one_gpu(records, tmp_path / "one", "grpo_debug.toml")
    sampled = finite_run(records)
    assert all(r["weight_sync_bytes"] > 0 for r in sampled)
    print(
        f"dp_shard 2 x tp 2: sync {sampled[1]['weight_sync_bytes'] / 2**20:.2f} MiB in "
        f"{sampled[1]['time/weight_sync_s']:.4f} s, generation {sampled[1]['time/generation_s']:.4f} s"
    )
