"""ZeRO's model-state memory per GPU (loom.plan.memory.zero_model_state) against the paper's Figure 1: 7.5B
parameters, 64 GPUs, mixed-precision Adam (K = 12): 120 GB, 31.4 GB, 16.6 GB and 1.9 GB (GB = 1e9 bytes)."""

import pytest

from loom.plan.memory import zero_model_state


@pytest.mark.parametrize("stage,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_figure_1(stage, gb):
    assert round(zero_model_state(7.5e9, 64, stage) / 1e9, 1) == gb


def test_one_gpu_is_stage_0_and_k_counts():
    assert zero_model_state(1e9, 1, 3) == zero_model_state(1e9, 1, 0) == 16e9
    assert zero_model_state(1e9, 8, 0, k=16) == 20e9


def test_unknown_stage():
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        zero_model_state(1e9, 8, 4)
