"""The GPU run record: when each GPU test file last passed, on which commit and device.

``python -m tests.gpu.record JUNIT.xml [JUNIT.xml ...] --commit C --device "1x H100 80GB HBM3" --date YYYY-MM-DD``
reads pytest's JUnit reports of a GPU run (``pytest -m gpu --junitxml=...``) and updates ``tests/gpu/runs.json``
and the table in ``tests/gpu/README.md``: a file whose GPU tests all passed (none failed, at least one ran) gets
the run as its last pass; a file with a failure keeps its last pass and gets the failure noted. Files never run
stay listed with no pass (``gpu_test_files`` finds every file with a test marked ``gpu``).
"""

from __future__ import annotations

import argparse
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "gpu" / "runs.json"
README = ROOT / "tests" / "gpu" / "README.md"
BEGIN, END = "<!-- record: begin (written by python -m tests.gpu.record) -->", "<!-- record: end -->"


def gpu_test_files() -> list[str]:
    """Every test file with a test marked ``gpu`` (the marker on a test, a class or the module)."""
    marked = re.compile(r"pytest\.mark\.gpu\b")
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if marked.search(p.read_text())
    )


def test_file(case: ET.Element) -> str | None:
    """The test file of a JUnit test case: its ``file`` attribute (xunit1), else the longest prefix of its dotted
    ``classname`` that is a file here (``tests.gpu.test_x`` or ``tests.gpu.test_x.TestClass``); None for a case
    pytest wrote without a name (an interrupted run)."""
    if case.get("file"):
        return case.get("file")
    parts = (case.get("classname") or "").split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if (ROOT / path).is_file():
            return path
    return None


def outcomes(junit_paths: list[str]) -> dict[str, dict[str, int]]:
    """Per test file: counts of passed, failed (failures and errors) and skipped tests."""
    out: dict[str, dict[str, int]] = {}
    for path in junit_paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            file = test_file(case)
            if file is None or not case.get("name"):
                continue
            kind = (
                "failed"
                if case.find("failure") is not None or case.find("error") is not None
                else "skipped"
                if case.find("skipped") is not None
                else "passed"
            )
            counts = out.setdefault(file, {"passed": 0, "failed": 0, "skipped": 0})
            counts[kind] += 1
    return out


def update(record: dict, results: dict[str, dict[str, int]], run: dict) -> dict:
    """The record with this run's results folded in (see the module docstring)."""
    files = dict(record.get("files", {}))
    for file, counts in results.items():
        entry = dict(files.get(file, {}))
        entry["last_run"] = {**run, **counts}
        if counts["failed"] == 0 and counts["passed"] > 0:
            entry["last_pass"] = {**run, "passed": counts["passed"], "skipped": counts["skipped"]}
        files[file] = entry
    for file in gpu_test_files():
        files.setdefault(file, {})
    return {"files": dict(sorted(files.items()))}


def table(record: dict) -> str:
    rows = [
        "| file | last pass: commit, device, date (passed / skipped) | last run, if it failed |",
        "|---|---|---|",
    ]
    for file, entry in record["files"].items():
        p, r = entry.get("last_pass"), entry.get("last_run")
        passed = (
            f"{p['commit']}, {p['device']}, {p['date']} ({p['passed']} / {p['skipped']})"
            if p
            else "never recorded"
        )
        failed = (
            f"{r['failed']} failed: {r['commit']}, {r['device']}, {r['date']}" if r and r["failed"] else ""
        )
        rows.append(f"| `{file}` | {passed} | {failed} |")
    return "\n".join(rows)


def write(record: dict) -> None:
    RUNS.write_text(json.dumps(record, indent=1) + "\n")
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    README.write_text(f"{head}{BEGIN}\n{table(record)}\n{END}{rest.split(END, 1)[1]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.record", description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", nargs="+")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--date", required=True)
    args = parser.parse_args(argv)
    record = json.loads(RUNS.read_text()) if RUNS.exists() else {}
    run = {"commit": args.commit, "device": args.device, "date": args.date}
    write(update(record, outcomes(args.junit), run))


if __name__ == "__main__":
    main()
