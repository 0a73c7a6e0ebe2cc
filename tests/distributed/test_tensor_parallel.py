"""Tensor + sequence parallel pieces on 2 gloo ranks against the unsharded module: one block's forward and
backward (outputs, input and parameter gradients), the whole model's logits and loss, and loss parallel
without a vocabulary-sized all-gather (PyTorch's comm-debug mode)."""

from __future__ import annotations

import torch

from tests.distributed.harness import run_fn

ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=384, rope_theta=10000.0)


def _args(**kw):
    from loom.models.llama.flavors import LlamaArgs

    return LlamaArgs(**{**ARGS, **kw})


def _tp_mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _sharded_copy(module, mesh, plan_fn):
    import copy

    from torch.distributed.tensor.parallel import parallelize_module

    shard = copy.deepcopy(module)
    parallelize_module(shard, mesh, plan_fn())
    return shard


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def block_parity(rank, world):
    """One block: (B, S/tp, E) sequence shard in, sequence shard out; grads equal the unsharded block's. Also a
    Qwen-style block (q/k/v biases and per-head q/k norms)."""
    out = {}
    for name, kw in (("llama", {}), ("qwen", {"attention_bias": True, "qk_norm": True})):
        for case, errs in _block_parity(rank, world, _args(**kw)).items():
            out[f"{name} {case}"] = errs
    return out


def _block_parity(rank, world, args):
    from loom.models.common.rope import rope_table
    from loom.models.llama.model import Block
    from loom.parallel.tensor_parallel import block_plan

    torch.manual_seed(0)
    block = Block(args)
    mesh = _tp_mesh(world)
    sharded = _sharded_copy(block, mesh, lambda: block_plan(qk_norm=args.qk_norm))
    rope = rope_table(args.head_dim, 32, args.rope_theta, None)
    x = torch.randn(2, 32, args.dim, requires_grad=True)
    dy = torch.randn(2, 32, args.dim)
    out = {}
    for positions in (None, torch.arange(32).remainder(11).expand(2, 32)):  # plain and per-document positions
        y = block(x, rope, positions)
        y.backward(dy)
        ref_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
        ref_dx = x.grad.clone()
        x.grad = None
        block.zero_grad()
        seq = slice(rank * 32 // world, (rank + 1) * 32 // world)
        xs = x.detach()[:, seq].clone().requires_grad_(True)
        ys = sharded(xs, rope, positions)  # (B, S/tp, E)
        ys.backward(dy[:, seq])
        errs = {"out": _rel(ys.detach(), y.detach()[:, seq]), "dx": _rel(xs.grad, ref_dx[:, seq])}
        for n, p in sharded.named_parameters():
            errs[n] = _rel(p.grad.full_tensor(), ref_grads[n])
        sharded.zero_grad()
        out["positions" if positions is not None else "plain"] = errs
    return out


def test_sharded_block_matches_unsharded(tmp_path):
    res = run_fn(2, block_parity, str(tmp_path))
    assert len(res) == 4
    for case, errs in res.items():
        # output, input grad and all nine parameters (+ three biases and two q/k norms in the Qwen-style block)
        assert len(errs) == 2 + (14 if case.startswith("qwen") else 9), errs
        bad = {k: v for k, v in errs.items() if not v < 1e-5}
        assert not bad, (case, bad)


def model_parity_and_comms(rank, world):
    """The whole model under TP (tied and untied): logits, loss and gradients vs unsharded; and which
    all-gathers loss parallel avoids."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.tensor.debug import CommDebugMode

    from loom.models.llama import Llama
    from loom.parallel.tensor_parallel import apply_tp, loss_parallel_context, to_local_loss

    class GatherShapes(CommDebugMode):
        """CommDebugMode that also keeps the element count of every all-gather's output."""

        def __init__(self):
            super().__init__()
            self.gathered = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented and "all_gather" in str(func):
                self.gathered.append(out.numel())
            return out

    mesh = _tp_mesh(world)
    tokens = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(2))
    out = {}
    for tied in (False, True):
        torch.manual_seed(0)
        model = Llama(_args(tie_embeddings=tied))
        ref_loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
        ref_loss.backward()
        for loss_parallel in (True, False):
            sharded = copy.deepcopy(model)
            sharded.zero_grad()
            apply_tp(sharded, mesh, loss_parallel=loss_parallel)
            comm = GatherShapes()
            with comm, loss_parallel_context(loss_parallel):
                logits = sharded(tokens)
                loss = to_local_loss(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
                loss.backward()
            grad_errs = [
                _rel(p.grad.full_tensor(), dict(model.named_parameters())[n].grad)
                for n, p in sharded.named_parameters()
            ]
            out[f"tied={tied} loss_parallel={loss_parallel}"] = {
                "loss_err": abs(float(loss.detach()) - float(ref_loss.detach())) / float(ref_loss.detach()),
                "max_grad_err": max(grad_errs),
                "n_grads": len(grad_errs),
                # anything holding a vocabulary shard per token (B x S x V/tp) or more; hidden states,
                # B x S x E, are far smaller
                "vocab_gathers": [n for n in comm.gathered if n >= tokens.numel() * 384 // world],
                "n_gathers": len(comm.gathered),
                "still_tied": sharded.output.weight is sharded.tok_embeddings.weight,
            }
    return out


def test_model_parity_and_loss_parallel_gathers_no_logits(tmp_path):
    res = run_fn(2, model_parity_and_comms, str(tmp_path))
    for case, r in res.items():
        assert r["loss_err"] < 1e-5 and r["max_grad_err"] < 1e-5, (case, r)
        assert r["still_tied"] == ("tied=True" in case), (case, r)
        if "loss_parallel=True" in case:
            assert r["vocab_gathers"] == [], (case, r)  # the (B, S, V) logits are never gathered
        else:
            assert r["vocab_gathers"], (case, r)  # the control: without loss parallel they are
