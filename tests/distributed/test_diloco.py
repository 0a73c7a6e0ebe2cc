"""DiLoCo on gloo ranks, 2 replica groups (dp_replicate) of 1 rank each, and (exhaustive) of 2 FSDP2 ranks each,
with streaming fragments (loom.train.diloco).

- With H = 1, outer LR 1 and no momentum, DiLoCo is data parallelism: averaging the groups' weights after one step
  equals one step on the averaged gradient when the inner optimizer is linear in the gradient. AdamW is not, so this
  test steps with torch's SGD inside the real trainer (its optimizer swapped); the losses equal DDP's / HSDP's.
- The bytes that cross the groups (collectives whose ranks lie in both groups, counted at the c10d ops) per
  optimizer step are 1/H of the synchronous run's (1/(2H) with the bf16 wire), per-step scalars included.
- A run saved inside a round resumes bit for bit (outer weights and momentum, each group's weights and AdamW state).
- Overlapped reductions (parallel.diloco_overlap_steps = tau): two groups follow a one-process implementation of
  Streaming DiLoCo's delayed rule, and a group's step does not wait for the reduction it launched (its peer joins
  the reduction only after this group has taken tau - 1 more steps); in the trainer the bytes across the groups are
  those of the blocking run, and a run saved while a reduction is in flight resumes bit for bit.
"""

from __future__ import annotations

import functools
import json

import pytest

from tests.distributed.harness import run_fn
from tests.tiny import tiny_overrides

GROUPS = 2
LAYOUTS = {  # world, overrides, the resumed run's DiLoCo options (bf16 wire, streaming fragments)
    "ddp2": (2, {"parallel.dp_shard": 1}, {}),
    # one micro-batch per rank: FSDP2 reduces at every micro-batch, HSDP's bytes a step would grow with accumulation
    "hsdp4": (
        4,
        {"parallel.dp_shard": 2, "training.micro_batch_size": 2},
        {"parallel.diloco_bf16": "true", "parallel.diloco_fragments": 2},
    ),
}


def _cross_group_bytes(world: int, groups: int):
    """A dispatch mode that sums the bytes of every c10d collective whose ranks span more than one replica group
    (global rank r is in group r // (world / groups) on a (dp_replicate, dp_shard) mesh). A collective's bytes are
    those of its largest tensor (an all-reduce's buffer, a reduce-scatter's input, an all-gather's output)."""
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    per_group = world // groups

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.calls = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                pgs = [a for a in args if isinstance(a, torch.ScriptObject)]
                ranks = dist.get_process_group_ranks(torch._C._distributed_c10d.ProcessGroup.unbox(pgs[0]))
                if len({r // per_group for r in ranks}) > 1:
                    tensors = [
                        t
                        for a in args
                        for t in (a if isinstance(a, (list, tuple)) else [a])
                        if isinstance(t, torch.Tensor)
                    ]
                    self.bytes += max((t.numel() * t.element_size() for t in tensors), default=0)
                    self.calls += 1
            return func(*args, **(kwargs or {}))

    return Count()


def _trainer(tmp: str, name: str, layout: dict, **extra):
    from loom.config import build_config
    from loom.runtime.env import init_distributed
    from loom.train.trainer import Trainer

    overrides = tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{
            "run.seed": 3,
            "run.deterministic": "true",
            "parallel.dp_replicate": GROUPS,
            "optimizer.warmup_steps": 1,
            "optimizer.lr": 3e-3,
            **layout,
            **extra,
        },
    )
    cfg = build_config(None, {k: str(v) for k, v in overrides.items()})
    return Trainer(cfg, env=init_distributed(cfg.run.device, cfg.parallel.backend))


def _with_sgd(trainer, lr: float):
    """The trainer's inner optimizer swapped for torch's SGD (linear in the gradient), one per model part."""
    import torch

    trainer.optimizer.optimizers = [
        torch.optim.SGD([p for p in part.parameters() if p.requires_grad], lr=lr) for part in trainer.parts
    ]
    trainer.optimizer.fold_grad_factor = False
    return trainer


def _losses(records):
    return [r["loss"] for r in records]


def _count_steps(trainer, world: int):
    """The cross-group bytes of the trainer's optimizer steps (checkpoints and logging left out)."""
    count, step = _cross_group_bytes(world, GROUPS), trainer.train_step

    def counted(micro_batches):
        with count:
            return step(micro_batches)

    trainer.train_step = counted
    return count


def _runs(tmp: str, layout_name: str, rank: int, world: int) -> dict:
    _, layout, options = LAYOUTS[layout_name]
    # 0. DiLoCo alone, overlapped, 2 groups of one rank (in this spawn: starting processes costs more than it)
    out = {"overlapped": _overlapped(tmp, rank, world)} if world == GROUPS else {}
    # 1. H = 1, outer LR 1, no momentum against synchronous data parallelism, both stepping with SGD (no clipping: a
    # DiLoCo group's gradient norm is its own); the synchronous run's cross-group bytes are counted
    one = {"parallel.diloco_outer_lr": 1.0, "parallel.diloco_outer_momentum": 0.0}
    sync = _with_sgd(_trainer(tmp, "sgd-sync", layout, **{"training.max_norm": 0}), 0.1)
    count = _count_steps(sync, world)
    out["sgd_sync"], out["bytes_sync"] = _losses(sync.fit()), count.bytes
    out["shard_params"] = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in sync.params)
    out["sgd_h1"] = _losses(
        _with_sgd(
            _trainer(
                tmp, "sgd-h1", layout, **{"training.max_norm": 0, "parallel.diloco_inner_steps": 1}, **one
            ),
            0.1,
        ).fit()
    )
    # 2. AdamW, H = 2 (with the layout's options), saved at step 3 of 6 (after the outer step at 2, inside the round
    # that ends at 4) and resumed from there; the bytes of the uninterrupted run's steps are counted
    resume = {
        "parallel.diloco_inner_steps": 2,
        "training.steps": 6,
        "checkpoint.every": 3,
        "checkpoint.keep": 0,
        **options,
    }
    full = _trainer(tmp, "full", layout, **resume)
    count = _count_steps(full, world)
    records = full.fit()
    out["bytes_h2"], out["bytes_h2_reported"] = count.bytes, records[-1]["diloco_bytes"] if records else None
    resumed = _trainer(
        tmp, "resumed", layout, **resume, **{"checkpoint.resume": f"{tmp}/full/checkpoints/step_00000003"}
    )
    resumed.fit()
    out["full"] = [r for r in _records_of(tmp, "full") if r[0] > 3]
    out["resumed"] = _records_of(tmp, "resumed")
    out["bf16"] = options.get("parallel.diloco_bf16") == "true"
    # 3. the same with 2 fragments whose reductions overlap one step (H = 2: fragment 0 launched at steps 1, 3, 5 and
    # applied at 2, 4, 6, fragment 1 launched at 2, 4, 6): saved at step 3 with fragment 0's reduction in flight
    overlap = {**resume, "parallel.diloco_fragments": 2, "parallel.diloco_overlap_steps": 1}
    full = _trainer(tmp, "overlap-full", layout, **overlap)
    count = _count_steps(full, world)
    records = full.fit()
    out["bytes_overlap"], out["bytes_overlap_reported"] = (
        count.bytes,
        records[-1]["diloco_bytes"] if records else None,
    )
    with open(f"{tmp}/overlap-full/checkpoints/step_00000003/trainer_state.json") as fh:
        out["overlap_saved"] = json.load(fh)["diloco"]
    _trainer(
        tmp,
        "overlap-resumed",
        layout,
        **overlap,
        **{"checkpoint.resume": f"{tmp}/overlap-full/checkpoints/step_00000003"},
    ).fit()
    out["overlap_full"] = [r for r in _records_of(tmp, "overlap-full") if r[0] > 3]
    out["overlap_resumed"] = _records_of(tmp, "overlap-resumed")
    out["overlap_h2"] = _records_of(tmp, "full")
    out["overlap_all"] = _records_of(tmp, "overlap-full")
    return out


def _records_of(tmp: str, name: str) -> list:
    import json

    with open(f"{tmp}/{name}/metrics.jsonl") as fh:
        return [(r["step"], r["loss"], r["grad_norm"], r["batch_hash"]) for r in map(json.loads, fh)]


@pytest.fixture(
    scope="module", params=[pytest.param("ddp2"), pytest.param("hsdp4", marks=pytest.mark.exhaustive)]
)
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    return run_fn(LAYOUTS[request.param][0], functools.partial(_runs, str(tmp), request.param), str(tmp))


def test_h1_outer_lr1_no_momentum_equals_data_parallelism(runs):
    a, b = runs["sgd_h1"], runs["sgd_sync"]
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(y)
    assert a[-1] < a[0] - 0.05  # it trains


def test_bytes_across_groups_are_one_over_h_of_synchronous(runs):
    sync, per_param = runs["bytes_sync"], 2 if runs["bf16"] else 4
    figures = {k: runs[k] for k in ("bytes_sync", "bytes_h2", "bytes_h2_reported", "shard_params")}
    # the synchronous run all-reduces each gradient (shard) across the groups in each of its 4 steps; the rest (the
    # loss and token count a step, DDP's bucket order once) is under 1%
    assert 4 * 4 * runs["shard_params"] <= sync <= 4 * 4 * runs["shard_params"] * 1.01, figures
    # H = 2 over 6 steps: 3 synchronizations; per step 1/H of the synchronous bytes (1/(2H) on the bf16 wire)
    assert (runs["bytes_h2"] / 6) / (sync / 4) == pytest.approx(per_param / 4 / 2, rel=0.01), figures
    # beside the outer all-reduces: scalars a step
    assert runs["bytes_h2"] - runs["bytes_h2_reported"] <= 6 * 16
    assert runs["bytes_h2_reported"] == 3 * per_param * runs["shard_params"]


def test_resume_inside_a_round_is_bitwise(runs):
    full, resumed = runs["full"], runs["resumed"]
    assert [r[0] for r in resumed] == [4, 5, 6]
    assert [tuple(r) for r in resumed] == [tuple(r) for r in full]


def test_overlapped_reductions_send_the_blocking_runs_bytes(runs):
    """The same reductions, launched a step earlier than they are applied: the same bytes as the blocking H = 2
    run, and the losses part from it (the outer steps land a step later, mixed with the local progress)."""
    assert runs["bytes_overlap"] == runs["bytes_h2"]
    assert runs["bytes_overlap_reported"] == runs["bytes_h2_reported"]
    assert runs["overlap_all"][0] == runs["overlap_h2"][0]  # step 1: nothing applied yet in either run
    assert [r[1] for r in runs["overlap_all"]] != [r[1] for r in runs["overlap_h2"]]


def test_resume_mid_overlap_is_bitwise(runs):
    assert runs["overlap_saved"]["pending"] == [[0, 4]]  # fragment 0's reduction was in flight at the save
    full, resumed = runs["overlap_full"], runs["overlap_resumed"]
    assert [r[0] for r in resumed] == [4, 5, 6]
    assert [tuple(r) for r in resumed] == [tuple(r) for r in full]


OVERLAP = {"steps": 12, "h": 4, "tau": 2, "alpha": 0.25, "lr": 0.7, "momentum": 0.9}


def _overlapped(tmp: str, rank: int, world: int) -> dict:
    """Two groups of one rank run DiLoCo on a small model with 2 fragments whose reductions overlap tau = 2 steps
    (the inner steps are fixed changes of the weights). Rank 1 joins each reduction only after rank 0 has finished
    step launch + tau - 1: if rank 0's step waited for the reduction it launched, neither would get there and rank 1
    would give up (a store wait of 60 s). Rank 0 returns its weights after every step."""
    import datetime

    import torch.distributed as dist

    from loom.config.sections import ParallelConfig
    from loom.train.diloco import DiLoCo
    from tests.unit.test_diloco import _model, _perturb

    o, store, out = OVERLAP, dist.FileStore(f"{tmp}/overlap_store", world), {}
    for bf16 in (False, True):
        model = _model()
        cfg = ParallelConfig(
            diloco_inner_steps=o["h"],
            diloco_fragments=2,
            diloco_overlap_steps=o["tau"],
            diloco_overlap_alpha=o["alpha"],
            diloco_outer_lr=o["lr"],
            diloco_outer_momentum=o["momentum"],
            diloco_bf16=bf16,
        )
        diloco = DiLoCo(
            [model],
            cfg,
            group=dist.group.WORLD,
            n_groups=world,
            replica=rank,
            outer_group=dist.new_group(list(range(world))),
        )
        history = []
        for step in range(1, o["steps"] + 1):
            _perturb(model, step, rank)
            if rank == 1 and diloco.due(step):
                ahead = min(
                    step + o["tau"] - 1, o["steps"]
                )  # the last reduction is waited for after the loop
                store.wait([f"{bf16}-{ahead}"], datetime.timedelta(seconds=60))
            diloco.after_step(step)
            if rank == 0:
                store.set(f"{bf16}-{step}", "done")
            history.append([p.detach().flatten().tolist() for p in model.parameters()])
        diloco.wait()
        out[str(bf16)] = {
            "history": history,
            "bytes": diloco.bytes_sent,
            "fragments": [[list(diloco.params).index(k) for k in f] for f in diloco.fragments],
        }
    return out


def test_overlapped_groups_follow_the_delayed_rule_without_waiting(runs):
    import torch

    from tests.unit.test_diloco import _model, delayed_rule

    if "overlapped" not in runs:
        pytest.skip("run in the 2-rank layout's processes")
    got = runs["overlapped"]
    inits = [p.detach().clone() for p in _model().parameters()]
    n = sum(t.numel() for t in inits)
    for bf16 in (False, True):
        run = got[str(bf16)]
        history, _ = delayed_rule(
            inits, run["fragments"], groups=GROUPS, bf16=bf16, **{k: v for k, v in OVERLAP.items()}
        )
        for step, (mine, want) in enumerate(zip(run["history"], history), 1):
            for a, b in zip(mine, want[0]):  # rank 0 is replica 0
                torch.testing.assert_close(
                    torch.tensor(a), b.flatten(), rtol=1e-6, atol=1e-7, msg=f"step {step}"
                )
        assert run["bytes"] == 3 * n * (2 if bf16 else 4)  # 6 reductions of half the model in 12 steps


@pytest.mark.exhaustive
def test_tensor_and_pipeline_parallel_groups_give_the_one_rank_groups_losses(tmp_path):
    """Each replica group of 2 ranks under TP x 2 or PP x 2 (1F1B) trains as a group of one rank: the same losses over
    two rounds of H = 2 (TP and PP are layout-invariant inside a group; the outer all-reduce runs per shard / stage)."""
    from tests.distributed.harness import losses, run_jobs

    base = {
        "run.seed": 3,
        "parallel.dp_replicate": GROUPS,
        "parallel.dp_shard": 1,
        "parallel.diloco_inner_steps": 2,
    }
    ref = losses(
        run_jobs(2, [tiny_overrides(tmp_path / "one", tmp_path / "cache", **base)], str(tmp_path))[0]
    )
    tp, pp = run_jobs(
        4,
        [
            tiny_overrides(tmp_path / "tp", tmp_path / "cache", **base, **{"parallel.tp": 2}),
            tiny_overrides(tmp_path / "pp", tmp_path / "cache", **base, **{"parallel.pp": 2}),
        ],
        str(tmp_path),
    )
    for got in (losses(tp), losses(pp)):
        assert len(got) == len(ref) == 4
        for a, b in zip(got, ref):
            assert abs(a - b) <= 1e-5 * abs(b)
