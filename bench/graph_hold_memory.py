"""What loom's split-backward graph hold costs in memory: the zbv schedule with both stages of a Llama on one
GPU (one process), peak memory per step with ``TimedStage``'s hold (each chunk's output ``grad_fn`` kept
from its input-gradient pass to its weight pass) and with the hold disabled. Plain PyTorch ops only, so
both variants run (the hold exists because torch 2.11 frees our custom ops' Python autograd nodes).

    python bench/graph_hold_memory.py --out bench/results/graph_hold_memory_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train_1b import environment  # noqa: E402


class _Discard(dict):
    """A ``held_graphs`` that keeps nothing: the hold disabled."""

    def __setitem__(self, key, value):
        pass


def run(hold: bool, args, device, steps: int, micro: int, seq: int) -> dict:
    from loom.models.common.init import init_parameters
    from loom.models.llama import Llama
    from loom.parallel.pipeline import BusyClock, PipelinePlan, build_schedule, build_stage

    torch.manual_seed(0)
    half = args.n_layers // 2
    layers = [list(range(half)), list(range(half, args.n_layers))]
    with torch.device(device):
        model = Llama(args)
    init_parameters(model, 0, model.param_std)  # the constructor leaves the weights uninitialized
    stages = [build_stage(model, layers[0], True, False), build_stage(model, layers[1], False, True)]
    del model
    plan = PipelinePlan("zbv", pp=1, per_rank=2, layers=layers, local=[0, 1])

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten()) / micro

    schedule = build_schedule(plan, stages, dist.group.WORLD, device, micro, loss_fn, BusyClock(device))
    if not hold:
        for stage in schedule._stages:
            stage.held_graphs = _Discard()
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab_size, (micro, seq), generator=gen).to(device)
        for st in stages:
            st.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        schedule.step(tokens, target=tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)
    grad_norm = torch.sqrt(sum(p.grad.float().square().sum() for st in stages for p in st.parameters()
                               if p.grad is not None)).item()
    return {"hold": hold, "peak_gib_per_step": peaks, "grad_norm_last_step": grad_norm}


def main() -> None:
    from loom.models.llama import FLAVORS

    p = argparse.ArgumentParser()
    p.add_argument("--flavor", default="125M")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=8, help="micro-batches (one sequence each) per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default=os.environ.get("LOOM_COMMIT", "unknown"))
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    args = FLAVORS[a.flavor].with_(vocab_size=a.vocab, max_seq_len=a.seq)
    try:
        rows = [run(hold, args, device, a.steps, a.micro, a.seq) for hold in (True, False)]
    finally:
        dist.destroy_process_group()
    for r in rows:
        print(r, flush=True)
    if cuda:
        extra = max(rows[0]["peak_gib_per_step"]) - max(rows[1]["peak_gib_per_step"])
        print(f"hold costs {extra:+.3f} GiB of peak memory", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": environment(a.commit, "python " + " ".join(sys.argv)), "flavor": a.flavor,
                       "seq": a.seq, "micro_batches": a.micro, "schedule": "zbv, 2 stages on one GPU",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
