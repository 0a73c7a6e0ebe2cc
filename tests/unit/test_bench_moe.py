"""bench.moe --phases on the CPU: every part of a small MoE layer is timed through its own forward and backward, the
host-read layer reads the counts, and the layer's gradients are those of the model's own MoE."""

from __future__ import annotations

import torch

from bench import moe as bench_moe
from loom.models.common.moe import LOCAL_EXPERTS, MoE


def test_phase_times_run_each_part_forward_and_backward():
    torch.manual_seed(0)
    layer = MoE(16, 24, 8, 2, shared=1)
    x = torch.randn(2, 6, 16, requires_grad=True)
    calls = []

    def timer(fn, grads):
        for t in grads:
            t.grad = None
        fn()
        calls.append([t.grad is not None for t in grads])
        return float(len(calls))

    times = bench_moe.phase_times(layer, x, timer=timer)
    assert list(times) == ["router", "experts", "permutation", "layer_host_read", "layer"]
    # each backward reached its leaves: the router's input; the experts; the permutation's input (its experts left
    # out); every parameter of the whole layer, with and without the host read
    assert (
        calls[0][0]
        and all(calls[1])
        and calls[2][0]
        and not all(calls[2])
        and all(calls[3])
        and all(calls[4])
    )
    assert layer.parallel is LOCAL_EXPERTS
    read = []
    host = bench_moe._HostRead()
    host.run(lambda rows, counts: read.append(counts.tolist()) or rows, x[0], torch.tensor([5, 7]))
    assert read == [[5, 7]]
