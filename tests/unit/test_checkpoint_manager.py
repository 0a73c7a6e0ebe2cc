"""CheckpointManager in one process on a tiny real model: markers, verification, retention, replacing
a step folder, and the choice ``checkpoint.resume`` makes. The trainer-level tests (kills, SIGTERM,
the CLI) are in test_checkpoint_recovery.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings

import pytest
import torch

from loom.checkpoint.manager import (
    MARKER,
    STATE,
    CheckpointManager,
    CorruptCheckpoint,
    DiskFull,
    _HashingWriter,
    file_record,
    folder_bytes,
    list_complete,
    step_dir_name,
    verify,
    write_marker,
)
from loom.config import CheckpointConfig
from loom.config.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def tiny_model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()  # the optimizer has state to save
    return model, optimizer


def manager(run_dir, **cfg) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(**cfg), str(run_dir), is_main=True, barrier=lambda: None)


def save_steps(mgr: CheckpointManager, steps, model=None, optimizer=None) -> None:
    if model is None:
        model, optimizer = tiny_model_and_optimizer()
    for step in steps:
        mgr.save(step, model, optimizer, {"step": step}, f"# config of step {step}\n")
    mgr.wait()


def folder(run_dir, step: int) -> str:
    return os.path.join(str(run_dir), "checkpoints", step_dir_name(step))


def saved_steps(run_dir) -> list[int]:
    return [step for step, _ in list_complete(os.path.join(str(run_dir), "checkpoints"))]


def test_marker_lists_every_file_with_size_and_hash(tmp_path):
    save_steps(manager(tmp_path), [3])
    meta = verify(folder(tmp_path, 3))
    on_disk = sorted(n for n in os.listdir(folder(tmp_path, 3)) if n != MARKER)
    assert meta["step"] == 3
    assert sorted(meta["files"]) == on_disk
    assert {".metadata", STATE, "config.toml"} <= set(on_disk)
    assert any(n.endswith(".distcp") for n in on_disk)
    for name, info in meta["files"].items():
        assert info["size"] == os.path.getsize(os.path.join(folder(tmp_path, 3), name))
        assert len(info["blake2b"]) == 32


def test_each_rank_records_its_shards_and_the_marker_uses_the_record(tmp_path):
    save_steps(manager(tmp_path), [3])
    with open(os.path.join(folder(tmp_path, 3), "__0_hashes.json")) as fh:
        recorded = json.load(fh)
    assert sorted(recorded) == sorted(n for n in os.listdir(folder(tmp_path, 3)) if n.endswith(".distcp"))
    meta = verify(folder(tmp_path, 3))
    for name, info in recorded.items():
        assert meta["files"][name] == info == file_record(os.path.join(folder(tmp_path, 3), name))


def test_a_record_that_does_not_fit_the_file_is_not_used(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"index")
    (tmp_path / "__0_0.distcp").write_bytes(b"shard bytes")
    (tmp_path / "__0_hashes.json").write_text(json.dumps({"__0_0.distcp": {"size": 3, "blake2b": "0" * 32}}))
    write_marker(str(tmp_path), 1)
    assert verify(str(tmp_path))["files"]["__0_0.distcp"] == file_record(str(tmp_path / "__0_0.distcp"))


def test_async_saves_are_committed_by_wait(tmp_path):
    mgr = manager(tmp_path, keep=2, async_save=True)
    model, optimizer = tiny_model_and_optimizer()
    for step in (1, 2, 3):
        mgr.save(step, model, optimizer, {"step": step}, "")  # each save first commits the one before
    assert saved_steps(tmp_path) == [1, 2]
    mgr.wait()
    assert saved_steps(tmp_path) == [2, 3]
    for step in (2, 3):
        assert verify(folder(tmp_path, step))["step"] == step


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_retention_keeps_the_last_k(tmp_path, keep):
    save_steps(manager(tmp_path, keep=keep), [1, 2, 3, 4, 5])
    assert saved_steps(tmp_path) == [1, 2, 3, 4, 5][-keep:]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [step_dir_name(s) for s in [1, 2, 3, 4, 5][-keep:]]


def test_keep_zero_keeps_all(tmp_path):
    save_steps(manager(tmp_path, keep=0), [1, 2, 3, 4])
    assert saved_steps(tmp_path) == [1, 2, 3, 4]


def test_retention_counts_only_complete_checkpoints(tmp_path):
    save_steps(manager(tmp_path, keep=0), [1, 2])
    os.remove(os.path.join(folder(tmp_path, 2), MARKER))  # step 2 is no checkpoint any more
    save_steps(manager(tmp_path, keep=2), [3])
    assert saved_steps(tmp_path) == [1, 3]


def test_leftovers_are_removed_when_a_manager_starts(tmp_path):
    save_steps(manager(tmp_path, keep=0), [1])
    ckpt = tmp_path / "checkpoints"
    (ckpt / ".step_00000002.tmp").mkdir()
    (ckpt / ".step_00000002.tmp" / "__0_0.distcp").write_bytes(b"half")
    shutil.copytree(folder(tmp_path, 1), ckpt / ".step_00000000.deleting")
    (ckpt / "notes").mkdir()  # not ours: left alone
    manager(tmp_path)
    assert sorted(os.listdir(ckpt)) == ["notes", step_dir_name(1)]


def test_a_second_save_of_a_step_replaces_the_folder_and_keeps_the_old_one_aside(tmp_path):
    """A step folder left by another run (or a corrupt one) is replaced, not kept in place of the new save, and
    not deleted either: it moves into superseded/<time>/."""
    save_steps(manager(tmp_path, keep=0), [2], *tiny_model_and_optimizer(seed=1))
    with open(os.path.join(folder(tmp_path, 2), "__0_0.distcp"), "r+b") as fh:
        fh.truncate(100)
    save_steps(manager(tmp_path, keep=0), [2], *tiny_model_and_optimizer(seed=2))
    verify(folder(tmp_path, 2))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [step_dir_name(2), "superseded"]
    (aside,) = os.listdir(tmp_path / "checkpoints" / "superseded")
    assert os.listdir(tmp_path / "checkpoints" / "superseded" / aside) == [step_dir_name(2)]


def test_resuming_an_older_checkpoint_is_refused_naming_the_newer_ones_and_deletes_nothing(tmp_path):
    """Issue 49: a branch from step 2 of a run with steps 2, 4, 6 saved over step 4 and 6."""
    save_steps(lineage_manager(tmp_path, keep=0), [2, 4, 6])
    before = {s: verify(folder(tmp_path, s))["files"] for s in (2, 4, 6)}
    with pytest.raises(UserError) as caught:
        manager(tmp_path, keep=0, resume=folder(tmp_path, 2)).choose()
    message = str(caught.value)
    assert "step 4, 6" in message and "--checkpoint.overwrite true" in message and "\n" not in message
    assert {s: verify(folder(tmp_path, s))["files"] for s in (2, 4, 6)} == before


def test_a_run_dir_given_as_the_checkpoint_names_its_newest_step(tmp_path):
    """checkpoint.resume = a run dir or its checkpoint folder: one line naming a step_N to give (it said the folder
    was an incomplete checkpoint)."""
    save_steps(manager(tmp_path, keep=0), [2, 4])
    for given in (str(tmp_path), str(tmp_path / "checkpoints")):
        with pytest.raises(UserError) as caught:
            verify(given)
        message = str(caught.value)
        assert "not one checkpoint but a folder of them" in message and folder(tmp_path, 4) in message, (
            message
        )


def test_overwrite_branches_from_an_older_checkpoint_moving_the_newer_ones_aside(tmp_path, capsys):
    save_steps(lineage_manager(tmp_path, keep=0), [2, 4, 6])
    before = {s: verify(folder(tmp_path, s))["files"] for s in (4, 6)}
    mgr = manager(tmp_path, keep=0, resume=folder(tmp_path, 2), overwrite=True)
    model, optimizer = tiny_model_and_optimizer(seed=5)
    assert mgr.load(mgr.choose(), model, optimizer)["step"] == 2
    save_steps(mgr, [4, 6], model, optimizer)  # the branch's own step 4 and 6
    (moved,) = os.listdir(os.path.join(str(tmp_path), "checkpoints", "superseded"))
    aside = os.path.join(str(tmp_path), "checkpoints", "superseded", moved)
    assert {s: verify(os.path.join(aside, step_dir_name(s)))["files"] for s in (4, 6)} == before
    assert saved_steps(tmp_path) == [2, 4, 6]
    assert f"moved 2 checkpoint(s) into {aside}" in capsys.readouterr().out


def test_the_same_step_is_saved_once_by_one_manager(tmp_path):
    mgr = manager(tmp_path, keep=0)
    save_steps(mgr, [2])
    first = verify(folder(tmp_path, 2))
    save_steps(mgr, [2], *tiny_model_and_optimizer(seed=3))
    assert verify(folder(tmp_path, 2)) == first


def test_the_step_resumed_from_is_not_saved_again(tmp_path):
    save_steps(manager(tmp_path), [2])
    before = os.stat(folder(tmp_path, 2)).st_ino
    mgr = manager(tmp_path, resume="auto")
    model, optimizer = tiny_model_and_optimizer(seed=6)
    assert mgr.load(mgr.choose(), model, optimizer)["step"] == 2
    save_steps(mgr, [2], model, optimizer)  # a finished run resumed again saves at its end
    assert os.stat(folder(tmp_path, 2)).st_ino == before  # not replaced: replacing renames a new folder


# ---- corruption -------------------------------------------------------------------
def shard_name(path: str) -> str:
    return next(n for n in sorted(os.listdir(path)) if n.endswith(".distcp"))


def truncate_shard(path: str) -> str:
    name = shard_name(path)
    full = os.path.join(path, name)
    with open(full, "r+b") as fh:
        fh.truncate(os.path.getsize(full) // 2)
    return name


def remove_metadata(path: str) -> str:
    os.remove(os.path.join(path, ".metadata"))
    return ".metadata"


def flip_byte(path: str) -> str:
    name = shard_name(path)
    full = os.path.join(path, name)
    with open(full, "r+b") as fh:
        fh.seek(os.path.getsize(full) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return name


CORRUPTIONS = {
    "truncated shard": (truncate_shard, "bytes, expected"),
    "missing metadata": (remove_metadata, "is missing"),
    "flipped byte": (flip_byte, "does not match its recorded hash"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_verify_names_folder_and_file(tmp_path, kind):
    save_steps(manager(tmp_path, keep=0), [2, 4])
    corrupt, problem = CORRUPTIONS[kind]
    name = corrupt(folder(tmp_path, 4))
    with pytest.raises(CorruptCheckpoint) as exc:
        verify(folder(tmp_path, 4))
    message = str(exc.value)
    assert folder(tmp_path, 4) in message and f"file {name} " in message and problem in message
    verify(folder(tmp_path, 2))  # the other one is untouched


def test_a_flipped_byte_is_found_only_by_the_hash(tmp_path):
    save_steps(manager(tmp_path), [1])
    flip_byte(folder(tmp_path, 1))
    verify(folder(tmp_path, 1), check_hash=False)  # same sizes
    with pytest.raises(CorruptCheckpoint, match="hash"):
        verify(folder(tmp_path, 1))


def test_a_damaged_marker_is_reported(tmp_path):
    save_steps(manager(tmp_path), [1])
    with open(os.path.join(folder(tmp_path, 1), MARKER), "w") as fh:
        fh.write('{"step": 1, "fi')
    with pytest.raises(CorruptCheckpoint, match=f"unreadable {MARKER}"):
        verify(folder(tmp_path, 1))
    with open(os.path.join(folder(tmp_path, 1), MARKER), "w") as fh:
        fh.write('{"step": 1}')
    with pytest.raises(CorruptCheckpoint, match=f"unreadable {MARKER}"):
        verify(folder(tmp_path, 1))


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_auto_falls_back_with_a_warning(tmp_path, kind):
    save_steps(manager(tmp_path, keep=0), [2, 4])
    corrupt, _ = CORRUPTIONS[kind]
    corrupt(folder(tmp_path, 4))
    with pytest.warns(UserWarning, match="falling back") as caught:
        chosen = manager(tmp_path, resume="auto").resolve()
    assert chosen == folder(tmp_path, 2)
    assert folder(tmp_path, 4) in str(caught[0].message)
    # the skipped folder is kept for inspection, out of the way of the resumed run's own step 4
    (aside,) = os.listdir(tmp_path / "checkpoints" / "corrupt")
    assert os.listdir(tmp_path / "checkpoints" / "corrupt" / aside) == [step_dir_name(4)]
    assert not os.path.exists(
        folder(tmp_path, 4)
    ) and f"moved into {tmp_path / 'checkpoints' / 'corrupt' / aside}" in str(caught[0].message)


def test_auto_picks_the_newest_and_none_when_nothing_is_left(tmp_path):
    assert manager(tmp_path, resume="auto").resolve() is None
    save_steps(manager(tmp_path, keep=0), [2, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manager(tmp_path, resume="auto").resolve() == folder(tmp_path, 4)


def test_auto_with_no_loadable_checkpoint_is_an_error_naming_each(tmp_path):
    """Starting from scratch is only ever an explicit choice; a deleted marker is one more incomplete checkpoint."""
    save_steps(manager(tmp_path, keep=0), [2, 4, 6])
    truncate_shard(folder(tmp_path, 2))
    os.remove(os.path.join(folder(tmp_path, 4), MARKER))
    truncate_shard(folder(tmp_path, 6))
    with pytest.raises(CorruptCheckpoint) as caught:
        manager(tmp_path, resume="auto").resolve()
    message = str(caught.value)
    assert "none of the 3 checkpoint(s)" in message and "\n" not in message
    assert f"{folder(tmp_path, 6)}: file __0_0.distcp has" in message
    assert f"{folder(tmp_path, 4)} is incomplete: no {MARKER}" in message
    assert f"{folder(tmp_path, 2)}: file __0_0.distcp has" in message
    assert "--checkpoint.resume none --checkpoint.overwrite true" in message


def test_a_deleted_marker_is_skipped_with_a_warning_like_any_incomplete_checkpoint(tmp_path):
    save_steps(manager(tmp_path, keep=0), [2, 4])
    os.remove(os.path.join(folder(tmp_path, 4), MARKER))
    with pytest.warns(
        UserWarning, match=f"{step_dir_name(4)} is incomplete: no {MARKER}; falling back to step 2"
    ):
        assert manager(tmp_path, resume="auto").resolve() == folder(tmp_path, 2)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_an_explicit_corrupt_path_is_an_error(tmp_path, kind):
    save_steps(manager(tmp_path, keep=0), [2, 4])
    corrupt, _ = CORRUPTIONS[kind]
    corrupt(folder(tmp_path, 4))
    with pytest.raises(CorruptCheckpoint, match=step_dir_name(4)):
        manager(tmp_path, resume=folder(tmp_path, 4)).resolve()
    assert manager(tmp_path, resume=folder(tmp_path, 2)).resolve() == folder(tmp_path, 2)


def test_an_explicit_path_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CorruptCheckpoint, match="no COMPLETE.json"):
        manager(tmp_path, resume=str(tmp_path / "nowhere")).resolve()


def test_load_restores_model_and_optimizer(tmp_path):
    model, optimizer = tiny_model_and_optimizer(seed=4)
    save_steps(manager(tmp_path), [7], model, optimizer)
    other, other_opt = tiny_model_and_optimizer(seed=5)
    mgr = manager(tmp_path, resume="auto")
    state = mgr.load(mgr.choose(), other, other_opt)
    assert state == {"step": 7, "checkpoint": folder(tmp_path, 7)}
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), other.parameters()):
        sa, sb = optimizer.state[p], other_opt.state[q]
        assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- lineage: retention, fresh starts --------------------------------------------------------
def lineage_manager(run_dir, **cfg) -> CheckpointManager:
    mgr = manager(run_dir, **cfg)
    mgr.choose()
    return mgr


def test_every_marker_names_the_lineage_and_a_resume_carries_it_over(tmp_path):
    first = lineage_manager(tmp_path, resume="none")
    model, optimizer = tiny_model_and_optimizer()
    for step in (1, 2):
        first.save(step, model, optimizer, {"step": step, "lineage": first.lineage}, "")
    assert [json.load(open(os.path.join(folder(tmp_path, s), MARKER)))["lineage"] for s in (1, 2)] == [
        first.lineage
    ] * 2
    assert lineage_manager(tmp_path, resume="auto").lineage == first.lineage
    # a fresh start: a new one
    assert lineage_manager(tmp_path / "other", resume="auto").lineage != first.lineage


def test_retention_removes_only_the_current_lineages_checkpoints(tmp_path):
    """An old run's higher steps never push a new run's checkpoints out (they are another lineage's)."""
    old = lineage_manager(tmp_path, keep=0, resume="none")
    save_steps(old, range(1, 31))
    for step in range(1, 28):  # the old run kept step 28..30 only
        shutil.rmtree(folder(tmp_path, step))
    new = manager(tmp_path, keep=2)
    new.lineage = (
        "a-new-run"  # as a fresh start with checkpoint.overwrite would (without moving the old ones)
    )
    save_steps(new, [5, 10, 15])
    assert saved_steps(tmp_path) == [10, 15, 28, 29, 30]


def test_a_fresh_start_where_checkpoints_exist_is_refused(tmp_path):
    save_steps(lineage_manager(tmp_path), [3, 7])
    with pytest.raises(UserError) as caught:
        manager(tmp_path, resume="none").choose()
    message = str(caught.value)
    assert os.path.join(str(tmp_path), "checkpoints") in message and "newest step 7" in message
    assert "--checkpoint.resume auto" in message and "--checkpoint.overwrite true" in message
    assert saved_steps(tmp_path) == [3, 7]


def test_overwrite_moves_the_old_checkpoints_aside_and_deletes_nothing(tmp_path, capsys):
    save_steps(lineage_manager(tmp_path), [3, 7])
    before = {s: verify(folder(tmp_path, s))["files"] for s in (3, 7)}
    mgr = manager(tmp_path, resume="none", overwrite=True)
    assert mgr.choose() is None and saved_steps(tmp_path) == []
    (moved,) = os.listdir(os.path.join(str(tmp_path), "checkpoints", "superseded"))
    aside = os.path.join(str(tmp_path), "checkpoints", "superseded", moved)
    assert sorted(os.listdir(aside)) == [step_dir_name(3), step_dir_name(7)]
    assert {s: verify(os.path.join(aside, step_dir_name(s)))["files"] for s in (3, 7)} == before
    assert f"moved 2 checkpoint(s) into {aside}" in capsys.readouterr().out


def test_latest_is_the_newest_verified_checkpoint_of_this_lineage(tmp_path):
    mgr = lineage_manager(tmp_path, keep=0)
    save_steps(mgr, [2, 4])
    other = manager(tmp_path, keep=0)
    other.lineage = "another-run"
    save_steps(other, [6])
    assert mgr.latest() == folder(tmp_path, 4)
    truncate_shard(folder(tmp_path, 4))
    assert mgr.latest() == folder(tmp_path, 2)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, async_save
):
    mgr = lineage_manager(tmp_path, keep=0, async_save=async_save)
    save_steps(mgr, [2])
    real_write = _HashingWriter.write_data

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_HashingWriter, "write_data", full)
    with pytest.raises(DiskFull) as caught:
        save_steps(mgr, [4])
    message = str(caught.value)
    assert "\n" not in message and "no space left on the device while saving step 4" in message
    assert f"about {folder_bytes(folder(tmp_path, 2)):,} bytes (the size of step 2)" in message
    assert "step 2 is intact" in message
    monkeypatch.setattr(_HashingWriter, "write_data", real_write)
    assert sorted(os.listdir(os.path.join(str(tmp_path), "checkpoints"))) == [
        step_dir_name(2)
    ]  # no partial folder
    verify(folder(tmp_path, 2))
