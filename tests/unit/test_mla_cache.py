"""The latent cache of multi-head latent attention (loom.infer.mla_cache) against the plain model: a row's logits at
every position equal the full-sequence forward's (fp32, < 1e-5) whether the position came from the prefill, a decode
step with the absorbed projections or a multi-token extension, with rows of different prompt lengths in one batch;
the cache holds kv_lora_rank + qk_rope_head_dim elements per token and layer, measured on its buffers, next to a GQA
layer's K and V."""

from __future__ import annotations

import pytest
import torch

from loom.infer.cache import KVCache, make_cache
from loom.infer.engine import Engine
from loom.infer.mla_cache import LatentCache
from loom.models.common.mla import YarnScaling
from loom.models.llama import FLAVORS, Llama

VOCAB = 384
VARIANTS = {
    "q_lora": {},  # debug_mla: compressed queries, values 16 wide against queries / keys 32
    "direct_q-interleaved-yarn": {
        "q_lora_rank": 0,
        "rope_interleave": True,
        "rope_scaling": YarnScaling(factor=4.0, original_max_position=8, mscale=1.0, mscale_all_dim=0.8),
    },
}


def model_of(variant: str, seed: int = 0) -> Llama:
    """debug_mla with its weights widened from the 0.02 init, so that a wrong projection shows up far above the
    tolerance."""
    torch.manual_seed(seed)
    model = Llama(FLAVORS["debug_mla"].with_(vocab_size=VOCAB, max_seq_len=64, **VARIANTS[variant])).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5) if p.ndim == 1 else p.normal_(0.0, 0.1)
    return model


def reference(model: Llama, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row alone through the plain model: logits (n, V) at every position."""
    with torch.no_grad():
        return [model(torch.tensor([r]))[0] for r in rows]


def rows_of(n: int, total: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (total,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_decode_steps_equal_the_full_forward(variant):
    model = model_of(variant)
    lengths, new = [3, 9, 6], 7
    rows = rows_of(len(lengths), max(lengths) + new)
    refs = reference(model, [r[: n + new] for r, n in zip(rows, lengths)])
    assert max(r.abs().max() for r in refs) > 1.0
    engine = Engine(model, compile=False, cuda_graphs=False)
    logits, _, lens = engine.start([r[:n] for r, n in zip(rows, lengths)], reserve=new)
    assert all(isinstance(c, LatentCache) for c in engine.caches)
    for b, n in enumerate(lengths):
        assert (logits[b] - refs[b][n - 1]).abs().max() < 1e-5
    pos = lens.clone()
    for i in range(new):
        tokens = torch.tensor([[r[n + i]] for r, n in zip(rows, lengths)])
        out = engine.step(tokens, pos[:, None])[:, 0]  # (B, V)
        for b, n in enumerate(lengths):
            assert (out[b] - refs[b][n + i]).abs().max() < 1e-5, (variant, i, b)
        pos += 1


def test_every_position_through_steps_and_extensions():
    """One-token prompts, then the rest as extensions of 1, 3 and 2 tokens (a speculative verification's shape):
    every position of every row compared."""
    model = model_of("direct_q-interleaved-yarn")
    rows = rows_of(2, 13, seed=2)
    refs = reference(model, rows)
    engine = Engine(model, compile=False, cuda_graphs=False)
    logits, _, _ = engine.start([r[:1] for r in rows], reserve=12)
    for b in range(2):
        assert (logits[b] - refs[b][0]).abs().max() < 1e-5
    at = 1
    for width in (1, 3, 2, 3, 1, 2):
        tokens = torch.tensor([r[at : at + width] for r in rows])  # (B, S)
        out = engine.step(tokens, torch.arange(at, at + width).expand(2, width))  # (B, S, V)
        for b in range(2):
            assert (out[b] - refs[b][at : at + width]).abs().max() < 1e-5, (at, width, b)
        at += width


def test_decode_reads_the_cache_not_the_up_projection():
    """The step attends over what the cache holds: corrupting a cached latent changes the next logits (the control
    that the absorbed path, not a recomputation, produced them)."""
    model = model_of("q_lora")
    rows = rows_of(1, 6)
    engine = Engine(model, compile=False, cuda_graphs=False)
    engine.start([rows[0][:5]], reserve=2)
    step = torch.tensor([[rows[0][5]]]), torch.tensor([[5]])
    before = engine.step(*step).clone()
    engine.caches[0].kv[0, 2, :8] += 1.0  # slot 2's latent
    assert (engine.step(*step) - before).abs().max() > 1e-3


def test_bytes_per_token_equal_the_formula():
    model = model_of("q_lora").to(torch.bfloat16)
    engine = Engine(model, compile=False, cuda_graphs=False)
    engine.allocate(batch=3, length=40)
    args = model.args
    per_layer = (args.kv_lora_rank + args.qk_rope_head_dim) * 2  # bf16
    for cache in engine.caches:
        assert cache.bytes_per_token == per_layer
        # its buffers
        assert cache.kv.numel() * cache.kv.element_size() == per_layer * cache.batch * cache.length
    assert engine.cache_bytes_per_token == args.n_layers * per_layer
    assert per_layer == args.cache_elements_per_token * 2


def test_deepseek_v2_lite_cache_is_3_6x_smaller_than_gqa():
    """DeepSeek-V2-Lite's layer (latent 512 + RoPE key 64) against an 8-KV-head GQA layer of head dim 128, both
    caches built by loom.infer on the meta device: bytes per token measured on their buffers."""
    with torch.device("meta"):
        mla_model = Llama(FLAVORS["deepseek_v2_lite"].with_(n_layers=1, vocab_size=128, max_seq_len=8))
        gqa_model = Llama(FLAVORS["8B"].with_(n_layers=1, vocab_size=128, max_seq_len=8))
    latent = make_cache(mla_model.layers["0"].attention, 1, 16, torch.bfloat16, "meta")
    kv = make_cache(gqa_model.layers["0"].attention, 1, 16, torch.bfloat16, "meta")
    assert isinstance(latent, LatentCache) and isinstance(kv, KVCache)
    assert latent.bytes_per_token == (512 + 64) * 2 and kv.bytes_per_token == 2 * 8 * 128 * 2
    assert round(kv.bytes_per_token / latent.bytes_per_token, 2) == 3.56


def test_planner_counts_the_cache_it_installs():
    """loom plan --generate's KV bytes for an MLA model equal the installed latent caches' bytes."""
    from loom.plan.generate import kv_cache_bytes

    model = model_of("q_lora").to(torch.bfloat16)
    engine = Engine(model, compile=False, cuda_graphs=False)
    engine.allocate(batch=2, length=100)
    installed = sum(c.kv.numel() * c.kv.element_size() for c in engine.caches)
    assert kv_cache_bytes(model.args, engine.batch, engine.length, "bfloat16") == installed
