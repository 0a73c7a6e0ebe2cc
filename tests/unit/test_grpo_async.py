"""Asynchronous GRPO (grpo.max_staleness; loom.rl.async_sampler) on the CPU: with staleness 1 the first GRPO step is
the synchronous run's (its batch sampled on the current weights, importance weights 1), later batches come from the
weights one optimizer step old (their sampler log-probabilities are those of the checkpoint one step back, not of
the current one), a run is deterministic for a fixed seed (the sampler's device named or not), the truncated importance weight enters the surrogate as
TRL applies it, a resume past the first GRPO step is refused in one line, and the config rules."""

from __future__ import annotations

import pytest
import torch

from loom.config.errors import ConfigError
from loom.methods import check_config
from loom.methods.grpo import GroupRelative
from loom.rl import async_sampler
from loom.rl.grpo import token_losses
from loom.rl.rollout import rows_to_batches, token_logps
from loom.train.trainer import Trainer
from tests.unit.test_grpo_train import grpo_config


def token_sum_reward(completion_ids, **_) -> list[float]:
    """A reward that differs between completions of one prompt (the tiny model's answers are never right), so the
    advantages and the loss are not zero."""
    return [float(sum(ids) % 7) / 7 for ids in completion_ids]


def config(tmp_path, **overrides):
    return grpo_config(
        tmp_path,
        **{
            "grpo.rewards": "tests.unit.test_grpo_async:token_sum_reward",
            "grpo.lr_ratio": 1.0,
            "optimizer.lr": 3e-2,
            "checkpoint.every": 1,
            "checkpoint.keep": 0,
            **overrides,
        },
    )


def fit(cfg) -> list[dict]:
    return Trainer(cfg, objective=GroupRelative(cfg)).fit()


def key(records) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r.get("reward")) for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A synchronous run and three asynchronous runs (staleness 1: on a thread twice, in a process) of one seed, 4
    steps (1 warm-up), with what the sampler handed out per step."""
    taken: dict[str, dict[int, async_sampler.Sampled]] = {}
    take = async_sampler.AsyncSampler.take
    out = {}
    for name, staleness in (("sync", 0), ("async", 1), ("again", 1), ("process", 1)):
        device = {
            "again": {"grpo.sampler_device": "cpu"},  # named: the same device
            "process": {"grpo.sampler_process": True},  # the sampler in a child process, its snapshot shared
        }.get(name, {})
        seen = taken.setdefault(name, {})

        def recording(self, step, seen=seen):
            seen[step] = take(self, step)
            return seen[step]

        async_sampler.AsyncSampler.take = recording
        try:
            tmp = tmp_path_factory.mktemp(name)
            out[name] = (tmp, fit(config(tmp, **{"grpo.max_staleness": staleness}, **device)))
        finally:
            async_sampler.AsyncSampler.take = take
    return out, taken


def test_the_first_grpo_step_is_the_synchronous_one_then_one_step_stale(runs):
    out, taken = runs
    sync, stale = out["sync"][1], out["async"][1]
    assert not taken["sync"] and sorted(taken["async"]) == [2, 3, 4]
    assert key(stale[:2]) == key(sync[:2])  # warm-up, then a batch sampled on the same (current) weights
    assert stale[1]["is_weight"] == 1.0 and stale[1]["async/staleness"] == 0.0
    assert [r["async/staleness"] for r in stale[2:]] == [1.0, 1.0]
    assert stale[2]["loss"] != 0.0 and key(stale[2:]) != key(sync[2:])


def test_stale_rollouts_come_from_the_previous_weights(runs):
    """Step 3's and step 4's rows were sampled by the weights after steps 1 and 2 (the checkpoints one step before
    the weights they train): the sampler's log-probabilities of them are those weights', not the next ones'."""
    from loom.checkpoint.manager import load_model_weights, step_dir_name
    from loom.models.registry import build_model

    out, taken = runs
    tmp, _ = out["async"]
    cfg = config(tmp)
    trainer = Trainer(cfg, objective=GroupRelative(cfg))  # only for the built model's args
    model = build_model(trainer.model_args).eval()
    r = trainer.objective.rollouts
    for step in (3, 4):
        s = taken["async"][step]
        (mb,) = rows_to_batches(
            s.prompts, [o.token_ids for o in s.outs], 8, r.pad_id, cfg.training.seq_len
        )  # one micro-batch of the 8 rows
        logps = {}
        for version in (step - 2, step - 1):
            load_model_weights(str(tmp / "run" / "checkpoints" / step_dir_name(version)), model)
            with torch.no_grad():
                logps[version] = token_logps(model(mb.inputs), mb.labels, cfg.grpo.temperature)
        got = torch.cat(s.sampler_logps)
        torch.testing.assert_close(got, logps[step - 2], rtol=0, atol=1e-6)
        assert (got - logps[step - 1]).abs().max() > 1e-4


def sampler_gaps(tmp_path, **overrides) -> list[tuple[float, float]]:
    """A 4-step asynchronous run (staleness 1, ``overrides``); for steps 3 and 4 the largest gap between the
    sampler's log-probabilities and those of the weights that sampled the rows (the checkpoint one step back) and
    of the next weights (recomputed on the CPU in fp32). The GPU test's check (tests/unit/test_grpo_gpu.py)."""
    from loom.checkpoint.manager import load_model_weights, step_dir_name
    from loom.models.registry import build_model

    seen: dict[int, async_sampler.Sampled] = {}
    take = async_sampler.AsyncSampler.take

    def recording(self, step):
        seen[step] = take(self, step)
        return seen[step]

    async_sampler.AsyncSampler.take = recording
    try:
        cfg = config(tmp_path, **{"grpo.max_staleness": 1, **overrides})
        trainer = Trainer(cfg, objective=GroupRelative(cfg))
        trainer.fit()
    finally:
        async_sampler.AsyncSampler.take = take
    model, r, gaps = build_model(trainer.model_args).eval(), trainer.objective.rollouts, []
    for step in (3, 4):
        s = seen[step]
        (mb,) = rows_to_batches(s.prompts, [o.token_ids for o in s.outs], 8, r.pad_id, cfg.training.seq_len)
        got, gap = torch.cat(s.sampler_logps).float(), []
        for version in (step - 2, step - 1):
            load_model_weights(str(tmp_path / "run" / "checkpoints" / step_dir_name(version)), model)
            with torch.no_grad():
                gap.append(
                    (got - token_logps(model(mb.inputs), mb.labels, cfg.grpo.temperature)).abs().max().item()
                )
        gaps.append(tuple(gap))
    return gaps


def test_a_run_is_deterministic_for_a_fixed_seed(runs):
    out, taken = runs
    assert key(out["again"][1]) == key(out["async"][1])
    for step in (2, 3, 4):
        a, b = taken["async"][step], taken["again"][step]
        assert [o.token_ids for o in a.outs] == [o.token_ids for o in b.outs]
        assert all(torch.equal(x, y) for x, y in zip(a.sampler_logps, b.sampler_logps))


def test_the_sampler_process_hands_out_the_thread_s_batches(runs):
    """In a child process, on a snapshot in shared memory refreshed in place after each step, the same batches (the
    same completions, log-probabilities bitwise, versions) as the thread's, so the same run; the child is gone."""
    import multiprocessing

    out, taken = runs
    assert key(out["process"][1]) == key(out["async"][1]) and sorted(taken["process"]) == [2, 3, 4]
    for step in (2, 3, 4):
        a, b = taken["async"][step], taken["process"][step]
        assert [o.token_ids for o in a.outs] == [o.token_ids for o in b.outs] and a.rows == b.rows
        assert all(torch.equal(x, y) for x, y in zip(a.sampler_logps, b.sampler_logps, strict=True))
        assert a.version == b.version == max(step - 2, 1)  # the warm-up's weights, then one step behind
    assert not multiprocessing.active_children()


def test_an_error_in_the_sampler_process_reaches_the_trainer(tmp_path, monkeypatch):
    """Step 3's prompts poisoned with an id past the vocabulary: the child's error is raised in the trainer as the
    same one-line error, its traceback the cause, and the child is gone (no hang)."""
    import multiprocessing

    prompts = async_sampler.ProcessSampler.prompts

    def poisoned(self, step):
        rows, ids, params = prompts(self, step)
        return rows, [p[:-1] + [10**6] for p in ids] if step == 3 else ids, params

    monkeypatch.setattr(async_sampler.ProcessSampler, "prompts", poisoned)
    cfg = config(tmp_path, **{"grpo.max_staleness": 1, "grpo.sampler_process": True, "training.steps": 3})
    with pytest.raises(ConfigError, match=r"^prompt = 1000000: token ids must be in \[0, 384\)$") as err:
        fit(cfg)  # the engine's one-line error, raised in the child, rebuilt here
    cause = err.value.__cause__
    assert isinstance(cause, async_sampler.SamplerError), repr(err.value)
    assert "in the GRPO sampler's process" in str(cause) and "Traceback" in str(cause)
    assert not multiprocessing.active_children()


def test_a_dead_sampler_process_stops_the_run_in_one_error(tmp_path, monkeypatch):
    """The child killed while the trainer waits: the wait's liveness check raises, naming the exit code."""
    import os
    import signal

    submit = async_sampler.ProcessSampler.submit

    def killing(self, step, version):
        submit(self, step, version)
        if step == 3:
            os.kill(self.proc.pid, signal.SIGKILL)

    monkeypatch.setattr(async_sampler.ProcessSampler, "submit", killing)
    cfg = config(tmp_path, **{"grpo.max_staleness": 1, "grpo.sampler_process": True, "training.steps": 3})
    with pytest.raises(async_sampler.SamplerError, match="process .* died with exit code -9"):
        fit(cfg)


def test_truncated_importance_weight_multiplies_the_surrogate_before_the_kl():
    """TRL's token_truncate: surrogate x min(exp(old - sampler), cap) + beta x KL."""
    g = torch.Generator().manual_seed(0)
    logps = torch.randn(3, 5, generator=g) - 2
    old, ref, sampler = (logps + 0.1 * torch.randn(3, 5, generator=g) for _ in range(3))
    adv = torch.randn(3, generator=g)
    weight = torch.exp(old - sampler).clamp(max=1.05)
    plain, kl, _, _ = token_losses(logps, old, adv, 0.2, 0.28, ref, 0.1)
    weighted, _, _, _ = token_losses(logps, old, adv, 0.2, 0.28, ref, 0.1, weight)
    torch.testing.assert_close(weighted, (plain - 0.1 * kl) * weight + 0.1 * kl)
    assert (weight < 1.05).any() and (weight == 1.05).any()


def test_a_resume_past_the_first_grpo_step_is_refused_in_one_line(runs):
    out, _ = runs
    tmp, _ = out["async"]
    cfg = config(tmp, **{"grpo.max_staleness": 1, "training.steps": 5})
    with pytest.raises(ConfigError, match=r"grpo.max_staleness.*resume with --grpo.max_staleness 0") as err:
        fit(cfg)
    assert "\n" not in str(err.value)


def test_config_rules(tmp_path):
    async_on = {"grpo.max_staleness": 1}
    for key_, value in (
        ("training.objective", "rloo"),
        ("grpo.iterations", 2),
        ("parallel.tp", 2),
        ("training.nonfinite", "rollback"),
    ):
        with pytest.raises(ConfigError, match=key_):
            check_config(grpo_config(tmp_path, **async_on, **{key_: value}))
    with pytest.raises(ConfigError, match="grpo.is_cap.*grpo.max_staleness"):
        check_config(grpo_config(tmp_path, **{"grpo.is_cap": 2.0}))
    with pytest.raises(ConfigError, match="grpo.sampler_device = 'gpu1': a device such as cuda:1"):
        check_config(grpo_config(tmp_path, **async_on, **{"grpo.sampler_device": "gpu1"}))
    check_config(grpo_config(tmp_path, **async_on, **{"grpo.is_cap": 2.0, "grpo.sampler_device": "cuda:1"}))


def test_a_sampler_device_of_another_type_is_refused_in_one_line(tmp_path):
    """The trainer on the CPU, the snapshot asked on a GPU: refused when the run starts (before the warm-up),
    naming the field."""
    cfg = config(tmp_path, **{"grpo.max_staleness": 1, "grpo.sampler_device": "cuda:0", "training.steps": 2})
    with pytest.raises(ConfigError, match="grpo.sampler_device = 'cuda:0': a cpu device, as the trainer's"):
        fit(cfg)


def test_a_sampler_of_its_own_in_a_run_of_several_processes_is_refused_in_one_line():
    """grpo.sampler_device and grpo.sampler_process hold for one process: with two, each is refused by name."""
    from types import SimpleNamespace

    from loom.config.sections import GrpoConfig

    two = SimpleNamespace(device=torch.device("cpu"), env=SimpleNamespace(world_size=2))
    for field, value in (("sampler_device", "cpu"), ("sampler_process", True)):
        g = GrpoConfig(max_staleness=1, **{field: value})
        with pytest.raises(ConfigError, match=f"grpo.{field} = .*more than one process"):
            async_sampler.check_layout(two, g)
    async_sampler.check_layout(two, GrpoConfig(max_staleness=1))  # the rank's own device, on a thread
