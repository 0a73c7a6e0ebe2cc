"""training.gc_every: automatic garbage collection off while a run trains, collections at fixed steps on every rank
(the young generations, every generation each 10th time; all after the first step, which compiles), and the
process's setting given back at the end."""

from __future__ import annotations

import gc

from loom.train.hooks import GarbageCollection


def test_collections_come_at_fixed_steps_and_automatic_collection_returns():
    seen: list[int] = []

    def callback(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.enable()
    gc.callbacks.append(callback)
    try:
        hook = GarbageCollection(every=3)
        hook.begin(0)
        assert not gc.isenabled() and seen == [1]  # start-up's young garbage, once
        seen.clear()
        for step in range(1, 32):
            [[] for _ in range(2000)]  # allocations that would start automatic collections
            hook.after_update(step)
        # step 1: the first step's compilation (young: made with collection off); steps 3, 6, ..., 30, the 10th
        # collecting every generation
        assert seen == [1] + [1] * 9 + [2]
        hook.close()
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(callback)
        gc.enable()


def test_a_process_that_had_collection_off_keeps_it_off():
    gc.disable()
    try:
        hook = GarbageCollection(every=50)
        hook.begin(0)
        hook.close()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_run_trains_with_automatic_collection_off_and_gives_it_back(tmp_path, monkeypatch):
    from loom.config import build_config
    from loom.runtime.env import init_distributed
    from loom.train.trainer import Trainer

    states = []
    original = GarbageCollection.after_update

    def spy(self, step):
        states.append(gc.isenabled())
        original(self, step)

    cfg = build_config(
        None,
        {
            "model.flavor": "debug",
            "training.steps": "3",
            "training.gc_every": "2",
            "training.seq_len": "32",
            "training.global_batch_size": "2",
            "training.micro_batch_size": "2",
            "run.dir": str(tmp_path / "run"),
            "data.cache_dir": str(tmp_path / "cache"),
            "checkpoint.at_end": "false",
            "training.eval_at_end": "false",
            "metrics.tensorboard": "false",
        },
    )
    monkeypatch.setattr(GarbageCollection, "after_update", spy)
    Trainer(cfg, env=init_distributed("cpu", "gloo")).fit()
    assert states == [False, False, False] and gc.isenabled()
