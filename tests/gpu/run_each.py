"""Run each GPU test file in its own pytest process under a time limit, and merge their JUnit reports into one.

``python -m tests.gpu.run_each OUT.xml [-m MARKEXPR] [--limit SECONDS] [FILE ...]``: a file that hangs or runs past
its limit is reported as one failed case (so ``tests.gpu.record`` notes it) instead of costing the whole device call.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.gpu.record import ROOT, gpu_test_files


def run_file(path: str, mark: str, limit: float, report: Path) -> ET.Element | None:
    """One file's pytest run: its JUnit suite; past ``limit``, a suite of the tests that finished (from pytest's
    verbose lines) and one failed case naming the test that was running."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", mark, path]
    cmd += [f"--junitxml={report}", "-o", "junit_family=xunit1"]
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=ROOT, timeout=limit, capture_output=True, text=True)
        print(
            f"{path}: rc {out.returncode} in {time.monotonic() - start:.0f} s: {out.stdout.strip().splitlines()[-1:]}"
        )
    except subprocess.TimeoutExpired as err:
        text = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
        return cut_short(path, limit, text)
    return ET.parse(report).getroot().find("testsuite") if report.exists() else None


def cut_short(path: str, limit: float, text: str) -> ET.Element:
    """The suite of a run stopped at ``limit``: each test its verbose output says finished, then the one running."""
    classname = path[:-3].replace("/", ".")
    suite = ET.Element("testsuite", name=path)
    running = "time_limit"
    for line in text.splitlines():
        nodeid, _, rest = line.partition(" ")
        if "::" not in nodeid:
            continue
        status = rest.split()[0] if rest.split() else ""
        name = nodeid.split("::", 1)[1]
        if status in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"):
            case = ET.SubElement(suite, "testcase", file=path, classname=classname, name=name)
            if status in ("FAILED", "ERROR"):
                ET.SubElement(case, "failure", message=status.lower())
            elif status in ("SKIPPED", "XFAIL"):
                ET.SubElement(case, "skipped", message=status.lower())
        else:
            running = f"time_limit[{name}]"
    case = ET.SubElement(suite, "testcase", file=path, classname=classname, name=running)
    ET.SubElement(case, "failure", message=f"past the {limit:.0f} s limit")
    print(f"{path}: past its {limit:.0f} s limit, in {running}")
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(sum(c.find("failure") is not None for c in cases)))
    return suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("files", nargs="*")
    parser.add_argument("-m", dest="mark", default="gpu and not multi_gpu")
    parser.add_argument("--limit", type=float, default=120.0)
    args = parser.parse_intermixed_args()
    for (
        path
    ) in args.files:  # pytest options after "--" would arrive here and run a pytest over the whole tree
        if not path.endswith(".py"):
            print(
                f"run_each: FILE {path!r}: allowed test files (*.py); pytest options are not passed through",
                file=sys.stderr,
            )
            sys.exit(2)
    merged = ET.Element("testsuites")
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(args.files or gpu_test_files()):
            suite = run_file(path, args.mark, args.limit, Path(tmp) / f"{i}.xml")
            if suite is not None:
                merged.append(suite)
            # written after every file, so a device call cut short keeps what finished
            ET.ElementTree(merged).write(args.out)


if __name__ == "__main__":
    main()
