"""The hang report from flight-recorder records (loom.runtime.health), built from synthetic records in PyTorch's
dump format, and the straggler rule (loom.runtime.stragglers)."""

from __future__ import annotations

import json
import os
import pickle

from loom.runtime.flight_recorder import FR_FOLDER, summarize_dump
from loom.runtime.hang_report import REPORT, build_report, report_from_dumps
from loom.runtime.health import is_collective_failure, process_env
from loom.runtime.stragglers import find_stragglers, straggler_line, summarize


def entry(seq: int, op: str, sizes=((4,),), group=("0", "default_pg"), state="completed") -> dict:
    """One collective as PyTorch's flight recorder dumps it."""
    return {
        "record_id": seq,
        "pg_id": 0,
        "process_group": group,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": seq,
        "input_sizes": [list(s) for s in sizes],
        "input_dtypes": ["Float"],
        "output_sizes": [list(s) for s in sizes],
        "output_dtypes": ["Float"],
        "state": state,
        "retired": state == "completed",
        "timeout_ms": 5000,
        "is_p2p": False,
    }


def dump(entries: list[dict], world: int) -> dict:
    last = max(e["collective_seq_id"] for e in entries)
    done = max((e["collective_seq_id"] for e in entries if e["state"] == "completed"), default=0)
    return {
        "version": "2.10",
        "entries": entries,
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": last,
                "last_started_collective": last,
                "last_completed_collective": done,
            }
        },
    }


def answers(dumps: dict[int, dict | None]) -> dict:
    return {
        r: None
        if d is None
        else {
            "rank": r,
            "step": 7,
            "stack": ["loom/train/trainer.py:300 in train_step"],
            "groups": summarize_dump(d),
        }
        for r, d in dumps.items()
    }


BEFORE = [entry(54, "all_gather", ((8,),)), entry(55, "broadcast")]
HUNG = BEFORE + [entry(56, "all_reduce", state="started")]


def test_a_rank_that_never_joined_is_named_with_the_collective_and_what_the_others_did():
    report = build_report(
        answers({0: dump(HUNG, 3), 1: dump(HUNG, 3), 2: dump(BEFORE, 3)}), 3, detected_by=[0, 1]
    )
    assert report.stuck == [2] and report.silent == []
    (f,) = report.findings
    assert (f.desc, f.seq, f.op, f.waiting, f.behind, f.desync) == (
        "default_pg",
        56,
        "all_reduce",
        [0, 1],
        {2: "broadcast #55"},
        False,
    )
    line = report.line()
    assert "rank 2 never joined all_reduce #56 on group default_pg" in line
    assert "ranks 0, 1 waited in" in line and "rank 2's last: broadcast #55" in line
    assert "rank 2 (after step 7) is in loom/train/trainer.py:300 in train_step" in line


def test_ranks_that_issued_another_collective_under_the_same_number_are_a_desync():
    odd = BEFORE + [entry(56, "all_gather", ((8,),), state="started")]
    report = build_report(answers({0: dump(HUNG, 3), 1: dump(odd, 3), 2: dump(HUNG, 3)}), 3, detected_by=[0])
    (f,) = report.findings
    assert f.desync and f.behind == {1: "all_gather [[8]]"} and f.waiting == [0, 2]
    assert report.stuck == [1]
    assert "rank 1 issued another collective than ranks 0, 2 at #56" in report.line()


def test_a_rank_that_did_not_answer_is_named():
    report = build_report(answers({0: dump(HUNG, 2), 1: None}), 2, detected_by=[0])
    assert report.silent == [1] and report.stuck == [1]
    assert report.findings[0].behind == {1: "no answer"}
    assert "rank 1 never joined all_reduce #56" in report.line()


def test_every_rank_in_the_same_collective_names_no_one():
    report = build_report(answers({0: dump(HUNG, 2), 1: dump(HUNG, 2)}), 2, error="Timed out waiting 5000ms")
    assert report.stuck == [] and report.findings == []
    assert "every rank reached the same collective" in report.line()


def test_the_report_from_dump_files_as_nccl_writes_them(tmp_path):
    folder = tmp_path / FR_FOLDER
    folder.mkdir()
    for rank, entries in ((0, HUNG), (1, BEFORE), (2, HUNG), (3, HUNG)):
        with open(folder / f"rank_{rank}", "wb") as fh:
            pickle.dump(dump(entries, 4), fh)
    report = report_from_dumps(str(tmp_path))
    assert report.world == 4 and report.stuck == [1]
    assert report.findings[0].op == "all_reduce" and report.findings[0].waiting == [0, 2, 3]
    # older dumps
    assert report_from_dumps(str(tmp_path), since=os.path.getmtime(folder / "rank_3") + 10) is None


def test_summarize_keeps_each_groups_last_collectives_and_its_members():
    groups = summarize_dump(dump(HUNG + [entry(3, "all_reduce", group=("5", "mesh_tp"))], 2), last=2)
    assert sorted(groups) == ["0", "5"]
    assert groups["0"]["ranks"] == [0, 1] and groups["0"]["last_enqueued"] == 56
    assert [(c["seq"], c["op"]) for c in groups["0"]["collectives"]] == [
        (55, "broadcast"),
        (56, "all_reduce"),
    ]
    assert groups["5"]["desc"] == "mesh_tp" and groups["5"]["ranks"] is None


def test_process_env_turns_on_the_flight_recorder_and_nccl_dumps_into_the_run_dir():
    cpu = process_env("runs/x", "cpu")
    assert cpu == {"TORCH_FR_BUFFER_SIZE": "20000"}
    gpu = process_env("runs/x", "cuda", "DETAIL", comm_timing=True)
    assert gpu["TORCH_FR_DUMP_TEMP_FILE"] == os.path.abspath(os.path.join("runs/x", FR_FOLDER, "rank_"))
    assert gpu["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and gpu["TORCH_NCCL_ENABLE_TIMING"] == "1"
    assert gpu["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"


def test_gloo_and_monitored_barrier_errors_are_collective_failures():
    assert is_collective_failure(
        RuntimeError(
            "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms "
            "for recv operation to complete"
        )
    )
    assert is_collective_failure(RuntimeError("Rank 1 failed to pass monitoredBarrier in 5000 ms"))
    assert not is_collective_failure(RuntimeError("CUDA out of memory"))
    assert not is_collective_failure(ValueError("Timed out"))


def test_the_report_files(tmp_path):
    from loom.runtime.hang_report import write_report

    report = build_report(answers({0: dump(HUNG, 2), 1: dump(BEFORE, 2)}), 2, detected_by=[0])
    path = write_report(str(tmp_path), report)
    text = open(path).read()
    assert text.splitlines()[0] == report.line(path)
    assert "rank 1 (" in text and "#55 broadcast" in text
    with open(tmp_path / (REPORT + ".json")) as fh:
        assert json.load(fh)["stuck"] == [1]


def test_a_rank_whose_own_time_exceeds_the_median_by_the_fraction_is_a_straggler():
    assert find_stragglers([1.0, 1.1, 1.5, 0.9], 0.2) == [2]  # median 1.05: 1.5 > 1.26
    assert find_stragglers([1.0, 1.1, 1.5, 0.9], 0.5) == []
    assert find_stragglers([1.0, 3.0], 0.0) == []  # 0 = off
    per_rank = {
        "step_time": [2.0, 2.0],
        "data_wait": [0.0, 1.0],
        "comm_time": [None, None],
        "own_time": [0.5, 1.5],
    }
    fields = summarize(per_rank, 0.2)
    assert (
        fields["straggler_ranks"] == [1]
        and fields["own_time_median"] == 1.0
        and fields["own_time_max"] == 1.5
    )
    assert fields["comm_time_median"] is None
    assert straggler_line(10, per_rank, [1]).startswith(
        "straggler at step 10: rank 1 1.500 s/step of its own vs median 1.000 s (+50%; data wait 1.000 s)"
    )


def test_the_ranks_a_monitored_barrier_missed_are_named_with_where_they_are():
    waited = answers({0: dump(HUNG, 3), 1: dump(HUNG, 3), 2: dump(HUNG, 3)})
    waited[0].update(error="Ranks 1, 2 failed to pass monitoredBarrier in 5000 ms", phase="checkpoint")
    waited[2]["stack"] = ["loom/checkpoint/manager.py:340 in save", "tests/faults/ranks.py:90 in save"]
    report = build_report(waited, 3, detected_by=[0])
    f = report.findings[0]
    assert (f.op, f.desc, f.waiting) == ("monitored barrier", "checkpoint", [0])
    assert f.behind == {
        1: "loom/train/trainer.py:300 in train_step",
        2: "tests/faults/ranks.py:90 in save, called from loom/checkpoint/manager.py:340 in save",
    }
    assert report.stuck == [1, 2]
    assert report.line().startswith(
        "collective timeout: ranks 1, 2 never reached the monitored barrier (checkpoint) "
        "that rank 0 waited at"
    )


def test_point_to_point_ops_are_listed_apart_from_the_collectives():
    send = {**entry(1, "send", group=("7", "pp")), "is_p2p": True, "p2p_seq_id": 3, "collective_seq_id": 0}
    groups = summarize_dump(dump(HUNG + [send], 2))
    assert [(c["seq"], c["op"]) for c in groups["7"]["p2p"]] == [(3, "send")] and groups["7"][
        "collectives"
    ] == []
    assert groups["0"]["p2p"] == [] and groups["0"]["collectives"][-1]["seq"] == 56
    report = build_report(answers({0: dump(HUNG + [send], 2), 1: dump(BEFORE, 2)}), 2)
    assert report.stuck == [1] and "point-to-point: #3 send" in report.text()


def test_the_next_start_reports_dumps_once(tmp_path):
    from loom.runtime.health import previous_hang

    folder = tmp_path / FR_FOLDER
    folder.mkdir()
    for rank, entries in ((0, HUNG), (1, BEFORE)):
        with open(folder / f"rank_{rank}", "wb") as fh:
            pickle.dump(dump(entries, 2), fh)
    line = previous_hang(str(tmp_path))
    assert line.startswith("collective timeout: rank 1 never joined all_reduce #56")
    assert line.endswith(f"report {tmp_path / (REPORT + '.txt')}")
    assert previous_hang(str(tmp_path)) is None  # reported: the same dumps are not reported again
    assert previous_hang(str(tmp_path / "elsewhere")) is None


def test_distributed_debug_sets_torch_distributed_debug(monkeypatch, tmp_path):
    import torch.distributed as dist

    from loom.runtime.health import prepare_process

    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    before = dist.get_debug_level()
    try:
        prepare_process(str(tmp_path), "cpu", "DETAIL")
        assert (
            os.environ["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
            and os.environ["TORCH_FR_BUFFER_SIZE"] == "20000"
        )
        # torch.distributed read the variable at import
        assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    finally:
        monkeypatch.undo()
        dist.set_debug_level(before)
