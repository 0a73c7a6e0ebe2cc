"""training.cuda_graphs: where graph replay of the compiled blocks cannot run is a config error naming the field,
and GRPO and PPO resolve with it (tests/gpu/test_cuda_graphs_gpu.py runs the graphs; tests/unit/test_rollout_graphs.py
the rollouts' fixed widths and the engine's graph-free blocks)."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, build_config
from loom.methods import check_config, resolve


def cfg(**over):
    base = {"training.compile": "true", "training.cuda_graphs": "true"}
    return build_config(None, {**base, **{k: str(v) for k, v in over.items()}})


@pytest.mark.parametrize(
    "over, says",
    [
        ({"training.compile": "false"}, "needs training.compile true"),
        ({"training.activation_checkpointing": "full"}, "allowed none | op"),
        ({"training.objective": "rloo"}, "tested for grpo and ppo only): allowed false"),
        ({"training.objective": "online_dpo"}, "tested for grpo and ppo only): allowed false"),
        ({"training.objective": "grpo", "grpo.max_staleness": 1}, "allowed with grpo.max_staleness 0"),
        ({"training.objective": "grpo", "training.compile": "false"}, "needs training.compile true"),
        ({"parallel.cpu_offload": "true"}, "parallel.cpu_offload"),
    ],
)
def test_what_graphs_cannot_take_is_refused(over, says):
    with pytest.raises(ConfigError, match="training.cuda_graphs") as err:
        check_config(
            cfg(**over)
        )  # the features' rules and the method's (a method's own refusal is in loom.methods)
    assert says in str(err.value)


def test_more_than_one_process_is_refused():
    with pytest.raises(ConfigError, match="got 2 ranks"):
        resolve(cfg(**{"run.device": "cpu"}), 2, device="cuda")


def test_the_cpu_is_refused():
    from loom.resolve import check_device

    with pytest.raises(ConfigError, match="needs a CUDA device"):
        check_device(cfg(**{"run.device": "cpu"}))


def test_one_process_with_op_checkpointing_resolves():
    run = resolve(
        cfg(
            **{
                "training.activation_checkpointing": "op",
                "training.global_batch_size": 8,
                "training.micro_batch_size": 8,
            }
        ),
        1,
        device="cuda",
    )
    assert run.dims.world_size == 1


@pytest.mark.parametrize("objective", ["grpo", "ppo"])
def test_grpo_and_ppo_resolve_with_graphs(objective):
    """Their rows are padded to fixed widths and the engine generates without training's graphs: accepted on one
    CUDA process; the layout's refusal still holds."""
    over = {
        "training.objective": objective,
        "training.global_batch_size": 16,
        "training.micro_batch_size": 16,
        "grpo.group_size": 8,
    }
    check_config(cfg(**over))
    assert resolve(cfg(**over), 1, device="cuda").dims.world_size == 1
    with pytest.raises(ConfigError, match="got 2 ranks"):
        resolve(cfg(**over), 2, device="cuda")
