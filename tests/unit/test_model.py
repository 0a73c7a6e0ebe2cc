"""Model unit tests: tied embeddings survive meta materialization; init is layout-independent."""

from __future__ import annotations

import pytest
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
    assert (
        canonical_name("module.layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight")
        == "layers.0.attention.wq.weight"
    )
    assert param_seed(0, "module.layers.0.attention.wq.weight") == param_seed(
        0, "layers.0.attention.wq.weight"
    )


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


def test_a_wide_untied_head_starts_with_logits_of_std_one():
    """0.02 x sqrt(dim) is the initial logits' std under a 0.02 head (1.7 at DeepSeek-V3's 7168: an initial loss
    about 1.4 above ln V); past dim 2500 an untied head is drawn at dim**-0.5 (torchtitan's), below it at 0.02."""
    with torch.device("meta"):
        wide = Llama(FLAVORS["debug"].with_(vocab_size=384, dim=7168, n_heads=56, n_kv_heads=56, n_layers=1))
        narrow = Llama(FLAVORS["125M"].with_(vocab_size=384))
    assert wide.param_std("output.weight") == pytest.approx(7168**-0.5)
    assert wide.param_std("tok_embeddings.weight") == wide.param_std("layers.0.attention.wq.weight") == 0.02
    assert narrow.param_std("output.weight") == 0.02
    head = torch.nn.Linear(7168, 384, bias=False)
    materialize(
        head, torch.device("cpu"), 0, lambda name: wide.param_std("output." + name), lambda device: None
    )
    logits = head(torch.nn.functional.rms_norm(torch.randn(512, 7168), (7168,)))
    assert 0.9 < logits.std().item() < 1.1


def test_residual_init_reaches_the_model_from_the_config():
    from loom.config import build_config
    from loom.data.tokenizers import ByteTokenizer
    from loom.resolve import resolve_model_args

    tok = ByteTokenizer()
    assert resolve_model_args(build_config(None, {}), tok).residual_init == "flat"
    assert (
        resolve_model_args(build_config(None, {"model.residual_init": "depth"}), tok).residual_init == "depth"
    )


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

    for backend, op in (
        ("flash", "loom.flash_attn.default"),
        ("sdpa", "aten._scaled_dot_product_flash_attention_for_cpu.default"),
    ):
        args = FLAVORS["debug"].with_(vocab_size=384, max_seq_len=32, attention=backend)
        model = Llama(args)
        apply_activation_checkpointing(model.layers, "op", 1)
        counter = OpCounter()
        with counter:
            model(torch.randint(0, 384, (2, 32))).sum().backward()
        assert counter.counts.get(op) == args.n_layers, (backend, counter.counts.get(op))
        assert counter.counts.get("aten.mm.default", 0) > 0  # the counter sees the block's ops at all


def test_matmuls_checkpointing_reruns_no_matmul_and_gives_the_same_gradients():
    """``matmuls`` keeps every matmul's output: plain (mm), with a bias (addmm), an MoE block's grouped GEMMs, fused
    LoRA's frozen bases with their adapters (one loom::lora_linear). Its forward + backward runs as many of them
    as without checkpointing, where ``op`` reruns some; the gradients are the same, bitwise. The planner assumes
    it (loom.plan.timing.recompute_share)."""
    from loom.config.sections import LoraConfig
    from loom.models.common.lora import apply_lora
    from loom.parallel.activation_checkpoint import apply_activation_checkpointing

    ops = ("aten.mm.default", "aten.addmm.default", "aten._grouped_mm.default", "loom.lora_linear.default")

    def run(case: str, mode: str):
        flavor = "debug_moe" if case == "moe" else "debug"
        with torch.device("meta"):
            model = Llama(
                FLAVORS[flavor].with_(
                    vocab_size=384, max_seq_len=32, attention="sdpa", attention_bias=case == "bias"
                )
            )
        materialize(model, torch.device("cpu"), 0, model.param_std, model.init_buffers)
        if case == "lora":
            torch.manual_seed(0)
            apply_lora(model, LoraConfig(rank=4, targets="all"))
            for name, p in model.named_parameters():
                if "lora_B" in name:  # nonzero, so the adapters' products reach the loss
                    torch.nn.init.normal_(p, std=0.02)
        model = model.to(torch.bfloat16 if case == "moe" else torch.float32)
        apply_activation_checkpointing(model.layers, mode, 1)
        tokens = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(1))
        counter = OpCounter()
        with counter:
            model(tokens, labels=tokens).backward()
        return {op: counter.counts.get(op, 0) for op in ops}, [p.grad for p in model.parameters()]

    for case, op in (("plain", ops[0]), ("bias", ops[1]), ("moe", ops[2]), ("lora", ops[3])):
        plain, grads = run(case, "none")
        kept, kept_grads = run(case, "matmuls")
        assert plain[op] > 0, (case, plain)  # the case runs the op it is here for
        assert kept == plain, (case, kept, plain)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(kept_grads, grads)), case
        half, _ = run(case, "op")
        assert sum(half.values()) > sum(plain.values()), (case, half, plain)


def test_compiled_op_level_modes_do_not_share_graphs_in_one_process():
    """Blocks of one code compiled under ``matmuls``, then ``op``, then ``matmuls`` again in one process each keep
    what their own mode says: Dynamo does not guard on a checkpoint's context function beyond its code, so one
    factory for both modes replayed the first mode's graph (here, and in a GPU test measuring both)."""
    from loom.parallel.activation_checkpoint import apply_activation_checkpointing
    from loom.parallel.compile import apply_compile

    def saved(mode: str) -> int:
        model = Llama(FLAVORS["debug"].with_(vocab_size=384, max_seq_len=32, n_layers=1, attention="sdpa"))
        apply_activation_checkpointing(model.layers, mode, 1)
        apply_compile(
            model.layers, backend="aot_eager_decomp_partition"
        )  # the min-cut partitioner, as inductor
        count = [0]

        def pack(t):
            count[0] += t.numel()
            return t

        h = model.tok_embeddings(torch.randint(0, 384, (2, 32)))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for block in model.layers.values():
                h = block(h, model.rope, None)
        h.sum().backward()
        return count[0]

    first, half, again = saved("matmuls"), saved("op"), saved("matmuls")
    assert first == again > half > 0, (first, half, again)


def test_pytorchs_compiled_policy_note_is_dropped_and_nothing_else():
    """PyTorch's one-line caution that a compiled checkpoint has a context function (loom's op-level policies) does
    not reach the run's output; the logger's other records do."""
    import logging

    import loom.parallel.activation_checkpoint  # noqa: F401  (installs the filter)

    log = logging.getLogger("torch._higher_order_ops.wrap")

    def passes(msg: str) -> bool:
        return log.filter(log.makeRecord(log.name, logging.WARNING, __file__, 0, msg, (), None))

    assert not passes("\nDetected that context_fn is passed to torch.utils.checkpoint under torch.compile.\n")
    assert passes("some other warning")


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


def test_family_switches_add_only_their_parameters_and_init_them_by_name():
    """q/k/v biases start at zero and q/k norms at one, by name like every other parameter; the switches' defaults
    add nothing (every flavor keeps its parameters)."""
    base = {n for n, _ in build(False).named_parameters()}
    args = FLAVORS["debug"].with_(
        vocab_size=384, max_seq_len=64, attention_bias=True, qk_norm=True, head_dim=24
    )
    models = []
    for _ in range(2):
        with torch.device("meta"):
            model = Llama(args)
        materialize(model, torch.device("cpu"), 0, model.param_std, model.init_buffers)
        models.append(model)
    params = dict(models[0].named_parameters())
    added = sorted(set(params) - base)
    assert added == sorted(
        f"layers.{i}.attention.{leaf}"
        for i in range(2)
        for leaf in ("wq.bias", "wk.bias", "wv.bias", "q_norm.weight", "k_norm.weight")
    )
    attn = models[0].layers["1"].attention
    assert attn.wq.bias.shape == (4 * 24,) and attn.wk.bias.shape == (2 * 24,) and attn.wo.bias is None
    assert not attn.wq.bias.any() and torch.equal(attn.k_norm.weight, torch.ones(24))
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), name
    models[0](torch.randint(0, 384, (2, 16))).sum().backward()
    assert attn.q_norm.weight.grad is not None and attn.wv.bias.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "seq,window,documents",
    [(300, 70, False), (300, 70, True), (512, 300, False), (512, 300, True), (64, 1, True)],
)
def test_sliding_window_is_the_same_mask_on_every_backend(seq, window, documents):
    """``attend`` with a window: SDPA (banded mask), loom's op and FlexAttention (forward: Flex has no CPU backward)
    all equal the reference mask, query i seeing keys i - window < j <= i of its own document."""
    from loom.kernels.attention.flex import flex_attend
    from loom.kernels.attention.reference import (
        doc_ids_from_positions,
        document_bounds,
        document_starts,
        visible,
    )
    from loom.models.common.layers import attend

    gen = torch.Generator().manual_seed(seq + window)
    q = torch.randn(2, 4, seq, 16, generator=gen)
    k, v = (torch.randn(2, 2, seq, 16, generator=gen) for _ in range(2))
    positions = None
    if documents:  # documents longer and shorter than the window
        lengths = [seq // 3, 3, window + 1]
        lengths.append(seq - sum(lengths))
        positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, seq)
    bounds = None if positions is None else document_bounds(doc_ids_from_positions(positions))
    mask = visible(seq, True, bounds, window, "cpu")  # (B or 1, 1, S, S)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    assert not (mask[0, 0] & ((j > i) | (j <= i - window))).any()  # transformers' convention
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for backend in ("sdpa", "flash"):
        torch.testing.assert_close(
            attend(q, k, v, backend, positions, window), expected, atol=2e-6, rtol=1e-5
        )
    starts = None if positions is None else document_starts(doc_ids_from_positions(positions))
    torch.testing.assert_close(flex_attend(q, k, v, starts, window), expected, atol=2e-6, rtol=1e-5)


def test_sdpa_compiles_fullgraph_when_the_head_counts_change():
    """A recompile over new head counts makes them symbolic; SDPA's enable_gqa must still get a plain bool (a
    SymBool fails fake-tensor tracing: seen on an H200 with model.attention = sdpa_flash)."""
    from loom.models.common.layers import attend

    fn = torch.compile(lambda q, k: attend(q, k, k, "sdpa", None), fullgraph=True)
    for hq, hkv in ((4, 4), (4, 2), (2, 1)):
        q, k = torch.randn(1, hq, 8, 4), torch.randn(1, hkv, 8, 4)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(fn(q, k), want)


def test_fsdp_units_of_their_own_for_an_untied_embedding_and_head():
    """The embedding and [norm, head] get FSDP2 units of their own (the head's gradients then reduce while the
    blocks' backward runs); tied embeddings, multi-token prediction and a pipeline stage without them keep them in
    the root."""
    from loom.parallel.data_parallel import head_units

    with torch.device("meta"):
        untied = Llama(FLAVORS["debug"].with_(vocab_size=384, tie_embeddings=False))
        tied = Llama(FLAVORS["debug"].with_(vocab_size=384, tie_embeddings=True))
    assert head_units(untied) == (untied.tok_embeddings, [untied.norm, untied.output])
    assert head_units(tied) == (None, [])
    untied.output = None  # a first pipeline stage
    assert head_units(untied) == (untied.tok_embeddings, [])
    untied.mtp = torch.nn.ModuleDict()  # multi-token prediction embeds again after the blocks
    assert head_units(untied) == (None, [])
