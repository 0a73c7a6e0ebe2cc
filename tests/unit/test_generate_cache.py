"""The KV cache against the plain model: a row's logits at every position equal the full-sequence forward's (fp32,
< 1e-5) whether the position came from the prefill, a decode step or a multi-token extension, with rows of different
prompt lengths in one batch, for the attention variants loom has (GQA, sliding window, Qwen-style q/k/v biases with
q/k norms, a mixture of experts); the cache holds only the KV heads; a compiled step writes the cache in place."""

from __future__ import annotations

import pytest
import torch

from loom.infer.cache import KVCache
from loom.infer.engine import Engine
from loom.models.llama import Llama, LlamaArgs

BASE = dict(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=96,
    vocab_size=384,
    rope_theta=10000.0,
    max_seq_len=64,
)
VARIANTS = {
    "gqa": {},
    "mqa": {"n_kv_heads": 1},
    "window": {"sliding_window": 4},
    "qwen3": {"attention_bias": True, "qk_norm": True},
    "moe": {"moe_experts": 4, "moe_top_k": 2},
}


def model_of(variant: str, seed: int = 0) -> Llama:
    from loom.models.common.init import init_parameters

    torch.manual_seed(seed)
    model = Llama(LlamaArgs(**{**BASE, **VARIANTS[variant]})).eval()
    init_parameters(
        model, seed, model.param_std
    )  # every weight (an MoE's experts are allocated, not initialized)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):  # zero by default: give them something to get wrong
                p.normal_(0.0, 0.1)
    return model


def reference(model: Llama, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row alone through the plain model: logits (n, V) at every position."""
    with torch.no_grad():
        return [model(torch.tensor([r]))[0] for r in rows]


def _rows(lengths, total, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, BASE["vocab_size"], (total,), generator=g).tolist()[:total] for _ in lengths]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_decode_steps_equal_the_full_forward(variant):
    model = model_of(variant)
    lengths, new = [3, 9, 6], 7
    rows = _rows(lengths, max(lengths) + new)
    refs = reference(model, [r[: n + new] for r, n in zip(rows, lengths)])
    engine = Engine(model, compile=False, cuda_graphs=False)
    logits, _, lens = engine.start([r[:n] for r, n in zip(rows, lengths)], reserve=new)
    assert all(c.k.shape[1] == model.args.n_kv_heads for c in engine.caches)  # KV heads only
    for b, n in enumerate(lengths):
        assert (logits[b] - refs[b][n - 1]).abs().max() < 1e-5
    pos = lens.clone()
    for i in range(new):
        tokens = torch.tensor([[r[n + i]] for r, n in zip(rows, lengths)])
        out = engine.step(tokens, pos[:, None])[:, 0]  # (B, V)
        for b, n in enumerate(lengths):
            assert (out[b] - refs[b][n + i]).abs().max() < 1e-5, (variant, i, b)
        pos += 1


def test_decode_under_autocast_with_float32_weights():
    """Rollouts inside a training step run under the step's bf16 autocast while the weights (and so the cache) are
    float32: decode steps store the bf16 K/V and follow the full forward under the same autocast."""
    model = model_of("gqa")
    rows = _rows([5, 8], 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        refs = reference(model, rows)
        engine = Engine(model, compile=False, cuda_graphs=False)
        logits, _, lens = engine.start([r[:n] for r, n in zip(rows, [5, 8])], reserve=4)
        pos = lens.clone()
        for i in range(4):
            out = engine.step(torch.tensor([[r[n + i]] for r, n in zip(rows, [5, 8])]), pos[:, None])[:, 0]
            for b, n in enumerate([5, 8]):
                assert (out[b].float() - refs[b][n + i].float()).abs().max() < 0.1
            pos += 1


@pytest.mark.parametrize("variant", ["gqa", "window"])
def test_every_position_through_steps_and_extensions(variant):
    """One-token prompts, then the rest as steps of 1, 3 and 2 tokens: every position of every row compared."""
    model = model_of(variant)
    rows = _rows([1, 1], 13, seed=2)
    refs = reference(model, rows)
    engine = Engine(model, compile=False, cuda_graphs=False)
    logits, _, _ = engine.start([r[:1] for r in rows], reserve=12)
    for b in range(2):
        assert (logits[b] - refs[b][0]).abs().max() < 1e-5
    at = 1
    for width in (1, 3, 2, 3, 1, 2):
        tokens = torch.tensor([r[at : at + width] for r in rows])  # (B, S)
        positions = torch.arange(at, at + width).expand(2, width)
        out = engine.step(tokens, positions)  # (B, S, V)
        for b in range(2):
            assert (out[b] - refs[b][at : at + width]).abs().max() < 1e-5, (variant, at, b)
        at += width
    assert at == 13


def test_stale_slots_are_never_seen():
    """A rejected speculative tail (tokens written past a row's position, then written over by others) changes
    nothing: the cache attends only to slots at or before each query's position."""
    model = model_of("gqa")
    rows = _rows([4], 10, seed=3)
    ref = reference(model, rows)[0]
    engine = Engine(model, compile=False, cuda_graphs=False)
    engine.start([rows[0][:4]], reserve=6)
    junk = torch.randint(0, BASE["vocab_size"], (1, 4))
    engine.step(junk, torch.arange(4, 8)[None])  # a guess at positions 4..7, all wrong
    out = engine.step(torch.tensor([rows[0][4:6]]), torch.arange(4, 6)[None])  # the real tokens 4, 5
    assert (out[0] - ref[4:6]).abs().max() < 1e-5
    out = engine.step(torch.tensor([rows[0][6:7]]), torch.tensor([[6]]))  # slot 7 still holds junk: unseen
    assert (out[0, 0] - ref[6]).abs().max() < 1e-5


def test_caches_leave_the_model_as_it_was():
    model = model_of("gqa")
    tokens = torch.randint(0, BASE["vocab_size"], (2, 8))
    with torch.no_grad():
        before = model(tokens)
    keys = set(model.state_dict())
    engine = Engine(model, compile=False, cuda_graphs=False)
    engine.start([[1, 2, 3]], reserve=4)
    assert set(model.state_dict()) == keys  # caches are non-persistent buffers
    assert all(isinstance(b.attention.context, KVCache) for b in model.layers.values())
    engine.close()
    with torch.no_grad():
        assert torch.equal(model(tokens), before)
    assert not any(isinstance(b.attention.context, KVCache) for b in model.layers.values())


def test_a_parked_cache_leaves_the_model_and_comes_back_after_an_update():
    """park: the model attends as in training (no cache in it), the next generation that fits gets the same cache
    tensors back (no re-allocation: CUDA graphs captured on them stay valid) and follows an in-place weight update
    like a fresh engine; release frees them."""
    model = model_of("gqa")
    tokens = torch.randint(0, BASE["vocab_size"], (2, 8))
    engine = Engine(model, compile=False, cuda_graphs=False)
    engine.start([[1, 2, 3], [4, 5]], reserve=4)
    caches = list(engine.caches)
    engine.park()
    assert not any(isinstance(b.attention.context, KVCache) for b in model.layers.values())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # the update a training step makes in place
        plain = model(tokens)
    rows = [[7, 8, 9, 10], [11, 12]]
    refs = reference(model, rows)
    logits, _, _ = engine.start(rows, reserve=4)
    assert all(got is kept for got, kept in zip(engine.caches, caches, strict=True))
    assert all(isinstance(b.attention.context, KVCache) for b in model.layers.values())
    for b, row in enumerate(rows):
        assert (logits[b] - refs[b][len(row) - 1]).abs().max() < 1e-5
    engine.park()
    with torch.no_grad():
        assert torch.equal(model(tokens), plain)
    engine.start([[1]], reserve=2)  # another batch size: new caches
    assert not any(got is kept for got, kept in zip(engine.caches, caches, strict=True))
    engine.release()
    assert not engine.caches and not any(
        isinstance(b.attention.context, KVCache) for b in model.layers.values()
    )


def test_a_compiled_step_writes_the_cache_in_place():
    """Inductor's code for a compiled decode step allocates nothing of the cache's size: the new K/V go into the
    cache buffers (an in-place scatter on a buffer compiles into a copy of the whole cache and a copy back)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    engine = Engine(model_of("gqa"), compile=True, cuda_graphs=False)
    engine.allocate(1, 8)  # no prefill: only the step compiles
    shape = tuple(engine.caches[0].k.shape)  # (B, Hkv, L, D)
    with torch.no_grad():
        out, codes = run_and_get_code(engine.step, torch.tensor([[7]]), torch.tensor([[3]]))
    engine.close()
    step = [c for c in codes if "index_put" in c]
    assert step, "the step's code writes the cache with index_put"
    assert not any(f"empty_strided_cpu({shape}" in c for c in codes)
    torch._dynamo.reset()
