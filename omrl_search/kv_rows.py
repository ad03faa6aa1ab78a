"""KV-cache plumbing shared by the in-process torch models that reuse prefixes across calls: the
``hf`` policy backend and the learned reward models (:mod:`reward_models.prm`).

Both keep a :class:`~omrl_search.prefix_cache.RadixCache` of per-prefix keys/values. A batch is built as
``[cached columns | new columns]``: each row's cached prefix right-aligned in the first block
(:func:`load_cached`), its new tokens in the second; the 2D attention mask zeroes the padding of
both, and explicit position ids keep every token at its absolute position. :func:`kv_of_row`
reads one row's keys/values back out in the cache's layout ``(layers, 2, kv_heads, tokens,
head_dim)``. :func:`make_cache` is a KV cache whose layers append into preallocated buffers;
:func:`with_cache` passes one to a model's forward under the keyword its transformers reads.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

_PREALLOC: dict[type, type] = {}
_CACHE_KEYWORD: dict[type, str] = {}


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The forward keywords that hand ``cache`` to ``model`` and ask for it back: ``cache=``
    where the installed transformers names it so (5.2x, which warns on the old name and drops it
    in 5.40), ``past_key_values=`` before."""
    kind = type(model)
    if kind not in _CACHE_KEYWORD:
        params = inspect.signature(kind.forward).parameters
        _CACHE_KEYWORD[kind] = "cache" if "cache" in params else "past_key_values"
    return {_CACHE_KEYWORD[kind]: cache, "use_cache": True}


def make_cache(config: Any, capacity: int) -> Any:
    """A KV cache whose layers append into preallocated buffers.

    transformers' ``DynamicLayer`` grows by ``torch.cat`` at every step, which copies the whole
    cache each time (most of a CPU decode step at batch 32); here a step writes one column."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cls = _prealloc_layer_class(DynamicLayer)
    cache = DynamicCache(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers) and cache.layers:
        cache.layers = [cls(capacity) for _ in cache.layers]
    return cache


def _prealloc_layer_class(base: type) -> type:
    if base in _PREALLOC:
        return _PREALLOC[base]

    class PreallocLayer(base):  # type: ignore[misc, valid-type]
        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self._k = self._v = None
            self._n = 0

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, t = self._n, key_states.shape[-2]
            if self._k is None or n + t > self._k.shape[-2]:
                cap = max(self.capacity, 2 * (n + t))
                shape = (*key_states.shape[:-2], cap, key_states.shape[-1])
                k, v = key_states.new_empty(shape), value_states.new_empty(shape)
                if n:
                    k[..., :n, :] = self._k[..., :n, :]
                    v[..., :n, :] = self._v[..., :n, :]
                self._k, self._v = k, v
            self._k[..., n:n + t, :] = key_states
            self._v[..., n:n + t, :] = value_states
            self._n = n + t
            self.keys, self.values = self._k[..., :self._n, :], self._v[..., :self._n, :]
            return self.keys, self.values

        def batch_select_indices(self, indices: Any) -> None:
            if self._k is not None:
                self._k = self._k[indices, ...]
                self._v = self._v[indices, ...]
                self.keys, self.values = self._k[..., :self._n, :], self._v[..., :self._n, :]

    _PREALLOC[base] = PreallocLayer
    return PreallocLayer


def load_cached(cache: Any, hits: list[tuple[int, list[Any]]], W: int, device: Any) -> Any:
    """Copy each row's cached prefix (``hits[u]``: its length and KV pieces from
    :meth:`RadixCache.lookup`), right-aligned in ``W`` columns, into the empty batch ``cache``;
    returns those columns' attention mask ``[rows, W]``. Raises ValueError for a cache whose
    layers are not plain appending ones (sliding-window, quantized)."""
    import torch

    U = len(hits)
    first = next(parts[0] for n, parts in hits if n)
    L, _, H, _, D = first.shape
    if len(cache.layers) != L or not all(isinstance(layer, tuple(_PREALLOC.values())) for layer in cache.layers):
        raise ValueError("the prefix cache needs a plain KV cache (no sliding-window or quantized layers)")
    seg = torch.zeros((U, W), dtype=torch.long, device=device)
    for u, (n, _) in enumerate(hits):
        seg[u, W - n:] = 1 if n else 0
    for l, layer in enumerate(cache.layers):
        k = first.new_zeros((U, H, W, D))
        v = first.new_zeros((U, H, W, D))
        for u, (n, parts) in enumerate(hits):
            at = W - n
            for part in parts:
                t = part.shape[-2]
                k[u, :, at:at + t] = part[l, 0]
                v[u, :, at:at + t] = part[l, 1]
                at += t
        layer.update(k, v)
    return seg


def kv_of_row(cache: Any, mask: Any, b: int, length: int) -> Callable[[int, int], Any]:
    """``kv_of(start, end)`` for :meth:`RadixCache.insert`: the KV of tokens ``[start, end)`` of
    batch row ``b``, whose tokens are its first ``length`` unmasked columns."""
    import torch

    cols = mask[b].nonzero().squeeze(1)[:length]

    def kv_of(s: int, e: int) -> Any:
        c = cols[s:e]
        return torch.stack([torch.stack([layer.keys[b][:, c], layer.values[b][:, c]])
                            for layer in cache.layers])

    return kv_of
