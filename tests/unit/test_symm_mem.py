"""parallel.fsdp_symm_mem: where FSDP2's buffers cannot be in NCCL symmetric memory is a config error naming the
field (tests/gpu/test_multi_gpu.py runs it on two GPUs against the plain gathers)."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, build_config
from loom.methods import check_config, resolve
from loom.resolve import check_machine


def cfg(**over):
    return build_config(None, {"parallel.fsdp_symm_mem": "true", **{k: str(v) for k, v in over.items()}})


@pytest.mark.parametrize(
    "over, says",
    [
        ({"parallel.backend": "gloo"}, "not with parallel.backend gloo; allowed auto | nccl"),
        ({"parallel.cpu_offload": "true"}, "not with parallel.cpu_offload"),
        (
            {"parallel.async_tp": "true", "parallel.tp": 2, "training.compile": "true"},
            "not with parallel.async_tp",
        ),
    ],
)
def test_what_symmetric_memory_cannot_take_is_refused(over, says):
    with pytest.raises(ConfigError, match="parallel.fsdp_symm_mem") as err:
        check_config(cfg(**over))
    assert says in str(err.value)


def test_a_layout_without_fsdp_and_the_cpu_are_refused():
    with pytest.raises(ConfigError, match="this layout runs no FSDP2 .dp_shard 1 x cp 1 on 2 ranks"):
        resolve(cfg(**{"parallel.dp_replicate": 2, "parallel.dp_shard": 1}), 2, device="cuda")
    with pytest.raises(ConfigError, match="needs CUDA devices"):
        check_machine(cfg(**{"parallel.dp_shard": 2}), "cpu")


def test_fsdp_on_cuda_resolves_and_a_torch_without_the_hooks_is_named(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    fsdp = cfg(**{"parallel.dp_shard": 2})
    assert resolve(fsdp, 2, device="cuda").dims.fsdp_applied
    check_machine(fsdp, "cuda")
    monkeypatch.delattr(FSDPModule, "set_symm_mem_for_comm")  # PyTorch 2.11: loom's comms through the hooks
    check_machine(fsdp, "cuda")
    monkeypatch.delattr(FSDPModule, "set_custom_all_gather")
    with pytest.raises(ConfigError, match=r"PyTorch >= 2.11; this is \S+\): allowed false"):
        check_machine(fsdp, "cuda")
