"""Multi-head latent attention under loom's layouts: one block sharded by heads over 2 gloo ranks (compressions
replicated, the shared RoPE key's gradient summed over tp) against the unsharded block, outputs and every gradient;
then training of the ``debug_mla`` model: for a fixed seed and global batch, DDP x2, FSDP2 x2 and TP x2 give the
single-process loss at every step (fp32, within 1e-5 relative), and so does PP x2 (1F1B), with packed documents
too. Generation from the latent cache with the heads split over 2 ranks (the inference styles of the training plan)
gives the single process's logits at every step."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import losses, run_fn, run_jobs
from tests.tiny import tiny_overrides

STEPS, GLOBAL = 5, 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def block_parity(rank, world):
    """One MLA block, with and without a query compression, plain and per-document positions: (B, S/tp, E) in and
    out, outputs, input and parameter gradients against the unsharded block."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from loom.models.llama import FLAVORS
    from loom.models.llama.model import Block, model_rope_table
    from loom.parallel.tensor_parallel import block_plan

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name, q_lora in (("q_lora", 32), ("direct_q", 0)):
        args = FLAVORS["debug_mla"].with_(vocab_size=384, q_lora_rank=q_lora, rope_interleave=True)
        torch.manual_seed(0)
        block = Block(args)
        sharded = copy.deepcopy(block)
        parallelize_module(sharded, mesh, block_plan(mla=True, q_lora=bool(q_lora)))
        rope = model_rope_table(args, 32)
        x = torch.randn(2, 32, args.dim, requires_grad=True)
        dy = torch.randn(2, 32, args.dim)
        for positions in (None, torch.arange(32).remainder(11).expand(2, 32)):
            y = block(x, rope, positions)
            y.backward(dy)
            ref = {n: p.grad.clone() for n, p in block.named_parameters()}
            ref_dx = x.grad.clone()
            x.grad = None
            block.zero_grad()
            seq = slice(rank * 32 // world, (rank + 1) * 32 // world)
            xs = x.detach()[:, seq].clone().requires_grad_(True)
            ys = sharded(xs, rope, positions)  # (B, S/tp, E)
            ys.backward(dy[:, seq])
            errs = {"out": _rel(ys.detach(), y.detach()[:, seq]), "dx": _rel(xs.grad, ref_dx[:, seq])}
            for n, p in sharded.named_parameters():
                errs[n] = _rel(p.grad.full_tensor(), ref[n])
            sharded.zero_grad()
            out[f"{name} {'positions' if positions is not None else 'plain'}"] = errs
    return out


def test_sharded_block_matches_unsharded(tmp_path):
    res = run_fn(2, block_parity, str(tmp_path))
    assert len(res) == 4
    for case, errs in res.items():
        # output, input grad, the block's norms and MLP (5), the attention: wq_a, q_a_norm, wq_b or wq; wkv_a,
        # kv_a_norm, wkv_b, wo
        assert len(errs) == 2 + 5 + (7 if case.startswith("q_lora") else 5), errs
        bad = {k: v for k, v in errs.items() if not v < 1e-5}
        assert not bad, (case, bad)


def job(tmp, name, mb, documents=False, **parallel):
    return tiny_overrides(
        f"{tmp}/{name}",
        f"{tmp}/cache",
        **{
            "model.flavor": "debug_mla",
            "run.seed": 3,
            "training.steps": STEPS,
            "training.global_batch_size": GLOBAL,
            "training.micro_batch_size": mb,
            "optimizer.warmup_steps": 2,
            "optimizer.lr": 3e-3,
            "data.document_positions": "true" if documents else "false",
            **{f"parallel.{k}": v for k, v in parallel.items()},
        },
    )


LAYOUTS = {
    "ddp2": dict(dp_replicate=2, dp_shard=1),
    "fsdp2": dict(dp_shard=2),
    "tp2": dict(tp=2, dp_shard=1),
    "pp2": dict(pp=2, dp_shard=1),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    res = run_jobs(1, [job(tmp, "single", GLOBAL), job(tmp, "single-docs", GLOBAL, documents=True)], str(tmp))
    return {False: losses(res[0]), True: losses(res[1])}


@pytest.fixture(scope="module")
def layout_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w2")
    names, jobs = [], []
    for name, par in LAYOUTS.items():
        dp = 1 if name in ("tp2", "pp2") else 2
        for documents in (False, True):
            names.append((name, documents))
            jobs.append(
                job(tmp, f"{name}-{documents}", GLOBAL // dp // 2, documents, **par)
            )  # accumulation 2
    return dict(zip(names, run_jobs(2, jobs, str(tmp))))


def test_layouts_match_single_process(reference, layout_results):
    report = []
    for (name, documents), res in layout_results.items():
        got, want = losses(res), reference[documents]
        assert len(got) == len(want) == STEPS
        dev = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        report.append(f"{name} documents={documents}: max rel deviation {dev:.2e}")
        assert dev < 1e-5, "\n".join(report)
    assert reference[True] != reference[False]  # packed documents attend within each: other losses
    print("\n".join(report))


def tp_decode(rank, world):
    """The cached decode of debug_mla with wq_b, wkv_b and wo split by heads over ``world`` ranks (``loom.infer.tp``'s
    inference styles of ``block_plan_for``: replicated activations), against the unsharded model's full forward."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import loom.infer.mla_cache  # noqa: F401  (registers the latent cache)
    from loom.infer.engine import Engine
    from loom.infer.tp import inference_styles
    from loom.parallel.tensor_parallel import block_plan_for
    from tests.unit.test_mla_cache import model_of, reference, rows_of

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = model_of("q_lora")
    lengths, new = [3, 7], 5
    rows = rows_of(len(lengths), max(lengths) + new)
    refs = reference(model, [r[: n + new] for r, n in zip(rows, lengths)])
    sharded = copy.deepcopy(model)
    parallelize_module(
        sharded,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in sharded.layers.values():
        parallelize_module(block, mesh, inference_styles(block_plan_for(block)))
    heads = sharded.layers["0"].attention.wkv_b.weight.to_local().shape[0] // (16 + 16)
    engine = Engine(sharded, compile=False, cuda_graphs=False, group=mesh.get_group())
    logits, _, lens = engine.start([r[:n] for r, n in zip(rows, lengths)], reserve=new)
    errs = [float((logits[b] - refs[b][n - 1]).abs().max()) for b, n in enumerate(lengths)]
    pos = lens.clone()
    for i in range(new):
        out = engine.step(torch.tensor([[r[n + i]] for r, n in zip(rows, lengths)]), pos[:, None])[:, 0]
        errs += [float((out[b] - refs[b][n + i]).abs().max()) for b, n in enumerate(lengths)]
        pos += 1
    return {"heads": heads, "max_err": max(errs), "n": len(errs)}


def test_tensor_parallel_latent_decode_matches_one_process(tmp_path):
    res = run_fn(2, tp_decode, str(tmp_path))
    assert res["heads"] == 2 and res["n"] == 2 * 6  # this rank's 2 of 4 heads; prefill + 5 steps, 2 rows
    assert res["max_err"] < 1e-5, res
