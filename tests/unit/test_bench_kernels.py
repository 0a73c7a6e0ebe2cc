"""bench.kernels' occupancy against hand-computed cases on sm_90's limits (65,536 registers, 64 warps, 228 KiB of
shared memory and 32 blocks per SM; registers allocated per warp in units of 256, 1 KiB reserved per block)."""

from __future__ import annotations

import pytest

from bench.kernels import SMLimits, occupancy


@pytest.mark.parametrize(
    "n_regs, warps, shared, blocks, limiter",
    [
        (128, 4, 0, 4, "registers"),  # 4,096 registers a warp: 16 warps
        (255, 8, 0, 1, "registers"),  # 255 rounds to 256 a thread: 8 warps, one block of 8
        (64, 4, 100 * 1024, 2, "shared"),  # registers allow 8 blocks, 233,472 // 103,424 = 2
        (32, 1, 0, 32, "blocks"),  # 64 warps by registers and warps, 32 blocks at most
    ],
)
def test_occupancy_by_hand(n_regs, warps, shared, blocks, limiter):
    got = occupancy(n_regs, warps, shared)
    assert (got["blocks_per_sm"], got["limited_by"]) == (blocks, limiter)
    assert got["occupancy"] == blocks * warps / 64


def test_occupancy_rounds_registers_per_warp_and_reads_the_limits_given():
    # 36 registers a thread: 1,152 a warp, allocated as 1,280; 8 warps a block: 65,536 // 10,240 = 6 blocks (7
    # without the rounding)
    assert occupancy(36, 8, 0)["blocks_per_sm"] == 6
    # an SM with half the registers halves the register-bound blocks
    assert occupancy(128, 4, 0, SMLimits(regs=32768))["blocks_per_sm"] == 2
