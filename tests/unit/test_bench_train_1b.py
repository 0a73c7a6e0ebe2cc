"""bench/train_1b.py's float8 loss-curve check (issue 54: >= 500 steps within a tolerance stated before the run)."""

from __future__ import annotations

from bench.train_1b import FLOAT8_CURVE_TOLERANCE, curve_gap


def test_curve_gap_windows_and_the_last_steps_against_the_tolerance():
    base = [
        4.0 - i / 200 for i in range(600)
    ]  # a falling curve; the other runs 1% above it, then 3% at the end
    other = [x * (1.01 if i < 500 else 1.03) for i, x in enumerate(base)]
    gap = curve_gap(base, other)
    assert gap["steps"] == 600 and len(gap["window_rel_diff"]) == 12
    assert abs(gap["window_rel_diff"][0] - 0.01) < 1e-12 and abs(gap["window_rel_diff"][-1] - 0.03) < 1e-12
    assert abs(gap["last_rel_diff"] - 0.03) < 1e-12 and gap["last_rel_diff"] > FLOAT8_CURVE_TOLERANCE
    assert not gap["within"]
    assert curve_gap(base, [x * 1.01 for x in base])["within"]
    assert not curve_gap(base[:499], base[:499])["within"]  # fewer than 500 steps never passes
