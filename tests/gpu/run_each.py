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
    """One file's pytest run: its JUnit suite, or a suite with one failed case when it ran past ``limit``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", mark, path]
    cmd += [f"--junitxml={report}", "-o", "junit_family=xunit1"]
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=ROOT, timeout=limit, capture_output=True, text=True)
        print(
            f"{path}: rc {out.returncode} in {time.monotonic() - start:.0f} s: {out.stdout.strip().splitlines()[-1:]}"
        )
    except subprocess.TimeoutExpired:
        print(f"{path}: past its {limit:.0f} s limit")
        suite = ET.Element("testsuite", name=path, tests="1", failures="1")
        case = ET.SubElement(
            suite, "testcase", file=path, classname=path[:-3].replace("/", "."), name="time_limit"
        )
        ET.SubElement(case, "failure", message=f"past the {limit:.0f} s limit")
        return suite
    return ET.parse(report).getroot().find("testsuite") if report.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("files", nargs="*")
    parser.add_argument("-m", dest="mark", default="gpu and not multi_gpu")
    parser.add_argument("--limit", type=float, default=120.0)
    args = parser.parse_intermixed_args()
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
