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


class _Stage(torch.nn.Module):
    """A pipeline stage as TwoBWPipeline calls it: ``stage(x, positions)`` on (batch, sequence, features)."""

    def __init__(self, layer: torch.nn.Module, act: bool):
        super().__init__()
        self.layer, self.act, self.args = layer, act, None

    def forward(self, x, positions):
        y = self.layer(x)
        return torch.tanh(y) if self.act else y


def _twobw_run(monkeypatch, layers, data, lr):
    """The 2BW stream over len(layers) stages, one thread per pp rank, hidden states and gradients through
    mailboxes standing in for point-to-point sends; SGD after each step. Returns the last stage's losses per step
    and the activation headers each rank received."""
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    import torch.distributed as dist

    from loom.parallel.pipedream import ACTIVATION_TAG, TwoBWPipeline
    from loom.parallel.pipeline import BusyClock

    pp, local = len(layers), threading.local()
    boxes = {(a, b, tag): queue.Queue() for a in range(pp) for b in range(pp) for tag in (21, 22)}
    headers = [0] * pp

    class Done:
        def is_completed(self):
            return True

        def wait(self):
            pass

    def isend(t, group=None, group_dst=None, tag=0):
        boxes[local.rank, group_dst, tag].put(t.clone())
        return Done()

    def recv(t, group=None, group_src=None, tag=0):
        got = boxes[group_src, local.rank, tag].get(timeout=30)
        assert got.shape == t.shape and got.dtype == t.dtype, (got.shape, t.shape)
        if tag == ACTIVATION_TAG and got.dtype == torch.int64:
            headers[local.rank] += 1
        t.copy_(got)

    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "recv", recv)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: local.rank)

    def rank(r: int):
        local.rank = r
        stage = _Stage(layers[r], act=r < pp - 1)
        plan = SimpleNamespace(pp=pp, has_first=r == 0, has_last=r == pp - 1)
        versions = WeightVersions([stage])
        pipe = TwoBWPipeline(plan, versions, None, torch.device("cpu"), BusyClock(torch.device("cpu")))
        opt = torch.optim.SGD(stage.parameters(), lr=lr)
        seen = []
        for t, batch in enumerate(data):
            versions.begin()
            upcoming = data[t + 1] if t + 1 < len(data) else None
            losses = pipe.step(batch, upcoming, lambda out, y: ((out - y) ** 2).sum())
            versions.finish()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seen.append([float(v) for v in losses])
        return seen

    with ThreadPoolExecutor(pp) as pool:
        results = [f.result(timeout=120) for f in [pool.submit(rank, r) for r in range(pp)]]
    assert all(box.empty() for box in boxes.values())  # every message received once
    return results[-1], headers


def test_the_stream_sends_one_shape_header_a_run_and_keeps_the_one_stage_losses(monkeypatch):
    """Hidden states carry a shape header in the run's first message only (reading one waits for the GPU: with one
    a micro-batch, 2BW ran 0.85x 1F1B on 2 H200s); the rest are sized from the micro-batch's (batch, sequence),
    which may change between steps. The losses of 2 and 3 stages are one stage's under the same delayed rule."""
    import copy

    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)]
    seqs = [3, 3, 5, 5]  # the sequence length changes at step 3: no new header
    data = [
        [(torch.randn(2, s, 4), torch.randn(2, s, 2), torch.arange(s).expand(2, s)) for _ in range(3)]
        for s in seqs
    ]

    def run(stages):
        return _twobw_run(monkeypatch, [copy.deepcopy(m) for m in stages], data, 0.05)

    L0, L1, L2 = layers
    one, _ = run([torch.nn.Sequential(L0, L1, torch.nn.Tanh(), L2)])
    two, headers = run([torch.nn.Sequential(L0, L1), L2])  # stage 0 ends in tanh, the last stage does not
    assert headers == [0, 1]
    assert [v for step in two for v in step] == pytest.approx([v for step in one for v in step], rel=1e-5)
    one, _ = run([torch.nn.Sequential(L0, torch.nn.Tanh(), L1, torch.nn.Tanh(), L2)])
    three, headers = run([L0, L1, L2])
    assert headers == [0, 1, 1]
    assert [v for step in three for v in step] == pytest.approx([v for step in one for v in step], rel=1e-5)
    assert one[1] != pytest.approx(
        one[0], rel=1e-3
    )  # the check can fail: steps see different weights and data


def test_a_stage_output_off_the_first_layout_is_refused_by_the_sender(monkeypatch):
    from types import SimpleNamespace

    import torch.distributed as dist

    from loom.parallel.pipedream import TwoBWPipeline
    from loom.parallel.pipeline import BusyClock

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    stage = _Stage(torch.nn.Linear(4, 4), act=True)
    plan = SimpleNamespace(pp=2, has_first=True, has_last=False)
    pipe = TwoBWPipeline(
        plan, WeightVersions([stage]), None, torch.device("cpu"), BusyClock(torch.device("cpu"))
    )
    pipe.hidden_out = ((4,), torch.float32)
    with pytest.raises(RuntimeError, match=r"output is \(2, 3, 4\) torch.float64, the next stage expects"):
        pipe._send(torch.zeros(2, 3, 4, dtype=torch.float64), 1, hidden=True, inputs=torch.zeros(2, 3, 4))


def test_a_step_whose_batch_is_not_the_one_read_ahead_stops_the_run():
    """The engine compares a 2BW step's token ids with those it read ahead a step before, on the host (the
    loader's tensors: no wait for the GPU), and stops the run where they differ."""
    from types import SimpleNamespace

    from loom.data import MicroBatch
    from loom.train.engine import Engine

    def mbs(*rows):
        return [MicroBatch(torch.tensor([r]), torch.tensor([r]), None, None) for r in rows]

    engine = SimpleNamespace(_read_ahead=[mb.inputs for mb in mbs([1, 2], [3, 4])])
    Engine._check_read_ahead(engine, mbs([1, 2], [3, 4]))
    assert engine._read_ahead is None
    Engine._check_read_ahead(
        engine, mbs([9, 9])
    )  # nothing read ahead (a run's first step): nothing to compare
    for other in (mbs([1, 2], [3, 5]), mbs([1, 2])):
        engine._read_ahead = [mb.inputs for mb in mbs([1, 2], [3, 4])]
        with pytest.raises(RuntimeError, match="not the ones the step before already ran forward"):
            Engine._check_read_ahead(engine, other)
