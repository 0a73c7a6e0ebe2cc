"""Mixture of experts: routed output against a per-token loop, dropless (a token's output ignores the batch),
the balance loss and its gradient through the backward, FLOPs, and what MoE models reject."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F

from loom.config import ConfigError, build_config
from loom.models.common.moe import MoE, sequence_balance_loss, set_aux_scale


def _moe(aux=0.0, n=4, k=2, dim=16, hidden=24, seed=0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(dim, hidden, n, k, aux_loss=aux)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_output_is_the_weighted_sum_of_each_tokens_top_k_experts():
    m = _moe()
    x = torch.randn(2, 7, 16)  # (B, S, E)
    out = m(x)
    probs = (x @ m.router.gate.weight.T).softmax(-1)  # (B, S, n)
    want = torch.zeros_like(x)
    for b in range(2):
        for s in range(7):
            w, e = probs[b, s].topk(2)
            w = w / w.sum()
            for wi, ei in zip(w, e):
                h = F.silu(x[b, s] @ m.experts.w1[ei]) * (x[b, s] @ m.experts.w3[ei])
                want[b, s] += wi * (h @ m.experts.w2[ei])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_dropless_a_tokens_output_does_not_depend_on_the_batch():
    m = _moe(n=8, k=2)
    x = torch.randn(4, 9, 16)
    whole = m(x)
    for b in range(4):
        torch.testing.assert_close(m(x[b : b + 1]), whole[b : b + 1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m(x[:, :5]), whole[:, :5], rtol=1e-5, atol=1e-6)


def test_an_expert_no_token_picks_is_skipped():
    m = _moe(n=4, k=1)
    with torch.no_grad():
        m.router.gate.weight.zero_()
        m.router.gate.weight[2, 0] = 10.0  # every token with x[0] > 0 goes to expert 2, the rest to expert 0
    x = torch.randn(1, 6, 16).abs()
    out = m(x)
    h = F.silu(x[0] @ m.experts.w1[2]) * (x[0] @ m.experts.w3[2])
    torch.testing.assert_close(out[0], h @ m.experts.w2[2], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this PyTorch has no grouped GEMM")
def test_grouped_gemm_matches_the_loop_over_experts_in_bf16():
    from loom.models.common.moe import grouped_mm_supported

    x = torch.randn(3, 10, 16)
    runs = {}
    for grouped in (True, False):
        m = _moe(n=4, k=2)
        m.experts.grouped = grouped
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.float().square().sum().backward()
        runs[grouped] = (out.float(), {n: p.grad for n, p in m.named_parameters()})
    (a, ga), (b, gb) = runs[True], runs[False]
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    for name in ga:
        scale = gb[name].abs().max()
        assert (ga[name] - gb[name]).abs().max() <= 2e-2 * scale, name
    assert grouped_mm_supported(x, torch.bfloat16) and not grouped_mm_supported(x, torch.float32)


def test_balance_loss_is_one_per_sequence_when_balanced():
    bsz, seq, n, k = 3, 8, 4, 2
    probs = torch.full((bsz, seq, n), 1 / n)
    # each expert seq*k/n times
    experts = torch.arange(seq * k).remainder(n).view(1, seq, k).expand(bsz, seq, k)
    assert sequence_balance_loss(probs, experts, n).item() == pytest.approx(bsz)
    skewed = torch.zeros(bsz, seq, k, dtype=torch.long)  # everything to expert 0 (and its top-2 twin 0)
    skewed[..., 1] = 1
    probs_skewed = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(bsz, seq, n)
    assert sequence_balance_loss(probs_skewed, skewed, n).item() == pytest.approx(bsz * 2.0)


def test_balance_loss_gradient_enters_through_backward_only():
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    plain, balanced = _moe(aux=0.0), _moe(aux=0.5)
    set_aux_scale(balanced, 0.25)
    out_plain, out_bal = plain(x), balanced(x)
    torch.testing.assert_close(out_bal, out_plain)  # the forward (and so the logged loss) is unchanged
    out_bal.square().sum().backward()

    # explicit: the same loss plus 0.5 x 0.25 x the balance loss, differentiated by autograd
    ref = _moe(aux=0.0)
    out = ref(x)
    _, experts, probs = ref.router(x.reshape(-1, 16))
    aux = sequence_balance_loss(probs.view(2, 6, -1), experts.view(2, 6, -1), 4)
    (out.square().sum() + 0.5 * 0.25 * aux).backward()
    # the two sum the same terms in another order: near-zero entries of a gradient whose largest is ~100 differ by
    # fp32 rounding of that scale (an atol of 1e-7 failed 29 of 200 random inputs, the largest gap 1.5e-5 at 133)
    for (name, a), b in zip(balanced.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6 * b.grad.abs().max().item(), msg=name)
    # the aux term is not nothing
    assert ref.router.gate.weight.grad.sub(_grad_without_aux(x)).abs().max() > 1e-6


def test_the_parallel_extension_point_left_empty_changes_nothing():
    """``MoE.parallel`` is the block's one extension point: loom.parallel's object with no group filled in (no
    DTensors, no shards, no exchange) computes bit for bit what the default does, balance gradient included."""
    from loom.models.common.moe import LOCAL_EXPERTS
    from loom.parallel.expert_parallel import MoEParallel, moe_parallel

    x = torch.randn(2, 6, 16)
    runs = []
    for install in (False, True):
        m = _moe(aux=0.5)
        assert m.parallel is LOCAL_EXPERTS
        if install:
            assert isinstance(moe_parallel(m), MoEParallel) and isinstance(m.parallel, MoEParallel)
        out = m(x)
        out.square().sum().backward()
        runs.append((out, [p.grad for p in m.parameters()], m.balance_sum))
    (a, ga, ba), (b, gb, bb) = runs
    assert torch.equal(a, b) and torch.equal(ba, bb) and all(torch.equal(u, v) for u, v in zip(ga, gb))


@pytest.mark.parametrize("aux", [0.0, 0.5])
def test_checkpointed_blocks_give_the_gradients_and_the_logged_balance(aux):
    """Full and op-level activation checkpointing of a MoE block, balance loss on (aux 0.5) or only logged (aux 0):
    the recomputation saves what the forward saved (it does not log; with aux 0 the logged balance once made the
    forward save 3 tensors more, which checkpointing refused), and the gradients and the logged balance are the
    block's own."""
    from torch import nn

    from loom.parallel.activation_checkpoint import apply_activation_checkpointing

    x = torch.randn(2, 6, 16)
    runs = {}
    for mode in ("none", "full", "op"):
        layers = nn.ModuleDict({"0": _moe(aux=aux)})
        apply_activation_checkpointing(layers, mode, 1)
        layers["0"](x.clone().requires_grad_()).square().sum().backward()
        moe = next(m for m in layers.modules() if isinstance(m, MoE))
        runs[mode] = ([p.grad for p in moe.parameters()], moe.balance_sum)
    for mode in ("full", "op"):
        for got, want in zip(runs[mode][0], runs["none"][0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(runs[mode][1], runs["none"][1])


def _grad_without_aux(x):
    m = _moe(aux=0.0)
    m(x).square().sum().backward()
    return m.router.gate.weight.grad


def test_flops_count_the_router_and_top_k_experts():
    from loom.metrics.flops import matmul_params
    from loom.models.llama import FLAVORS

    dense = FLAVORS["debug"].with_(vocab_size=256)
    moe = FLAVORS["debug_moe"].with_(vocab_size=256)
    attn = matmul_params(dense) - dense.n_layers * 3 * dense.dim * dense.ffn_dim - dense.dim * 256
    expert = 3 * moe.dim * moe.expert_ffn_dim
    assert (
        matmul_params(moe)
        == attn + moe.n_layers * (moe.dim * moe.moe_experts + moe.moe_top_k * expert) + moe.dim * 256
    )


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"model.moe_experts": "4", "model.moe_top_k": "5"}, "model.moe_top_k"),
        (
            {"model.flavor": "debug_moe", "training.compile": "true", "training.dtype": "float32"},
            "training.compile",
        ),
    ],
)
def test_unsupported_moe_settings_name_the_field(overrides, field):
    from loom.data import build_tokenizer
    from loom.resolve import resolve_model_args

    cfg = build_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        resolve_model_args(cfg, build_tokenizer(cfg.data.tokenizer))
    assert err.value.field == field


def test_the_planner_models_moe_in_bf16_and_fp32():
    """fp32 MoE is planned too (its grouped GEMMs traced at bf16's shapes; tests/unit/test_plan.py checks the figures
    against a real fp32 forward)."""
    from loom.plan.hardware import GPUS
    from loom.plan.planner import estimate

    est = {
        dtype: estimate(
            build_config(None, {"model.flavor": "debug_moe", "training.dtype": dtype}), 1, GPUS["H100"]
        )
        for dtype in ("float32", "bfloat16")
    }
    for e in est.values():
        assert e.memory.total > 0 and e.tokens_per_s_per_gpu > 0
    # fp32 master weights either way; fp32 compute keeps activations twice as wide as bf16's
    assert est["float32"].memory.weights == est["bfloat16"].memory.weights
    assert est["float32"].memory.activations > est["bfloat16"].memory.activations


@pytest.mark.parametrize(
    "args, field",
    [
        (["--model.moe_top_k", "9"], "model.moe_top_k"),
        (
            ["--parallel.tp", "2", "--parallel.ep", "3", "--nproc-per-node", "4"],
            "parallel.ep",
        ),  # before workers start
    ],
)
def test_cli_errors_for_moe_are_one_line(tmp_path, args, field):
    from tests.unit.test_cli_train import loom_train

    proc = loom_train(tmp_path, "--model.flavor", "debug_moe", "--run.dir", str(tmp_path / "run"), *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides, world, field, says",
    [
        ({"parallel.ep": "2"}, 2, "parallel.ep", "mixture-of-experts"),  # a dense model
        (
            {"model.flavor": "debug_moe", "model.moe_experts": "6", "parallel.ep": "4"},
            4,
            "parallel.ep",
            "experts (6)",
        ),
        (
            {
                "model.flavor": "debug_moe",
                "parallel.ep": "4",
                "parallel.dp_shard": "2",
                "parallel.dp_replicate": "2",
            },
            4,
            "parallel.ep",
            "dp_shard x cp (2 x 1)",
        ),
        # under tp the ep ranks take in the tp ranks: ep = tp x a divisor of dp_shard x cp
        (
            {"model.flavor": "debug_moe", "parallel.tp": "2", "parallel.ep": "3"},
            4,
            "parallel.ep",
            "tp x a divisor",
        ),
        (
            {"model.flavor": "debug_moe", "parallel.tp": "2", "parallel.ep": "6", "model.moe_experts": "6"},
            4,
            "parallel.ep",
            "tp x a divisor of parallel.dp_shard x cp (2 x 1)",
        ),
    ],
)
def test_expert_parallel_degrees_are_checked(overrides, world, field, says):
    from loom.data import build_tokenizer
    from loom.parallel.dims import ParallelDims
    from loom.resolve import check_model, resolve_model_args

    cfg = build_config(None, overrides)
    with pytest.raises(ConfigError) as err:
        dims = ParallelDims.from_config(cfg.parallel, world)
        check_model(dims, resolve_model_args(cfg, build_tokenizer(cfg.data.tokenizer)), cfg.parallel)
    assert err.value.field == field and says in str(err.value)


def test_matmuls_checkpointing_is_refused_for_compiled_expert_parallel_blocks():
    """Under expert parallelism a compiled MoE block compiles inside its checkpoint (its exchange breaks the graph),
    where the policy sees compiled kernels and would keep no matmul: ``matmuls`` is refused there in one line, and
    allowed without compile or without expert parallelism."""
    from loom.data import build_tokenizer
    from loom.resolve import check_moe, resolve_model_args

    moe = {
        "model.flavor": "debug_moe",
        "training.dtype": "bfloat16",
        "training.activation_checkpointing": "matmuls",
    }

    def check(**over):
        cfg = build_config(None, {**moe, **over})
        check_moe(resolve_model_args(cfg, build_tokenizer(cfg.data.tokenizer)), cfg)

    with pytest.raises(ConfigError, match=re.escape("allowed none | op | full | every_k there")) as err:
        check(**{"training.compile": "true", "parallel.ep": "2"})
    assert err.value.field == "training.activation_checkpointing" and "\n" not in str(err.value)
    check(**{"training.compile": "true"})
    check(**{"parallel.ep": "2"})


def test_op_level_checkpointing_replays_the_expert_exchange(tmp_path):
    """Under expert parallelism (here over a group of one rank) op-level activation checkpointing saves the token
    all-to-alls: its recomputation in backward exchanges nothing again (forward: counts, dispatch, combine; backward:
    the two reverse exchanges) and reads the forward's split lists instead of waiting for the device again (full
    checkpointing, which exchanges again, waits again); the gradients are those of the block without
    checkpointing."""
    import torch.distributed as dist
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    from loom.parallel.activation_checkpoint import apply_activation_checkpointing
    from loom.parallel.expert_parallel import ExpertParallel, moe_parallel

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func == torch.ops._c10d_functional.all_to_all_single.default
            return func(*args, **(kwargs or {}))

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        x = torch.randn(2, 6, 16)
        grads, exchanges, waits = {}, {}, {}
        for mode in ("none", "op", "matmuls", "full"):
            layers = nn.ModuleDict({"0": _moe()})
            ep = moe_parallel(layers).ep = ExpertParallel(dist.group.WORLD, 1)
            apply_activation_checkpointing(layers, mode, 1)
            with Count() as count:
                layers["0"](x.clone().requires_grad_()).square().sum().backward()
            moe = next(m for m in layers.modules() if isinstance(m, MoE))
            grads[mode], exchanges[mode] = [p.grad for p in moe.parameters()], count.n
            waits[mode] = ep.host_waits
    finally:
        if own:
            dist.destroy_process_group()
    assert exchanges == {"none": 5, "op": 5, "matmuls": 5, "full": 8}
    assert waits == {"none": 1, "op": 1, "matmuls": 1, "full": 2}
    for mode in ("op", "matmuls", "full"):
        for got, want in zip(grads[mode], grads["none"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_padded_expert_exchange_reads_nothing_on_the_host(tmp_path, monkeypatch):
    """parallel.ep_exchange padded (here over a group of one rank, bf16 so the experts take the grouped GEMM)
    reads no value on the host, forward and backward: no ``.tolist()``, ``.item()`` or ``aten._local_scalar_dense``
    (counted), no host wait (``host_waits`` 0), where the uneven exchange reads its split sizes; it compiles as one
    graph (``fullgraph``, forward and backward), and its output and gradients, eager and compiled, are the uneven
    exchange's. That the padding is never read back is tested on two ranks (tests/distributed/test_moe_parallel.py)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from loom.parallel.expert_parallel import ExpertParallel, moe_parallel

    reads = []
    for name in ("tolist", "item"):
        method = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, m=method, n=name: reads.append(n) or m(t, *a))

    class Scalars(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func == torch.ops.aten._local_scalar_dense.default:
                reads.append("scalar")
            return func(*args, **(kwargs or {}))

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        x = torch.randn(2, 6, 16, dtype=torch.bfloat16)
        runs = {}
        for exchange in ("uneven", "padded", "padded-compiled"):
            moe = _moe().to(torch.bfloat16)
            ep = moe_parallel(moe).ep = ExpertParallel(dist.group.WORLD, 1, exchange.split("-")[0])
            compiled = exchange.endswith("compiled")
            run = torch.compile(moe, fullgraph=True, backend="aot_eager") if compiled else moe
            xi = x.clone().requires_grad_()
            reads.clear()
            with contextlib.nullcontext() if compiled else Scalars():
                out = run(xi)
                out.float().square().sum().backward()
            runs[exchange] = [out, xi.grad, *(p.grad for p in moe.parameters())], ep.host_waits, len(reads)
    finally:
        if own:
            dist.destroy_process_group()
    assert runs["uneven"][1:] == (1, 1) and runs["padded"][1:] == (0, 0), runs
    for name in ("padded", "padded-compiled"):
        for got, want in zip(runs[name][0], runs["uneven"][0]):
            torch.testing.assert_close(got, want)


def test_dispatch_and_permute_gather_their_gradients():
    """The token -> slot dispatch and the slots' permutation give plain indexing's values and gradients (fp64), their
    backward a gather, not autograd's scatter-add; under bf16 autocast the dispatch casts the T tokens before it
    copies them k times and hands back an fp32 gradient, each token's k slot gradients summed in fp32."""
    from loom.models.common.moe import dispatch, inverse_permutation, permute

    torch.manual_seed(0)
    t, e, k, n = 24, 8, 3, 5
    flat = torch.randn(t, e, dtype=torch.float64, requires_grad=True)
    order = torch.randint(0, n, (t, k)).flatten().argsort(stable=True)
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(t * k))
    g = torch.randn(t * k, e, dtype=torch.float64)

    def grad_of(fn, x):
        (y,) = torch.autograd.grad((fn(x) * g).sum(), x)
        return fn(x).detach(), y

    for ours, plain, x in (
        (lambda f: dispatch(f, order, inverse, k), lambda f: f[order // k], flat),
        (
            lambda s: permute(s, inverse, order),
            lambda s: torch.zeros_like(s).index_copy(0, order, s),
            g.clone(),
        ),
    ):
        x = x.detach().requires_grad_()
        (got, got_grad), (want, want_grad) = grad_of(ours, x), grad_of(plain, x)
        assert torch.equal(got, want)
        torch.testing.assert_close(got_grad, want_grad)
    x = flat.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        slots = dispatch(x, order, inverse, k)
    (grad,) = torch.autograd.grad(slots.float().sum(), x)
    assert slots.dtype == torch.bfloat16 and grad.dtype == torch.float32
    assert torch.equal(slots, x.detach().bfloat16()[order // k]) and torch.equal(grad, torch.full_like(x, k))
