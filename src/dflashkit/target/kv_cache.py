"""A decode KV cache that grows in place: no copy of the whole cache per step, a rollback that copies nothing.

Usage:
    cache = decode_cache(target.config)        # a transformers DynamicCache whose full-attention layers grow in place
    target.model(input_ids=ids, cache=cache, use_cache=True)
    cache.crop(-drop)                          # as DynamicCache: forget the last `drop` positions

transformers' `DynamicLayer` appends each step's keys and values with `torch.cat`, which copies the whole
layer's cache every step (and, after a `crop` has left a view, copies it from a strided view): work that grows
with the context on every step. `GrowingLayer` keeps a buffer with spare
positions, writes a step's keys and values into it and hands the attention a view of the filled part; the
buffer doubles when full. `crop` only moves the fill mark. The views hold exactly what `DynamicLayer` would
hold, so the attention computes the same numbers. Other layer kinds (sliding windows, linear attention,
quantized) are left as transformers built them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` over a buffer with spare positions (see the module doc)."""

    def __init__(self, capacity: int = 256, **kwargs: Any):
        super().__init__(**kwargs)
        self._capacity = max(int(capacity), 1)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self._kbuf = key_states.new_empty(b, h, self._capacity, d)
        self._vbuf = value_states.new_empty(b, h, self._capacity, value_states.shape[-1])
        self._len = 0

    def _reserve(self, n: int) -> None:
        assert self._kbuf is not None and self._vbuf is not None
        cap = self._kbuf.shape[-2]
        if self._len + n <= cap:
            return
        new = max(2 * cap, self._len + n)
        k, v = self._kbuf, self._vbuf
        self._kbuf = k.new_empty(*k.shape[:-2], new, k.shape[-1])
        self._vbuf = v.new_empty(*v.shape[:-2], new, v.shape[-1])
        self._kbuf[..., : self._len, :] = k[..., : self._len, :]
        self._vbuf[..., : self._len, :] = v[..., : self._len, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(n)
        assert self._kbuf is not None and self._vbuf is not None
        self._kbuf[..., self._len: self._len + n, :] = key_states
        self._vbuf[..., self._len: self._len + n, :] = value_states
        self._len += n
        self.keys = self._kbuf[..., : self._len, :]
        self.values = self._vbuf[..., : self._len, :]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): give a negative number of positions to remove")
        if tokens_to_remove == 0 or not self.is_initialized or self._kbuf is None:
            return
        self._len = max(self._len + tokens_to_remove, 0)
        self.keys = self._kbuf[..., : self._len, :]
        self.values = self._vbuf[..., : self._len, :] if self._vbuf is not None else self.values

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._len = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("GrowingLayer is a batch-size-1 decode cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("GrowingLayer is a batch-size-1 decode cache")


def decode_cache(config: Any, *, capacity: int = 256) -> DynamicCache:
    """A `DynamicCache` for `config` whose plain full-attention layers are `GrowingLayer`s."""
    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if layers:
        for i, layer in enumerate(layers):
            if type(layer) is DynamicLayer:
                layers[i] = GrowingLayer(capacity)
    return cache
