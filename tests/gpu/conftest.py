"""Fixtures the GPU test files share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def two_configs_per_kernel():
    """Autotuning every shape x dtype over all candidates compiles hundreds of kernels (minutes): these
    cases tune over two configs per kernel, with different block sizes so both the masked and unmasked
    block paths run at different splits. The other tests here use the full candidate lists."""
    from loom.kernels.attention import triton as T

    saved = T._FWD_CONFIGS, T._DKDV_CONFIGS, T._DQ_CONFIGS
    T._FWD_CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 4)]
    T._DKDV_CONFIGS = [(64, 128, 8, 3), (32, 64, 4, 4)]
    T._DQ_CONFIGS = [(128, 64, 8, 3), (64, 64, 4, 3)]
    T._TUNED.clear()
    yield
    T._FWD_CONFIGS, T._DKDV_CONFIGS, T._DQ_CONFIGS = saved
    T._TUNED.clear()
