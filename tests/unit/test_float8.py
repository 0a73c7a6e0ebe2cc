"""Float8 linears through torchao (training.float8): which modules are converted, config errors, and a short
bf16 run whose loss curve stays close to the bf16 run without float8 (torchao emulates float8 matmuls on CPU)."""

from __future__ import annotations

import pytest
import torch

from loom.config import build_config
from loom.models.common.float8 import apply_float8, float8_available
from loom.models.llama import FLAVORS, Llama
from tests.unit.test_train_modes import max_rel, train

needs_torchao = pytest.mark.skipif(not float8_available(), reason="torchao not installed")


@needs_torchao
def test_block_linears_are_converted_and_the_head_is_not():
    from torchao.float8.float8_linear import Float8Linear

    model = Llama(FLAVORS["debug"].with_(vocab_size=256))
    n = apply_float8(model, "tensorwise")
    per_block = 7  # wq wk wv wo w1 w2 w3
    assert n == per_block * model.args.n_layers
    assert not isinstance(model.output, Float8Linear)
    assert isinstance(model.layers["0"].attention.wq, Float8Linear)
    assert [k for k, _ in model.named_parameters()] == [k for k, _ in Llama(model.args).named_parameters()]


@needs_torchao
def test_unknown_recipe_is_rejected():
    with pytest.raises(ValueError, match="allowed tensorwise, rowwise"):
        apply_float8(Llama(FLAVORS["debug"].with_(vocab_size=256)), "blockwise")


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_float8_loss_curve_stays_close_to_bf16(tmp_path, recipe):
    cache = str(tmp_path / "cache")
    _, base = train(tmp_path, cache, "bf16", **{"training.dtype": "bfloat16"})
    _, f8 = train(tmp_path, cache, recipe, **{"training.dtype": "bfloat16", "training.float8": recipe})
    assert max_rel([r["loss"] for r in f8], [r["loss"] for r in base]) < 0.02
    assert f8[-1]["loss"] < f8[0]["loss"]


def test_float8_config_errors():
    from loom.config.errors import ConfigError
    from loom.methods import check_config

    with pytest.raises(ConfigError, match="bfloat16"):
        check_config(build_config(None, {"training.float8": "tensorwise", "training.dtype": "float32"}))
    with pytest.raises(
        ConfigError, match="parallel.tp > 1: float8 under TP needs torchao.s float8 sharding plans"
    ):
        check_config(
            build_config(
                None, {"training.float8": "tensorwise", "training.dtype": "bfloat16", "parallel.tp": "2"}
            )
        )


@needs_torchao
def test_float8_all_gather_weights_compute_as_the_plain_float8_linears(tmp_path):
    """training.float8_all_gather's wrapped weights (what FSDP2 gathers in float8; gloo cannot gather float8, so the
    gather itself is checked on GPUs: tests/gpu/test_multi_gpu.py): without FSDP the same forward and gradients as
    the plain float8 linears, bit for bit; Hugging Face export writes plain tensors; a checkpoint of the plain model
    loads into the wrapped one."""
    import copy

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from loom.checkpoint.hf.export import hf_state_dict

    torch.manual_seed(0)
    plain = Llama(FLAVORS["debug"].with_(vocab_size=256))
    wrapped = copy.deepcopy(plain)
    assert apply_float8(plain, "tensorwise") == apply_float8(wrapped, "tensorwise", all_gather=True)
    assert isinstance(wrapped.layers["0"].attention.wq.weight, WeightWithDynamicFloat8CastTensor)
    assert not isinstance(wrapped.output.weight, WeightWithDynamicFloat8CastTensor)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_w = plain(tokens), wrapped(tokens)
    assert torch.equal(out, out_w)
    out.float().square().mean().backward()
    out_w.float().square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad), name

    exported = hf_state_dict(wrapped.state_dict(), wrapped.args)
    assert all(type(t) is torch.Tensor for t in exported.values())
    save_file(exported, str(tmp_path / "model.safetensors"))
    reference = hf_state_dict(plain.state_dict(), plain.args)
    assert all(
        torch.equal(t, reference[k]) for k, t in load_file(str(tmp_path / "model.safetensors")).items()
    )

    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    dcp.save(plain.state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    state = wrapped.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    for name, t in plain.state_dict().items():
        assert torch.equal(torch.as_tensor(state[name]).detach().clone(), t), name
    with pytest.raises(ValueError, match="tensorwise"):
        apply_float8(Llama(FLAVORS["debug"].with_(vocab_size=256)), "rowwise", all_gather=True)


def test_float8_all_gather_config_errors():
    from loom.config.errors import ConfigError
    from loom.methods import check_config
    from loom.resolve import resolve

    def cfg(**extra):
        return build_config(
            None, {"training.dtype": "bfloat16", "training.float8_all_gather": "true", **extra}
        )

    for extra, want in (
        ({}, "needs training.float8 tensorwise \\(got none\\)"),
        ({"training.float8": "rowwise"}, "got rowwise"),
        ({"training.float8": "tensorwise", "parallel.cpu_offload": "true"}, "cpu_offload"),
    ):
        with pytest.raises(ConfigError, match="training.float8_all_gather = True: .*" + want):
            check_config(cfg(**extra))
    one = cfg(**{"training.float8": "tensorwise"})
    check_config(one)
    with pytest.raises(ConfigError, match="shards none \\(dp_shard 1 x cp 1 on 1 ranks\\)"):
        resolve(one, 1, device="cpu")
    resolve(one, 2, device="cpu")  # FSDP2 over 2 ranks


@needs_torchao
def test_local_tensor_of_a_float8_weight_does_not_read_its_scale():
    """loom.parallel.shards.local_tensor unwraps torchao's float8 weight without its ``__tensor_flatten__``, which
    tests the truth of the precomputed scale (a device sync per weight on CUDA, in every optimizer step): a
    two-element scale, whose truth raises, shows the scale is not read."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from loom.parallel.shards import local_tensor

    inner = torch.randn(32, 16)
    config = Float8Linear.from_float(torch.nn.Linear(16, 32), config=Float8LinearConfig()).linear_mm_config
    wrapped = WeightWithDynamicFloat8CastTensor(inner, config, torch.float8_e4m3fn, torch.ones(2))
    with pytest.raises(RuntimeError, match="ambiguous"):
        wrapped.__tensor_flatten__()  # torchao's own flatten reads it
    assert local_tensor(wrapped) is inner


def test_shard_casts_fall_back_to_eager_past_the_recompile_limit(monkeypatch):
    """The compiled cast of the float8 shards (cast_shards) compiles once per list of shapes; past the entries
    Dynamo keeps it casts eagerly, with the same result, instead of failing the run."""
    import torch._dynamo

    from loom.models.common import float8

    torch._dynamo.reset()
    monkeypatch.setattr(float8, "CAST_RECOMPILE_LIMIT", 1)
    tensors = [torch.randn(8, 4) * 100, torch.randn(16, 4)]
    scales = [torch.tensor(448.0) / t.abs().max() for t in tensors]
    # torch's config through its own patch (a monkeypatch's undo leaves the option missing for later tests)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (1, 2):  # the second list length is past the limit of one entry
            got = float8._casts(tensors[:n], scales[:n], torch.float8_e4m3fn, backend="eager")
            want = float8._scaled_casts(tensors[:n], scales[:n], torch.float8_e4m3fn)
            assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
    torch._dynamo.reset()


def test_shard_casts_raise_a_lower_recompile_limit_for_themselves_only(monkeypatch):
    """Where Dynamo's limit is below the casts' (no apply_compile raised it), the casts compile up to theirs and
    leave the global one as it was; where it is not below, they run without a config patch (~70 us a call)."""
    import contextlib

    import torch._dynamo

    from loom.models.common import float8

    compiles = []

    def counting(gm, example_inputs):
        compiles.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(float8, "CAST_RECOMPILE_LIMIT", 4)
    tensors = [torch.randn(8, 4) * 100, torch.randn(16, 4), torch.randn(4, 4)]
    scales = [torch.tensor(448.0) / t.abs().max() for t in tensors]
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (1, 2, 3):  # three list lengths: past a limit of 1, within the casts' 4
            got = float8._casts(tensors[:n], scales[:n], torch.float8_e4m3fn, backend=counting)
            want = float8._scaled_casts(tensors[:n], scales[:n], torch.float8_e4m3fn)
            assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
        assert len(compiles) == 3 and torch._dynamo.config.recompile_limit == 1
        assert not isinstance(float8._cast_recompile_limit(), contextlib.nullcontext)
    with torch._dynamo.config.patch(recompile_limit=8):
        assert isinstance(float8._cast_recompile_limit(), contextlib.nullcontext)
    torch._dynamo.reset()


@needs_torchao
def test_float8_gather_refuses_uneven_shards():
    """FSDP2 pads an uneven shard into a new tensor, which loses the float8 wrapper's precomputed scale on those
    ranks only: training.float8_all_gather needs every converted weight's rows divisible by the shards."""
    from loom.config.errors import ConfigError

    assert apply_float8(
        Llama(FLAVORS["debug"].with_(vocab_size=256)), "tensorwise", all_gather=True, shards=2
    )
    with pytest.raises(
        ConfigError, match=r"training.float8_all_gather = True: .*divisible by its 3 FSDP2 shards"
    ):
        apply_float8(Llama(FLAVORS["debug"].with_(vocab_size=256)), "tensorwise", all_gather=True, shards=3)
