"""Where FSDP2's sharded gradients live in the CUDA caching allocator: each stream's reserved and allocated bytes after a
step (16 fp32 linears of 4096 x 4096, bf16 compute, fp32 reduce-scatter). The planner's `reduce_scatter_pool`
(docs/planner.md) rests on it. `torchrun --standalone --nproc-per-node 2 bench/diag/fsdp_grad_pool.py` (CUDA, NCCL)."""

import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def main() -> None:
    if torch.cuda.device_count() < 2 or "RANK" not in os.environ:
        print(
            "bench/diag/fsdp_grad_pool.py: needs 2 CUDA devices, under torchrun --nproc-per-node 2",
            file=sys.stderr,
        )
        sys.exit(2)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    layers, d = 16, 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(layers)]).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model:
        fully_shard(m, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    x = torch.randn(8192, d, device="cuda")
    for step in range(2):
        model(x).float().pow(2).mean().backward()
        if step == 0:
            for p in model.parameters():
                p.grad = None
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    by_stream = defaultdict(lambda: [0, 0])
    for seg in snap["segments"]:
        if seg["device"] != rank:
            continue
        by_stream[seg["stream"]][0] += seg["total_size"]
        by_stream[seg["stream"]][1] += sum(
            b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"
        )
    grads = sum(p.grad.to_local().numel() * p.grad.to_local().element_size() for p in model.parameters())
    cur = torch.cuda.current_stream().cuda_stream
    if rank == 0:
        print(f"sharded fp32 grads {grads / 2**20:.0f} MiB; compute stream {cur}")
        for s, (tot, act) in sorted(by_stream.items(), key=lambda kv: -kv[1][0]):
            print(
                f"stream {s}{' (compute)' if s == cur else ''}: reserved {tot / 2**20:.0f} MiB, allocated {act / 2**20:.0f} MiB"
            )
        print(
            f"max reserved {torch.cuda.max_memory_reserved() / 2**20:.0f} MiB, max allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
