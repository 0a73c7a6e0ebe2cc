"""``loom train``'s memory check (loom.plan.fit): on the CPU the planner's estimate per process, with a margin, times
the local processes against the host's available memory; on a GPU the estimate against the GPU's free memory.
The host's memory is monkeypatched: no test depends on the machine it runs on."""

from __future__ import annotations

import os

import pytest

import loom.plan.fit as fit
from loom.config import build_config
from loom.config.errors import ConfigError
from loom.data import build_tokenizer
from loom.methods import resolve
from loom.plan.memory import GIB
from loom.plan.planner import rank_needs
from tests.tiny import tiny_config

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")


def _run(cfg, world: int = 1):
    """(dims, model args) as ``loom train``'s precheck resolves them."""
    run = resolve(cfg, world).with_model(build_tokenizer(cfg.data.tokenizer))
    return run.dims, run.model_args


def _recipe(name: str, **over):
    return build_config(
        os.path.join(RECIPES, name), {"run.device": "cpu", **{k: str(v) for k, v in over.items()}}
    )


def _host(monkeypatch, gib: float):
    monkeypatch.setattr(fit, "host_room", lambda: (gib * GIB, "test memory"))


def _check(cfg, ranks: int = 1, device: str = "cpu"):
    dims, args = _run(cfg, ranks)
    fit.check_fits(cfg, dims, args, device, ranks)


def test_1b_recipe_is_refused_on_a_24_gib_host(monkeypatch):
    """The 1B recipe on a 24 GiB CPU box: one line with the estimate, the memory and what to do, instead of the
    kernel's OOM killer minutes later."""
    _host(monkeypatch, 22.9)
    with pytest.raises(ConfigError) as err:
        _check(_recipe("llama3_1b.toml"))
    msg = str(err.value)
    assert "\n" not in msg and err.value.field == "model.flavor"
    assert "~42.3 GiB per rank by the planner's estimate" in msg and "22.9 GiB available (test memory)" in msg
    assert "smaller model" in msg and "a GPU" in msg


def test_lightest_1b_step_is_refused_by_the_margin(monkeypatch):
    """Micro-batch 1 with every block recomputed is estimated at 22.1 GiB: under the 22.9 GiB free, but not with
    what a process holds beyond its tensors (the margin), so it is refused rather than killed."""
    cfg = _recipe(
        "llama3_1b.toml", **{"training.micro_batch_size": 1, "training.activation_checkpointing": "full"}
    )
    assert 21 * GIB < rank_needs(cfg, *_run(cfg), "cpu").peak_bytes < 22.9 * GIB
    _host(monkeypatch, 22.9)
    with pytest.raises(
        ConfigError,
        match=r"model.flavor = '1B': .*room for ~19.9 GiB after a margin of 1 GiB \+ "
        r"10% per process: use a smaller model",
    ):
        _check(cfg)
    _host(monkeypatch, 27.0)  # 22.1 x 1.1 + 1 = 25.3 GiB
    _check(cfg)


@pytest.mark.parametrize(
    "cfg",
    [
        build_config(None, {}),
        build_config(None, {"model.flavor": "debug_moe"}),
        tiny_config(),
        _recipe("debug.toml"),
    ],
    ids=["default", "debug_moe", "tiny", "debug"],
)
def test_small_runs_pass_on_a_small_host(monkeypatch, cfg):
    """The default run, the tests' run and the debug recipe pass on a 2 GiB host, and as 4 processes on 6 GiB."""
    _host(monkeypatch, 2.0)
    _check(cfg)
    _host(monkeypatch, 6.0)
    cfg.training.global_batch_size = 4 * cfg.training.micro_batch_size
    _check(cfg, ranks=4)


def test_host_threshold_is_the_estimate_with_its_margin(monkeypatch):
    """Refused exactly when processes x (estimate x 1.1 + 1 GiB) exceed the available memory; the micro-batch hint
    counts what fits under the same margin."""
    cfg = tiny_config(
        **{"training.micro_batch_size": 64, "training.global_batch_size": 128, "training.seq_len": 256}
    )
    peak = rank_needs(cfg, *_run(cfg, 2), "cpu").peak_bytes
    need = 2 * (peak * (1 + fit.HOST_MARGIN) + fit.HOST_RESERVE_BYTES)
    _host(monkeypatch, 1.001 * need / GIB)
    _check(cfg, ranks=2)
    _host(monkeypatch, 0.999 * need / GIB)
    with pytest.raises(
        ConfigError,
        match=r"training.micro_batch_size = 64: a training step needs .* per rank by the "
        r"planner's estimate .*available \(test memory, shared by 2 ranks\), room "
        r"for .* each after a margin .*: lower training.micro_batch_size \(about "
        r"6[0-3] fit",
    ):
        _check(cfg, ranks=2)


def test_model_state_too_large_names_the_model_and_fewer_processes(monkeypatch):
    _host(monkeypatch, 22.9)
    with pytest.raises(
        ConfigError,
        match=r"model.flavor = '3B': model needs ~47.9 GiB for weights, gradients and "
        r"optimizer state per rank; .*use a smaller model, or a GPU",
    ):
        _check(_recipe("llama3_1b.toml", **{"model.flavor": "3B"}))
    # two DDP processes each hold the whole state: fewer of them helps
    ddp = _recipe(
        "llama3_1b.toml", **{"model.n_layers": 12, "parallel.dp_shard": 1, "parallel.dp_replicate": 2}
    )
    with pytest.raises(
        ConfigError,
        match=r"model.n_layers = 12: .*use a smaller model \(about .* layers fit\), "
        r"fewer processes on this machine, or a GPU",
    ):
        _check(ddp, ranks=2)


def test_unknown_host_memory_skips_the_check(monkeypatch):
    monkeypatch.setattr(fit, "host_room", lambda: None)
    _check(_recipe("llama3_1b.toml"))


def test_host_room_reads_this_machine():
    room = fit.host_room()
    if os.path.exists("/proc/meminfo"):
        assert room is not None and room[0] > 0 and room[1] in ("host memory", "the container's memory limit")


def test_gpu_threshold_is_the_tensors_against_free_memory_with_a_note_near_capacity(monkeypatch):
    """On CUDA the estimate carries its own workspace (no host margin; the host is not consulted). A step over the
    free memory only by the estimate's fragmentation allowance starts, with a one-line note (near capacity the
    caching allocator frees its cache and retries: the 8B CP2 pair at 64k tokens, estimated at 142.5 GiB, ran
    with 139.8 GiB free); 1% less than the tensors need is refused."""
    cfg = _recipe("llama3_1b.toml", **{"run.device": "auto"})
    dims, args = _run(cfg)
    peak = rank_needs(cfg, dims, args, "cuda").peak_bytes
    need = fit.tensor_need(peak, gpu=True)
    assert 0.94 * peak < need < 0.96 * peak and fit.tensor_need(peak, gpu=False) == peak
    monkeypatch.setattr(fit, "host_room", lambda: (0.0, "no host memory"))
    monkeypatch.setattr(fit, "gpu_room", lambda count, own: (1.01 * peak, "test GPU memory"))
    assert fit.check_fits(cfg, dims, args, "cuda", 1) == ""
    monkeypatch.setattr(fit, "gpu_room", lambda count, own: ((need + peak) / 2, "test GPU memory"))
    note = fit.check_fits(cfg, dims, args, "cuda", 1)
    assert note.startswith("loom: note: a training step needs ~") and "\n" not in note
    assert f"(~{peak / GIB:,.1f} with the caching allocator's fragmentation)" in note
    assert "available (test GPU memory): it starts near the GPU's capacity" in note
    assert note.endswith("slower steps, or out of memory where the estimate is low")
    monkeypatch.setattr(fit, "gpu_room", lambda count, own: (0.99 * need, "test GPU memory"))
    with pytest.raises(
        ConfigError,
        match=r"training.micro_batch_size = 4: .* GiB available \(test GPU memory\): "
        r"lower training.micro_batch_size \(about 3 fit",
    ):
        fit.check_fits(cfg, dims, args, "cuda", 1)


def test_a_step_that_fits_only_recomputed_names_the_least_rerun_before_full(monkeypatch):
    """Micro-batch 1 without checkpointing is too big for the GPU, with op-level recomputation it fits: the refusal
    names the op-level mode that reruns least and fits (matmuls, else op) before full, with both estimates."""
    cfg = _recipe("llama3_1b.toml", **{"run.device": "auto", "training.seq_len": 8192})
    dims, args = _run(cfg)
    one = _recipe(
        "llama3_1b.toml", **{"run.device": "auto", "training.seq_len": 8192, "training.micro_batch_size": 1}
    )
    none = fit.tensor_need(rank_needs(one, dims, args, "cuda").peak_bytes, gpu=True)
    matmuls = fit.tensor_need(fit._smallest_step(cfg, dims, args, "cuda", "matmuls"), gpu=True)
    op = fit.tensor_need(fit._smallest_step(cfg, dims, args, "cuda", "op"), gpu=True)
    assert op < matmuls < none
    monkeypatch.setattr(fit, "host_room", lambda: (0.0, "no host memory"))
    for room, mode in (((matmuls + none) / 2, "matmuls"), ((op + matmuls) / 2, "op")):
        monkeypatch.setattr(fit, "gpu_room", lambda count, own, room=room: (room, "test GPU memory"))
        with pytest.raises(
            ConfigError, match=rf"set training.activation_checkpointing {mode} \(~[\d.]+ GiB\) or full"
        ):
            fit.check_fits(cfg, dims, args, "cuda", 1)
    # a run already on matmuls that does not fit is pointed at op (less memory), then full
    on = _recipe(
        "llama3_1b.toml",
        **{"run.device": "auto", "training.seq_len": 8192, "training.activation_checkpointing": "matmuls"},
    )
    with pytest.raises(
        ConfigError, match=r"set training.activation_checkpointing op \(~[\d.]+ GiB\) or full"
    ):
        fit.check_fits(on, dims, args, "cuda", 1)
    # never a mode the run would refuse: no matmuls for compiled MoE blocks under expert parallelism
    from loom.models.llama import FLAVORS

    moe_args = FLAVORS["debug_moe"]
    moe = build_config(None, {"model.flavor": "debug_moe", "training.compile": "true", "parallel.ep": "2"})
    assert fit.lighter_op_level(moe, moe_args) == ("op",)
    assert fit.lighter_op_level(build_config(None, {"model.flavor": "debug_moe"}), moe_args) == (
        "matmuls",
        "op",
    )
    assert fit.lighter_op_level(on, args) == ("op",) and fit.lighter_op_level(one, args) == ("matmuls", "op")
