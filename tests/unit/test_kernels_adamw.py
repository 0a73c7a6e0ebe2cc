"""loom's AdamW step (``loom::adamw_step_``, ``TritonAdamW``, ``optimizer.implementation = triton``):
the reference is torch.optim.AdamW's math, the op passes opcheck, the optimizer steps, folds the gradient
factor and saves/loads state exactly as torch's AdamW does, and the Triton kernel agrees with the
reference under Triton's CPU interpreter (AdamW is fp32: the interpreter's trusted case)."""

from __future__ import annotations

import copy
import importlib.util
import textwrap

import pytest
import torch
from torch import nn

from loom.config.sections import OptimizerConfig
from loom.kernels.adamw import reference
from loom.kernels.adamw.op import adamw_step_
from loom.train.optimizer import OptimizerParts, TritonAdamW, resolve_implementation
from tests.unit.test_kernels_fused import interpret, triton_skip_reason

HYPER = dict(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_reference_is_torch_adamw(grad_dtype):
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(7, 5, generator=gen)
    want = nn.Parameter(p.clone())
    opt = torch.optim.AdamW([want], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    have, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 5):
        g = torch.randn(7, 5, generator=gen).to(grad_dtype)
        want.grad = g.float()
        opt.step()
        reference.adamw_step_(have, g, m, v, None, step=step, **HYPER)
        torch.testing.assert_close(have, want.detach(), rtol=0, atol=0)  # same ops, same order
    torch.testing.assert_close(m, opt.state[want]["exp_avg"], rtol=0, atol=0)


def test_grad_factor_scales_the_gradient():
    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(10, generator=gen), torch.randn(10, generator=gen)
    a = [p.clone(), torch.zeros(10), torch.zeros(10)]
    b = [p.clone(), torch.zeros(10), torch.zeros(10)]
    reference.adamw_step_(a[0], g, a[1], a[2], torch.tensor([0.25]), step=1, **HYPER)
    reference.adamw_step_(b[0], g * 0.25, b[1], b[2], None, step=1, **HYPER)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_factor_that_is_not_finite_skips_the_step(bad):
    gen = torch.Generator().manual_seed(1)
    p, m, v = (
        torch.randn(6, 4, generator=gen),
        torch.randn(6, 4, generator=gen),
        torch.rand(6, 4, generator=gen),
    )
    before = [p.clone(), m.clone(), v.clone()]
    g = torch.full((6, 4), float("nan"))
    adamw_step_(p, g, m, v, step=2, grad_factor=torch.tensor([bad]), **HYPER)
    for a, b in zip((p, m, v), before):
        assert torch.equal(a, b)


def test_opcheck():
    from torch.library import opcheck

    p, g = torch.randn(4, 3), torch.randn(4, 3)
    opcheck(
        torch.ops.loom.adamw_step_,
        (p, g, torch.zeros(4, 3), torch.rand(4, 3), torch.tensor([0.5]), 0.01, 0.9, 0.95, 1e-8, 0.1, 3, None),
    )
    opcheck(
        torch.ops.loom.adamw_step_,
        (p, g, torch.zeros(4, 3), torch.rand(4, 3), None, 0.01, 0.9, 0.95, 1e-8, 0.0, 1, None),
    )
    opcheck(
        torch.ops.loom.adamw_step_,
        (p, g, torch.zeros(4, 3), torch.rand(4, 3), None, 0.01, 0.9, 0.95, 1e-8, 0.0, 2, torch.zeros(1)),
    )


def test_public_function_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="one shape"):
        adamw_step_(torch.zeros(3), torch.zeros(4), torch.zeros(3), torch.zeros(3), step=1, **HYPER)


def _parts(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5)), nn.Linear(5, 3, bias=False)]


def _train(impl: str, factors, parts=None, opt=None):
    parts = parts or _parts()
    opt = opt or OptimizerParts(parts, OptimizerConfig(lr=0.05, implementation=impl), torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for factor in factors:
        x = torch.randn(4, 6, generator=gen)
        parts[1](parts[0](x)).square().sum().backward()
        opt.step(factor)
        opt.zero_grad()
    return parts, opt


@pytest.mark.parametrize(
    "factors", [[None, None], [0.5, torch.tensor(0.25)], [torch.tensor(1e-3), 1.0, None]]
)
def test_triton_adamw_optimizer_on_its_cpu_reference_matches_torch_adamw(factors):
    """The optimizer class behind optimizer.implementation = triton (gradient factor folded in), on the CPU where
    its op runs the PyTorch reference; the Triton kernel itself: test_triton_kernel_under_the_interpreter."""
    parts, opt = _train("triton", factors)
    assert opt.fold_grad_factor and all(isinstance(o, TritonAdamW) for o in opt.optimizers)
    ref_parts, _ = _train("foreach", factors)
    for a, b in zip(
        (p for part in parts for p in part.parameters()), (p for part in ref_parts for p in part.parameters())
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_state_dict_is_torch_adamws_both_ways():
    """A run saved by one implementation resumes under the other, step for step."""
    for first, second in (("triton", "foreach"), ("fused", "triton")):
        parts, opt = _train(first, [None, 0.5])
        states = [copy.deepcopy(o.state_dict()) for o in opt.optimizers]  # (shares tensors otherwise)
        resumed_parts = [part for part in _parts()]
        for mine, theirs in zip(resumed_parts, parts):
            mine.load_state_dict(theirs.state_dict())
        resumed = OptimizerParts(
            resumed_parts, OptimizerConfig(lr=0.05, implementation=second), torch.device("cpu")
        )
        for o, s in zip(resumed.optimizers, states):
            o.load_state_dict(s)
        _train(second, [0.25, None], resumed_parts, resumed)
        _train(first, [0.25, None], parts, opt)  # the uninterrupted run
        for a, b in zip(
            (p for part in parts for p in part.parameters()),
            (p for part in resumed_parts for p in part.parameters()),
        ):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for o in resumed.optimizers:
            assert all(s["step"].item() == 4 for s in o.state.values())


def test_auto_resolution():
    assert resolve_implementation("auto", torch.device("cpu")) == "foreach"
    assert resolve_implementation("fused", torch.device("cpu")) == "fused"
    assert resolve_implementation("auto", torch.device("cuda")) in ("triton", "fused")


INTERPRETER_SCRIPT = textwrap.dedent("""
    import torch
    from loom.kernels.adamw import reference as ref, triton as tk
    from loom.kernels.adamw.op import adamw_step_
    torch.manual_seed(0)
    hyper = dict(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for shape in [(3, 5, 48), (5000,), (1,), (7, 1030)]:
        for factor in (None, torch.tensor([0.3])):
            p = torch.randn(shape)
            m, v = torch.randn(shape) * 0.1, torch.rand(shape) * 0.01
            want = [p.clone(), m.clone(), v.clone()]
            have = [p.clone(), m.clone(), v.clone()]
            for step in (1, 2, 7):
                g = torch.randn(shape)
                ref.adamw_step_(want[0], g, want[1], want[2], factor, step=step, **hyper)
                adamw_step_(*have[:1], g, *have[1:], step=step, grad_factor=factor, **hyper)
            for a, b in zip(have, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for bad in (float("nan"), float("inf")):  # a factor that is not finite skips the step: nothing stored
        p, m, v = torch.randn(5000), torch.randn(5000), torch.rand(5000)
        before = [p.clone(), m.clone(), v.clone()]
        g = torch.randn(5000)
        g[3] = float("nan")
        amax = torch.zeros(1)
        adamw_step_(p, g, m, v, step=3, grad_factor=torch.tensor([bad]), amax=amax, **hyper)
        for a, b in zip((p, m, v), before):
            assert torch.equal(a, b)
        assert torch.equal(amax, p.abs().max().reshape(1))  # the unchanged parameter's
    # the amax of the parameter after the step, written in the same pass, raised (not set) across calls
    for shape in [(5000,), (7, 1030), (3,)]:
        p, m, v, g = torch.randn(shape), torch.zeros(shape), torch.zeros(shape), torch.randn(shape)
        want, amax = p.clone(), torch.full((1,), 0.5)
        ref.adamw_step_(want, g, m.clone(), v.clone(), None, step=1, **hyper)
        adamw_step_(p, g, m, v, step=1, amax=amax, **hyper)
        torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(amax, torch.maximum(p.abs().max(), torch.tensor(0.5)).reshape(1))
    def raises(*args, **kw):
        try:
            tk.adamw_step(*args, **kw)
        except ValueError:
            return
        raise AssertionError("no ValueError")
    x = torch.zeros(4, 6)
    raises(x, x, x, x.t(), None, 0.1, 0.9, 0.95, 1e-8, 0.0, 1)  # not contiguous
    raises(x, x, x.double(), x, None, 0.1, 0.9, 0.95, 1e-8, 0.0, 1)  # fp64 moment
    raises(x, torch.zeros(4, 5), x, x, None, 0.1, 0.9, 0.95, 1e-8, 0.0, 1)  # grad shape
    raises(x, x, x, x, torch.zeros(2), 0.1, 0.9, 0.95, 1e-8, 0.0, 1)  # factor of two elements
    raises(x, x, x, x, None, 0.1, 0.9, 0.95, 1e-8, 0.0, 0)  # step 0
    raises(x, x, x, x, None, 0.1, 0.9, 0.95, 1e-8, 0.0, 1, torch.zeros(2))  # an amax of two elements
    # many tensors in one launch (the multi-tensor kernel): each as the reference steps it, bf16 gradients too
    from loom.kernels.adamw.op import adamw_multi_step_
    shapes = [(3, 5, 48), (5000,), (1,), (4096,), (7, 1030)]
    for g_dtype in (torch.float32, torch.bfloat16):
        for factor in (None, torch.tensor([0.3])):
            ps = [torch.randn(s) for s in shapes]
            ms, vs = [torch.randn(s) * 0.1 for s in shapes], [torch.rand(s) * 0.01 for s in shapes]
            want = [[t.clone() for t in ts] for ts in (ps, ms, vs)]
            for step in (1, 4):
                gs = [torch.randn(s).to(g_dtype) for s in shapes]
                for i in range(len(shapes)):
                    ref.adamw_step_(want[0][i], gs[i], want[1][i], want[2][i], factor, step=step, **hyper)
                adamw_multi_step_(ps, gs, ms, vs, step=step, grad_factor=factor, **hyper)
            for have, ref_ts in zip((ps, ms, vs), want):
                for a, b in zip(have, ref_ts):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ps = [torch.randn(s) for s in shapes]
    before = [p.clone() for p in ps]
    adamw_multi_step_(ps, [torch.randn(s) for s in shapes], [torch.zeros(s) for s in shapes],
                      [torch.zeros(s) for s in shapes], step=2, grad_factor=torch.tensor([float("nan")]), **hyper)
    assert all(torch.equal(a, b) for a, b in zip(ps, before))  # a factor that is not finite: nothing stored
    try:
        tk.adamw_multi_step([x], [x], [x, x], [x], None, 0.1, 0.9, 0.95, 1e-8, 0.0, 1)
        raise SystemExit("no ValueError for lists of different lengths")
    except ValueError:
        pass
    tk.adamw_multi_step([x, x], [x, x], [x, x], [x, x], None, 0.1, 0.9, 0.95, 1e-8, 0.0, 1)  # checked, remembered
    try:  # the same addresses, one of them now a transposed view: checked again
        tk.adamw_multi_step([x, x], [x, x.t()], [x, x], [x, x], None, 0.1, 0.9, 0.95, 1e-8, 0.0, 1)
        raise SystemExit("no ValueError for a gradient that is not contiguous")
    except ValueError as err:
        assert "grad 1" in str(err), err
    # the optimizer on a small model under the interpreter: its small tensors in one launch per step, torch's
    # AdamW's parameters after three steps with a folded clip factor
    from torch import nn
    from loom.config.sections import OptimizerConfig
    from loom.train.optimizer import OptimizerParts
    launches = []
    multi = tk.adamw_multi_step
    tk.adamw_multi_step = lambda *a: launches.append(len(a[0])) or multi(*a)
    runs = []
    for impl in ("triton", "foreach"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
        opt = OptimizerParts([model], OptimizerConfig(lr=0.05, implementation=impl), torch.device("cpu"))
        gen = torch.Generator().manual_seed(1)
        for factor in (None, 0.5, torch.tensor(0.25)):
            model(torch.randn(4, 6, generator=gen)).square().sum().backward()
            opt.step(factor)
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert launches == [2, 4] * 3, launches  # per step: the two decayed matrices, then the biases and norm weights
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    try:  # float8 all-gather's weight wrappers (no address of their own): the kernels step their storage
        from torchao.float8.float8_training_tensor import LinearMMConfig
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped
    except ImportError:
        Wrapped = None
    if Wrapped is not None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
        for lin in (model[0], model[2]):
            lin.weight = nn.Parameter(Wrapped(lin.weight.data, LinearMMConfig(), torch.float8_e4m3fn))
        opt = OptimizerParts([model], OptimizerConfig(lr=0.05, implementation="triton"), torch.device("cpu"))
        gen = torch.Generator().manual_seed(1)
        for factor in (None, 0.5, torch.tensor(0.25)):
            model(torch.randn(4, 6, generator=gen)).square().sum().backward()
            opt.step(factor)
            opt.zero_grad()
        assert isinstance(model[0].weight, Wrapped)
        for a, b in zip([p.detach() for p in model.parameters()], runs[1]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        print("ok wrapped")
    import sys
    assert "loom.kernels.adamw.triton" in sys.modules
    print("ok adamw")
""")


@pytest.mark.skipif(triton_skip_reason() is not None, reason=str(triton_skip_reason()))
def test_triton_kernel_under_the_interpreter():
    out = interpret(INTERPRETER_SCRIPT)
    assert "ok adamw" in out
    assert "ok wrapped" in out or importlib.util.find_spec("torchao") is None


def test_a_weight_wrapper_is_stepped_through_its_storage_and_refused_by_the_launcher():
    """torchao's float8 all-gather wraps each linear weight in a tensor subclass whose address is 0: the optimizer
    hands the kernels the storage inside it, and a launcher given the wrapper itself refuses it in one line (an
    H200 run wrote through address 0: an illegal memory access)."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from loom.kernels.triton_support import check_tensor
    from loom.parallel.shards import local_tensor as _local

    inner = torch.randn(4, 6)
    wrapped = WeightWithDynamicFloat8CastTensor(inner, LinearMMConfig(), torch.float8_e4m3fn)
    assert wrapped.data_ptr() == 0
    assert _local(wrapped) is inner
    assert _local(inner) is inner
    from torchao.dtypes.nf4tensor import to_nf4

    nf4 = to_nf4(torch.randn(128, 128, dtype=torch.bfloat16))  # a quantized subclass keeps its own layout
    assert _local(nf4) is nf4
    with pytest.raises(ValueError, match="param: a WeightWithDynamicFloat8CastTensor, a tensor subclass"):
        check_tensor("param", wrapped, dtypes=(torch.float32,))
    if importlib.util.find_spec("triton") is not None:  # the multi-tensor launcher checks every index
        from loom.kernels.adamw import triton as tk

        plain = [torch.zeros(4, 6) for _ in range(3)]
        with pytest.raises(ValueError, match="param 1: a WeightWithDynamicFloat8CastTensor"):
            tk._check_lists([inner, wrapped], plain[:2], plain[1:], plain[:2], None)


def test_the_step_writes_the_amax_of_tracked_parameters_once_until_they_change():
    """``track_amax``: each step writes the largest |value| of the tracked parameters after it (the reference's on
    the CPU; the kernel's: the interpreter test), taken once; an in-place change after the step (DiLoCo's outer
    step) or a step the host skipped leaves nothing to take."""
    parts = _parts()
    opt = OptimizerParts(parts, OptimizerConfig(lr=0.05, implementation="triton"), torch.device("cpu"))
    tracked = [parts[0][0].weight, parts[1].weight]  # one of them in each part's optimizer
    assert opt.track_amax(tracked) and opt.take_amax(tracked) is None  # no step yet
    _train("triton", [0.5], parts, opt)
    want = torch.stack([w.detach().abs().max() for w in tracked])
    assert torch.equal(opt.take_amax(tracked), want) and opt.take_amax(tracked) is None  # once
    _train("triton", [None], parts, opt)
    with torch.no_grad():
        parts[1].weight.mul_(2.0)
    assert opt.take_amax(tracked) is None
    foreach = OptimizerParts(
        _parts(), OptimizerConfig(lr=0.05, implementation="foreach"), torch.device("cpu")
    )
    assert not foreach.track_amax([foreach.parts[0][0].weight])


def test_a_skipped_step_writes_the_amax_of_the_unchanged_parameter():
    p = torch.randn(5, 3)
    amax = torch.zeros(1)
    adamw_step_(
        p,
        torch.randn(5, 3),
        torch.zeros(5, 3),
        torch.zeros(5, 3),
        step=1,
        grad_factor=torch.tensor([float("nan")]),
        amax=amax,
        **HYPER,
    )
    assert torch.equal(amax, p.abs().max().reshape(1))


def test_no_custom_op_mutates_an_argument_with_a_default():
    """torch 2.11 (the GPU image) bumps a mutated argument's version by its index among the arguments passed, so a
    defaulted one left out raises IndexError in its ADInplaceOrView kernel (8B float8 runs failed so at 776e50b)."""
    import pkgutil

    import loom.kernels

    for mod in pkgutil.iter_modules(loom.kernels.__path__):
        if mod.ispkg and importlib.util.find_spec(f"loom.kernels.{mod.name}.op"):
            importlib.import_module(f"loom.kernels.{mod.name}.op")
    checked = 0
    for name in dir(torch.ops.loom):
        packet = getattr(torch.ops.loom, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            for arg in getattr(packet, overload)._schema.arguments:
                if arg.alias_info is not None and arg.alias_info.is_write:
                    checked += 1
                    assert arg.default_value is None, f"loom::{name}: {arg.name} is mutated and has a default"
    assert checked >= 4
