"""Model unit tests: tied embeddings survive meta materialization; init is layout-independent."""

from __future__ import annotations

import torch

from loom.models.common.init import canonical_name, materialize, param_seed
from loom.models.llama import FLAVORS, Llama


def build(tie: bool, seed: int = 0) -> Llama:
    args = FLAVORS["debug"].with_(vocab_size=384, tie_embeddings=tie, max_seq_len=64)
    with torch.device("meta"):
        model = Llama(args)
    materialize(model, torch.device("cpu"), seed, model.param_std, model.init_buffers)
    return model


def test_tied_embeddings_stay_one_parameter_after_materialize():
    tied, untied = build(True), build(False)
    assert tied.output.weight is tied.tok_embeddings.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 384 * 64
    tied(torch.randint(0, 384, (2, 8))).sum().backward()
    assert tied.output.weight.grad is tied.tok_embeddings.weight.grad


def test_init_depends_on_seed_and_name_only():
    a, b, c = build(False, 1), build(False, 1), build(False, 2)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if not n.endswith("norm.weight"):
            assert not torch.equal(pa, pc)


def test_canonical_name_strips_wrappers():
    assert canonical_name("module.layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight") == \
        "layers.0.attention.wq.weight"
    assert param_seed(0, "module.layers.0.attention.wq.weight") == param_seed(0, "layers.0.attention.wq.weight")


def test_residual_init_depth_scales_only_the_residual_projections():
    with torch.device("meta"):
        depth = Llama(FLAVORS["125M"].with_(vocab_size=384, residual_init="depth"))
        flat = Llama(FLAVORS["125M"].with_(vocab_size=384))
    scaled = 0.02 / (2 * 12) ** 0.5
    for name in ("layers.3.attention.wo.weight", "layers.3.feed_forward.w2.weight"):
        assert depth.param_std(name) == scaled and flat.param_std(name) == 0.02
    for name in ("layers.3.attention.wq.weight", "layers.3.feed_forward.w1.weight", "tok_embeddings.weight"):
        assert depth.param_std(name) == flat.param_std(name) == 0.02
    assert flat.param_std("layers.3.attention_norm.weight") is None


def test_residual_init_reaches_the_model_from_the_config():
    from loom.config import build_config
    from loom.data.tokenizers import ByteTokenizer
    from loom.resolve import resolve_model_args

    tok = ByteTokenizer()
    assert resolve_model_args(build_config(None, {}), tok).residual_init == "flat"
    assert resolve_model_args(build_config(None, {"model.residual_init": "depth"}), tok).residual_init == "depth"


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] = self.counts.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


def test_op_level_checkpointing_keeps_every_attention_forward():
    """Op-level recomputation saves the attention's output (loom's op as well as SDPA's): its forward runs once
    per block, not again in the backward. The planner assumes it (loom.plan.timing.recompute_share)."""
    from loom.parallel.activation_checkpoint import apply_activation_checkpointing

    for backend, op in (("flash", "loom.flash_attn.default"),
                        ("sdpa", "aten._scaled_dot_product_flash_attention_for_cpu.default")):
        args = FLAVORS["debug"].with_(vocab_size=384, max_seq_len=32, attention=backend)
        model = Llama(args)
        apply_activation_checkpointing(model.layers, "op", 1)
        counter = OpCounter()
        with counter:
            model(torch.randint(0, 384, (2, 32))).sum().backward()
        assert counter.counts.get(op) == args.n_layers, (backend, counter.counts.get(op))
        assert counter.counts.get("aten.mm.default", 0) > 0  # the counter sees the block's ops at all


def test_op_level_checkpointing_modes_keep_the_higher_order_op_rules():
    """loom's checkpointing modes (PyTorch's with profiler ops passed through) are subclasses; higher-order ops
    such as FlexAttention look their rule up by the mode's exact type, so each subclass must carry its base's
    rules (without them flex under op-level checkpointing raised 'no rule registered')."""
    from torch._ops import _higher_order_ops

    from loom.parallel.activation_checkpoint import _op_policy

    modes = _op_policy()()
    flex = torch.ops.higher_order.flex_attention
    for mode in modes:
        base = type(mode).__mro__[1]
        assert type(mode) is not base and type(mode) in flex.python_key_table
        for op in _higher_order_ops.values():
            if base in op.python_key_table:
                assert op.python_key_table[type(mode)] is op.python_key_table[base], op
