"""pipedream_2bw (loom.parallel.pipedream): the delayed-update rule against its formula, the stream's order (no
flush between steps) and its bubble against 1F1B's, the config refusals, a resume without the older version."""

from __future__ import annotations

import pytest
import torch

from loom.config import ConfigError, build_config
from loom.methods import resolve
from loom.parallel.pipedream import WeightVersions, twobw_order, twobw_stream
from loom.parallel.pipeline import simulated_bubble, theoretical_bubble, twobw_bubble
from loom.train.steps import TwoBWCheckpoint


def _delayed_run(model, batches, lr):
    """SGD through ``WeightVersions`` as the engine drives it: begin, compute on 'current', finish, step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    versions = WeightVersions([model])
    seen = []
    for x, y in batches:
        versions.begin()
        with versions.using("current"):
            loss = ((model(x) - y) ** 2).sum()
        loss.backward()
        versions.finish()
        seen.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


def test_weight_versions_make_the_one_step_delayed_rule():
    """W[t+1] = W[t] - lr * grad f_t(W[t-1]), W[-1] = W[0], written out by hand; plain SGD differs."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    w0 = [p.detach().clone() for p in model.parameters()]
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(4)]
    lr = 0.1
    seen = _delayed_run(model, batches, lr)

    def loss_grad(ws, x, y):
        ws = [w.clone().requires_grad_() for w in ws]
        loss = ((x @ ws[0].T + ws[1] - y) ** 2).sum()
        return float(loss), torch.autograd.grad(loss, ws)

    prev, cur, expected = w0, w0, []
    for x, y in batches:
        loss, grads = loss_grad(prev, x, y)
        expected.append(loss)
        prev, cur = cur, [w - lr * g for w, g in zip(cur, grads)]
    assert seen == pytest.approx(expected, rel=1e-6)
    for p, w in zip(model.parameters(), cur):
        torch.testing.assert_close(p.detach(), w)
    # the guard: synchronous SGD's losses are not these (the test can fail)
    sync, ws = [], w0
    for x, y in batches:
        loss, grads = loss_grad(ws, x, y)
        sync.append(loss)
        ws = [w - lr * g for w, g in zip(ws, grads)]
    assert sync[1:] != pytest.approx(expected[1:], rel=1e-3)


def _storages(versions, model):
    """The distinct memory blocks the parameters and the weight versions hold."""
    tensors = [*model.parameters(), *(t for pair in versions.buffers.values() for t in pair)]
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("pp, m", [(2, 2), (3, 2)])
def test_early_forwards_keep_their_version_through_the_update_on_two_copies(pp, m):
    """Rank 0's stream of a ``pp``-stage pipeline on one process (the whole model as its stage): the next step's
    first forwards run on the newest weights before the optimizer's in-place update and their backward runs after
    it; losses and weights follow the rule written out by hand, and every weight is held twice in all (the
    parameter and one stash), never more."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps, lr = 4, 0.1
    data = [[(torch.randn(2, 3), torch.randn(2, 2)) for _ in range(m)] for _ in range(steps)]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    versions = WeightVersions([model])
    n_params = len(list(model.parameters()))
    assert len(_storages(versions, model)) == 2 * n_params
    seen, in_flight = [[] for _ in range(steps)], []
    for t in range(steps):
        versions.begin()
        for kind, version, i in twobw_order(pp, 0, m, t > 0, t < steps - 1):
            if kind == "F":
                s = t if version == "current" else t + 1
                x, y = data[s][i]
                with versions.using(version):
                    loss = ((model(x) - y) ** 2).sum()
                seen[s].append(float(loss))
                in_flight.append(loss)
            else:
                in_flight.pop(0).backward()
        versions.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert len(_storages(versions, model)) == 2 * n_params
    assert not in_flight

    def losses_and_grads(ws, batch):
        ws = {n: w.clone().requires_grad_() for n, w in ws.items()}
        losses = [((torch.func.functional_call(model, ws, (x,)) - y) ** 2).sum() for x, y in batch]
        return [float(v) for v in losses], dict(zip(ws, torch.autograd.grad(sum(losses), list(ws.values()))))

    prev, cur = w0, w0
    for t in range(steps):
        expected, grads = losses_and_grads(prev, data[t])
        assert seen[t] == pytest.approx(expected, rel=1e-6)
        prev, cur = cur, {n: w - lr * grads[n] for n, w in cur.items()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), cur[n])
    torch.testing.assert_close(versions.stash(), dict(prev))  # what a checkpoint holds beside the weights


def test_the_stream_never_flushes_between_steps():
    """Each step but the last ends with the next step's first pp-1-rank forwards on the newest weights; the
    run's bubble is 1F1B's stream of steps x m micro-batches, below 1F1B's at every step."""
    assert twobw_order(2, 0, 2, filled=False, more=True) == [
        ("F", "current", 0),
        ("F", "current", 1),
        ("B", "current", 0),
        ("F", "newest", 0),  # the next step's first micro-batch, before this step's last backward
        ("B", "current", 1),
    ]
    assert twobw_order(2, 0, 2, filled=True, more=False) == [
        ("F", "current", 1),
        ("B", "current", 0),
        ("B", "current", 1),
    ]
    for pp, m, steps in ((2, 2, 5), (4, 4, 3), (4, 8, 6)):
        stream = twobw_stream(pp, m, steps)
        assert simulated_bubble(stream, pp) == pytest.approx(twobw_bubble(pp, m, steps))
        assert theoretical_bubble("pipedream_2bw", pp, m, 1, steps) == pytest.approx(
            theoretical_bubble("1f1b", pp, steps * m, 1)
        )
        if steps > 1:
            assert twobw_bubble(pp, m, steps) < theoretical_bubble("1f1b", pp, m, 1)
    assert twobw_bubble(4, 8, 1000) < 1e-3  # the steady state has none


def _cfg(**overrides):
    base = {"parallel.pp_schedule": "pipedream_2bw", "model.n_layers": 4}
    return build_config(None, {k: str(v) for k, v in {**base, **overrides}.items()})


@pytest.mark.parametrize(
    "overrides, world, named",
    [
        ({"parallel.pp": 2, "parallel.dp_shard": 2}, 4, "dp_shard = 2"),
        ({"parallel.pp": 2, "parallel.tp": 2, "parallel.dp_shard": 1}, 4, "tp = 2"),
        ({"parallel.dp_replicate": 2, "parallel.dp_shard": 1}, 2, "dp_replicate = 2"),
        ({"parallel.pp": 2, "training.compile": "true"}, 2, "training.compile"),
        ({"training.nonfinite": "rollback"}, 1, "rollback"),
        ({"lora.rank": 4}, 1, "lora.rank"),
        ({"parallel.pp": 2, "parallel.pp_virtual_stages": 2}, 2, "one stage per rank"),
    ],
)
def test_refused_combinations_name_the_field_and_why(overrides, world, named):
    with pytest.raises(ConfigError) as exc:
        resolve(_cfg(**overrides), world)
    line = str(exc.value)
    assert "\n" not in line and named in line
    assert line.startswith("parallel.pp") or line.startswith("parallel.pp_virtual_stages")


def test_pp_alone_and_one_rank_resolve():
    resolve(_cfg(**{"parallel.pp": 2}), 2)
    resolve(_cfg(), 1)  # the single-process reference of the rule


def test_resume_from_a_checkpoint_without_the_stash_is_refused_in_one_line(tmp_path):
    """A checkpoint written under another schedule lacks the older weight version: refused before any weight is
    read (pipedream_2bw's own checkpoints resume: tests/distributed/test_model_parallel.py)."""
    import torch.distributed.checkpoint as dcp

    folder = str(tmp_path / "step_00000002")
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=folder, no_dist=True)
    hook = TwoBWCheckpoint(WeightVersions([torch.nn.Linear(2, 2)]))
    with pytest.raises(ConfigError) as exc:
        hook.check_resume(folder)
    assert str(exc.value).startswith("parallel.pp_schedule = 'pipedream_2bw': cannot resume from")
    assert "\n" not in str(exc.value)
    dcp.save({"model": {"w": torch.zeros(2)}, **hook.extra_state()}, checkpoint_id=folder, no_dist=True)
    hook.check_resume(folder)  # with the stash: resumes
