"""The GPU run record (tests/gpu/README.md, tests/gpu/runs.json) lists every GPU test file, and the recorder folds a
JUnit report in as documented: a clean file gets a new last pass, a failing one keeps its old pass."""

from __future__ import annotations

import json

import pytest

from tests.gpu import record


def test_every_gpu_test_file_is_in_the_record():
    files = record.gpu_test_files()
    assert "tests/gpu/test_multi_gpu.py" in files and "tests/unit/test_grpo_gpu.py" in files
    listed = json.loads(record.RUNS.read_text())["files"]
    assert set(files) <= set(listed), sorted(set(files) - set(listed))
    readme = record.README.read_text()
    assert all(f"`{f}`" in readme for f in files)


def test_a_report_updates_passes_and_keeps_them_through_failures(tmp_path):
    def junit(name, body):
        path = tmp_path / name
        path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
        return str(path)

    ok = junit(
        "a.xml",
        '<testcase classname="tests.gpu.test_multi_gpu" name="t1" file="tests/gpu/test_multi_gpu.py"/>'
        '<testcase classname="tests.gpu.test_multi_gpu" name="t2" file="tests/gpu/test_multi_gpu.py">'
        '<skipped message="needs 4"/></testcase>',
    )
    # xunit2 (pytest's default) writes no file: the classname gives it; a nameless case (an interrupted run) is left out
    bad = junit(
        "b.xml",
        '<testcase classname="tests.gpu.test_multi_gpu" name="t1"><failure message="boom"/></testcase>'
        '<testcase classname="" name=""/>',
    )
    first = record.update(
        {}, record.outcomes([ok]), {"commit": "aaa", "device": "2x H100", "date": "2026-11-28"}
    )
    entry = first["files"]["tests/gpu/test_multi_gpu.py"]
    assert entry["last_pass"] == {
        "commit": "aaa",
        "device": "2x H100",
        "date": "2026-11-28",
        "passed": 1,
        "skipped": 1,
    }
    second = record.update(
        first, record.outcomes([bad]), {"commit": "bbb", "device": "2x H100", "date": "2026-11-29"}
    )
    entry = second["files"]["tests/gpu/test_multi_gpu.py"]
    assert entry["last_pass"]["commit"] == "aaa" and entry["last_run"]["failed"] == 1
    assert (
        "1 failed: bbb" in record.table(second) and "" not in second["files"] and ".py" not in second["files"]
    )
    assert set(record.gpu_test_files()) <= set(second["files"])  # files never run are listed too


def test_a_file_cut_short_keeps_what_finished_and_names_the_running_test():
    from tests.gpu.run_each import cut_short

    text = (
        "tests/gpu/test_x.py::test_a PASSED                    [ 33%]\n"
        "tests/gpu/test_x.py::test_b[2] SKIPPED (needs 4 GPUs)  [ 66%]\n"
        "tests/gpu/test_x.py::test_c "
    )
    suite = cut_short("tests/gpu/test_x.py", 90, text)
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == ["test_a", "test_b[2]", "time_limit[test_c]"]
    assert cases["test_a"].find("failure") is None and cases["test_b[2]"].find("skipped") is not None
    assert cases["time_limit[test_c]"].find("failure") is not None and suite.get("failures") == "1"


def test_run_each_refuses_what_is_not_a_test_file(monkeypatch, capsys):
    """pytest options after ``--`` would arrive as file names and run a pytest over the whole tree (a device call
    lost that way): refused in one line, exit 2."""
    import sys

    from tests.gpu import run_each

    monkeypatch.setattr(sys, "argv", ["run_each", "out.xml", "tests/gpu/test_health_gpu.py", "--", "-v"])
    with pytest.raises(SystemExit) as err:
        run_each.main()
    assert err.value.code == 2 and "FILE '-v'" in capsys.readouterr().err
