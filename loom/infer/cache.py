"""The KV cache: one per attention layer, installed as that layer's ``context`` (``Attention.context``, the module's one
extension point) for the engine's forwards, so the model code stays the plain training code.

Layout (``KVCache``): ``k`` and ``v`` are (B, Hkv, L, D) in the model's dtype and hold only the KV heads this rank
owns (GQA/MQA: Hkv < Hq, nothing repeated). Slot = position: row b's token at position p lives in slot p of row b
(per-sequence positions, no left padding). Prompts of different lengths are right-padded for the prefill; a pad's
slot lies past its row's last prompt token, so no real token ever sees it, and the row's generated tokens
overwrite it. Every query attends to the slots at or before its own position (and within a sliding window), so
slots past it (pads, a speculative round's rejected tokens, a capture's scratch writes) never need clearing.

The two calls a model's forward makes through a cache (what ``Llama.forward(tokens, positions)`` passes on):

- ``positions`` None, the prefill: the batch's first S tokens, at positions 0..S-1 in every row (slots 0..S-1),
  attended through the model's own kernels (``loom.models.common.layers.attend``, causal);
- ``positions`` (B, S), an extension (a decode step, S = 1, or a speculative verification, S = k + 1): these
  tokens at these positions, written to those slots, attending over the cache (``cached_attention``).

The interface every attention class's cache follows (a multi-head latent attention's latent cache as well):

- it is an ``nn.Module`` whose tensors are non-persistent buffers: installed as ``attention.context`` it becomes a
  child module, so per-block ``torch.compile`` shares one graph across blocks and ``state_dict`` is unchanged;
- ``rope_positions(positions, bsz, seq, device)`` as ``LocalContext``'s, plus whatever the attention's forward calls
  on its context (loom's ``Attention``: ``attend(q, k, v, positions, backend, window)``);
- ``bytes_per_token``: the bytes one token takes in this layer's cache on this rank; ``batch`` and ``length``.

An attention module gets its cache from ``make_cache(attention, batch, length, dtype, device)``: the module's own
``make_cache(batch, length, dtype, device)`` method where its class defines one (a class in ``loom/models`` cannot
import ``loom.infer``: it follows this protocol by duck typing and can use ``visible``'s three lines), else the
factory registered for its class with ``register_cache`` (loom's ``Attention``: ``KVCache.for_attention``; a
module of ``loom.infer`` that registers one is listed in ``PROVIDERS``, imported on the first ``make_cache``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.common.layers import LOCAL_CONTEXT, Attention, attend
from loom.parallel.shards import local_tensor

_FACTORIES: dict[type, Callable] = {}


def register_cache(attention_class: type, factory: Callable) -> None:
    """``factory(attention, batch, length, dtype, device)`` makes the caches of ``attention_class``'s modules."""
    _FACTORIES[attention_class] = factory


# modules of loom.infer that register caches for other attention classes when imported (make_cache imports them)
PROVIDERS = ("loom.infer.mla_cache",)


def _import_providers() -> None:
    import importlib

    for name in PROVIDERS:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # the provider exists but something it imports does not
                raise


def make_cache(attention: nn.Module, batch: int, length: int, dtype: torch.dtype, device) -> nn.Module:
    """The cache of one attention module for ``batch`` rows of ``length`` slots (see the module docstring)."""
    own = getattr(attention, "make_cache", None)
    if own is not None:
        return own(batch, length, dtype, device)
    _import_providers()
    for cls in type(attention).__mro__:
        if cls in _FACTORIES:
            return _FACTORIES[cls](attention, batch, length, dtype, device)
    raise TypeError(
        f"no cache for attention class {type(attention).__name__}: define make_cache(batch, length, dtype, "
        "device) on it or register_cache(its class, factory) (loom.infer.cache)"
    )


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose ``context`` a cache replaces: each block's attention, in layer order."""
    return [block.attention for block in model.layers.values()]


def install(model: nn.Module, batch: int, length: int, dtype: torch.dtype, device) -> list[nn.Module]:
    """A fresh cache in every attention module of ``model``; returns them in layer order."""
    caches = []
    for attn in attention_modules(model):
        cache = make_cache(attn, batch, length, dtype, device)
        _set_context(attn, cache)
        caches.append(cache)
    return caches


def reinstall(model: nn.Module, caches: list[nn.Module]) -> None:
    """Put caches made by ``install`` for ``model`` back into its attention modules (layer order)."""
    modules = attention_modules(model)
    assert len(modules) == len(caches), (len(modules), len(caches))
    for attn, cache in zip(modules, caches):
        _set_context(attn, cache)


def uninstall(model: nn.Module) -> None:
    """Every attention module back to ``LocalContext`` (the training behaviour); the caches' memory is released."""
    for attn in attention_modules(model):
        _set_context(attn, LOCAL_CONTEXT)


def _set_context(attn: nn.Module, context) -> None:
    if "context" in attn._modules:  # a cache is a child module: nn.Module refuses a plain object in its place
        del attn._modules["context"]
    attn.context = context


def visible(positions: torch.Tensor, length: int, window: int = 0) -> torch.Tensor:
    """Which of ``length`` slots each query sees: slot j for a query at position p when j <= p (and j > p - window
    with a sliding window). positions (B, S) -> (B, 1, S, L) bool."""
    slots = torch.arange(length, device=positions.device)  # (L,)
    p = positions[:, None, :, None]  # (B, 1, S, 1)
    seen = slots <= p
    return seen & (slots > p - window) if window > 0 else seen


def store(cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
    """Write rows (B, S, ...) into cache (B', ..., L, ...) at each row's slots ``positions`` (B, S), in place.
    ``cache[b, :, p] = rows[b, s]`` for a (B, H, L, D) cache (slot dim 2), ``cache[b, p] = rows[b, s]`` for a
    (B, L, C) one (slot dim 1). As an index_put (not a scatter), so Inductor writes the S new slots into the
    buffer: a compiled scatter on a buffer becomes a copy of the whole cache, the scatter and a copy back. Under
    autocast (rollouts in a training step) the rows come in the compute dtype, the cache in the weights'."""
    bsz = rows.shape[0]
    batch = torch.arange(bsz, device=positions.device)[:, None]  # (B, 1)
    if cache.dim() == 4:
        cache[batch, :, positions] = rows.to(cache.dtype)  # advanced indices first: rows (B, S, H, D)
    else:
        cache[batch, positions] = rows.to(cache.dtype)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (B, Hq, S, D) over the cache k/v (B, Hkv, L, D) where ``mask`` (B, 1, S, L) is true. The query heads that
    share a KV head are folded into the query length, (B, Hkv, G*S, D), so each KV head's slots are read once and
    nothing is repeated (SDPA sees plain multi-head attention with Hkv heads). Returns (B, Hq, S, D)."""
    bsz, hq, seq, dim = q.shape
    hkv, length = k.shape[1], k.shape[2]
    group = hq // hkv
    qg = q.reshape(bsz, hkv, group * seq, dim)  # head h = kv * G + g: (B, Hkv, G, S, D) flattened
    m = mask[:, :, None].expand(bsz, 1, group, seq, length).reshape(bsz, 1, group * seq, length)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m)  # (B, Hkv, G*S, D)
    return out.reshape(bsz, hq, seq, dim)


class KVCache(nn.Module):
    """The cache of one grouped-query attention layer: k, v (B, Hkv, L, D), slot = position (module docstring)."""

    def __init__(self, batch: int, n_kv_heads: int, length: int, head_dim: int, dtype: torch.dtype, device):
        super().__init__()
        shape = (batch, n_kv_heads, length, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @classmethod
    def for_attention(cls, attn: Attention, batch: int, length: int, dtype: torch.dtype, device) -> KVCache:
        """Sized from the module's key projection: under tensor parallelism, this rank's KV heads only."""
        weight = attn.wk.weight
        rows = local_tensor(weight).shape[0]
        return cls(batch, rows // attn.head_dim, length, attn.head_dim, dtype, device)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in this layer on this rank: 2 * Hkv * D elements."""
        return 2 * self.k.shape[1] * self.k.shape[3] * self.k.element_size()

    def rope_positions(
        self, positions: torch.Tensor | None, bsz: int, seq: int, device
    ) -> torch.Tensor | None:
        """The tokens' positions are their RoPE positions (None: 0..S-1, the prefill)."""
        return positions

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None,
        backend: str,
        window: int = 0,
    ) -> torch.Tensor:
        """Store k/v (B, Hkv, S, D) at the tokens' slots, then attend: q (B, Hq, S, D) -> (B, Hq, S, D)."""
        bsz, _, seq, _ = k.shape
        if positions is None:  # the prefill: slots 0..S-1, nothing cached before them
            self.k[:bsz, :, :seq].copy_(k)
            self.v[:bsz, :, :seq].copy_(v)
            return attend(q, k, v, backend, None, window)
        store(self.k, k.transpose(1, 2), positions)
        store(self.v, v.transpose(1, 2), positions)
        return cached_attention(q, self.k[:bsz], self.v[:bsz], visible(positions, self.length, window))


register_cache(Attention, KVCache.for_attention)
