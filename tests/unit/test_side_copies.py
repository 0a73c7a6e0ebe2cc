"""loom.parallel.side_copies (parallel.fsdp_side_copies): FSDP2's copy-out as contiguous copies puts every byte
where FSDP2's ``split_with_sizes_copy`` does; the switch sets and restores the functions FSDP2 calls and keeps the
gradient kernel grad_copy chose; the layout rule. (Training bit for bit as FSDP2's own: tests/distributed/
test_reduce_dtype.py; on two GPUs: tests/gpu/test_multi_gpu.py.)"""

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

from loom.config.errors import ConfigError
from loom.config.load import build_config
from loom.parallel import grad_copy, side_copies
from loom.resolve import resolve


@pytest.mark.parametrize("world,dtype", [(2, torch.bfloat16), (4, torch.float32), (2, torch.uint8)])
def test_copy_out_is_fsdp2s_split_with_sizes_copy(world, dtype):
    sizes = [6, 1, 10, 3]
    gathered = (torch.arange(world * sum(sizes)) % 251).to(dtype)
    want = [torch.zeros(world * n, dtype=dtype) for n in sizes]
    got = [torch.zeros(world * n, dtype=dtype) for n in sizes]
    torch.ops.fsdp.split_with_sizes_copy(
        gathered.view(world, -1), sizes, dim=1, out=[t.view(world, -1) for t in want]
    )
    side_copies.copy_out(gathered, sizes, got, world)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_switch_sets_and_restores_fsdp2s_functions_and_keeps_the_gradient_kernel():
    try:
        grad_copy.use_grad_copy("triton")
        side_copies.use_side_copies("both")
        assert param_group.foreach_all_gather is side_copies.gather_then_copy_out
        assert param_group.foreach_all_gather_copy_out is side_copies.copy_out_or_wait
        assert param_group.foreach_reduce is side_copies.reduce_on_its_stream
        assert collectives.foreach_reduce_scatter_copy_in is side_copies.copy_in_on_reduce_stream
        assert side_copies._inner_copy_in[0] is grad_copy.grad_copy_in
        side_copies.use_side_copies("gather")  # twice in one process: the kernel is not lost
        assert collectives.foreach_reduce_scatter_copy_in is grad_copy.grad_copy_in
        assert param_group.foreach_reduce is side_copies._TORCH_REDUCE
        side_copies.use_side_copies("reduce")
        assert param_group.foreach_all_gather is side_copies._TORCH_GATHER
        assert param_group.foreach_all_gather_copy_out is side_copies._TORCH_COPY_OUT
        # outside a reduction (no stream known) the copy-in is the chosen kernel's, on the caller's stream
        grads, out = [torch.ones(4, 2, dtype=torch.bfloat16)], torch.zeros(8)
        side_copies.copy_in_on_reduce_stream(grads, out, 2)
        assert torch.equal(out, torch.ones(8))
    finally:
        grad_copy.use_grad_copy("torch")
        side_copies.use_side_copies("none")
    assert collectives.foreach_reduce_scatter_copy_in is grad_copy._TORCH
    assert param_group.foreach_reduce is side_copies._TORCH_REDUCE


def test_refused_without_fsdp2():
    cfg = build_config(None, {"parallel.fsdp_side_copies": "both", "run.device": "cpu"})
    with pytest.raises(ConfigError, match="parallel.fsdp_side_copies = 'both': moves FSDP2's copies"):
        resolve(cfg, 1, device="cpu")
    resolve(cfg, 2, device="cpu")
