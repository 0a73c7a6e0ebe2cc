"""Repeated SIGKILLs of ``loom train`` (one process and 2 launched ranks, sync and async saves) at random
moments, inside saves, retention and data preparation: every resume picks the newest complete checkpoint of
the run's lineage and the run ends bitwise like an uninterrupted one (``tests/faults/driver.py`` says what
is checked after every kill).

The matrix is marked ``exhaustive`` (deselected by default: ``python -m pytest -q -s --exhaustive tests/faults``
runs it); the one-process test with three kills runs in CI. ``LOOM_FAULTS_SEED`` / ``LOOM_FAULTS_KILLS`` replay a
failure or widen a run; ``LOOM_FAULTS_REPORT=<file>`` appends each test's counts as a JSON line (``-s`` shows the
summary line and one line per attempt)."""

from __future__ import annotations

import pytest

from tests.faults.driver import FaultedRun, Variant, reference_run, settings

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# a kill in data preparation (a fresh cache), one inside a save, one inside retention
FAST = Variant("fast-1proc-sync", steps=10, kills=3, seed=1, plan=("prepare", "save", "retention"))
MATRIX = [
    Variant("1proc-sync", steps=40, kills=15, prepare_kills=2, seed=11),
    Variant("1proc-async", async_save=True, steps=40, kills=15, prepare_kills=2, seed=12),
    Variant("2proc-sync", nproc=2, steps=32, kills=10, seed=13),
    Variant("2proc-async", nproc=2, async_save=True, steps=32, kills=10, seed=14),
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """An uninterrupted run per (ranks, async saves, steps), made when first asked for, and its token cache."""
    cache = str(tmp_path_factory.mktemp("reference_cache"))
    made: dict = {}

    def get(v: Variant):
        key = (v.nproc, v.async_save, v.steps)
        if key not in made:
            made[key] = reference_run(str(tmp_path_factory.mktemp("reference") / "run"), cache, v)
        return made[key], cache

    return get


def faulted(v: Variant, tmp_path, references):
    seed, kills = settings(v.seed, v.kills)
    (records, timing, shards), ref_cache = references(v)
    cache = str(tmp_path / "cache") if v.prepare_kills or "prepare" in v.plan else ref_cache
    report = FaultedRun(v, seed, kills, str(tmp_path), cache, records, timing, shards, ref_cache).run()
    report.write()
    assert not report.problems, report.failure()
    return report


def test_three_kills_in_preparation_a_save_and_retention_resume_bitwise(tmp_path, references):
    report = faulted(FAST, tmp_path, references)
    assert report.kills == len(FAST.plan), report.failure()  # each planned kill landed
    assert report.resumes >= 1, report.failure()  # at least after the retention kill


@pytest.mark.exhaustive
@pytest.mark.parametrize("variant", MATRIX, ids=lambda v: v.name)
def test_random_kills_resume_bitwise(tmp_path, references, variant):
    report = faulted(variant, tmp_path, references)
    assert report.kills >= min(3, settings(variant.seed, variant.kills)[1]), report.failure()
