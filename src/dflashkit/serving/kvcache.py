"""A preallocated KV cache for continuous batching: row slots × shared, left-padded columns.

Usage:
    cache = SlotCache(max_rows=16)
    cache.add_rows(prefill_cache, prefill_mask)          # a prefilled DynamicCache joins as new rows
    mask = cache.open_column()                           # [rows, length+1] mask for one decode step
    model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
    cache.advance()                                      # the step's column is now part of the cache
    cache.keep_rows([0, 2, 3])                           # free finished (or cancelled) rows in place

Layout: per layer one key and one value buffer [max_rows, kv_heads, capacity, head_dim]; rows
0..rows-1 are the running sequences, columns 0..length-1 hold their tokens, left-padded (`mask` is
[max_rows, capacity], 1 = a real token). A decode step writes every row's new key/value into the
same column `length` (`update` is a slice assignment, never a concatenation) and attention reads
the view [:rows, :, :length+1]. Capacity doubles when a step or a joining prefill needs more columns
(amortised O(1) per token); `keep_rows` compacts the surviving rows to the front, preserving their
order, and `trim` drops leading columns that are padding in every row. The model sees an ordinary
full-attention cache (`DynamicLayer` API), so any HF decoder that accepts a `DynamicCache` works.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _SlotLayer(DynamicLayer):
    """One decoder layer's view of the shared `SlotCache` buffers."""

    is_croppable = False

    def __init__(self, owner: "SlotCache", idx: int):
        super().__init__()
        self.owner, self.idx = owner, idx
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner._write(self.idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("use SlotCache.keep_rows")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a SlotCache is not croppable")


class SlotCache(Cache):
    """Preallocated KV for up to `max_rows` sequences (see the module docstring)."""

    def __init__(self, max_rows: int, capacity: int = 256):
        super().__init__(layers=[])
        self.max_rows, self.capacity = max_rows, capacity
        self.rows = 0      # running sequences, in slots 0..rows-1
        self.length = 0    # columns in use
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None  # [max_rows, capacity] long, 1 = real token

    # -- what the model calls -------------------------------------------------------------------
    def _write(self, idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, end = k.shape[0], self.length + k.shape[-2]
        assert n == self.rows and end <= self.capacity, (n, self.rows, end, self.capacity)
        kb, vb = self.keys[idx], self.values[idx]
        kb[:n, :, self.length:end] = k
        vb[:n, :, self.length:end] = v
        return kb[:n, :, :end], vb[:n, :, :end]

    # -- what the engine calls ------------------------------------------------------------------
    def open_column(self, width: int = 1) -> torch.Tensor:
        """Make room for `width` new tokens per row; return the [rows, length+width] mask for the step."""
        self._reserve(self.length + width)
        assert self.mask is not None
        self.mask[: self.rows, self.length: self.length + width] = 1
        return self.mask[: self.rows, : self.length + width]

    def advance(self, width: int = 1) -> None:
        """The columns opened by `open_column` now hold the step's keys/values."""
        self.length += width

    def add_rows(self, cache, mask: torch.Tensor) -> None:
        """Append the rows of a prefilled `DynamicCache` (left-padded, `mask` [k, w]) as new slots.

        Its columns are right-aligned with the running ones; if it is wider, the running rows are
        shifted right (more left padding for them), so every row writes its next token in one column.
        """
        k, w = mask.shape
        if self.rows + k > self.max_rows:
            raise ValueError(f"{self.rows} + {k} rows exceed max_rows={self.max_rows}")
        layers = cache.layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            raise NotImplementedError(f"cannot batch a cache with {sorted({type(x).__name__ for x in layers})}")
        if not self.keys:
            cap = max(self.capacity, 2 * w)
            self.keys = [layer.keys.new_zeros(self.max_rows, *layer.keys.shape[1:2], cap, layer.keys.shape[-1])
                         for layer in layers]
            self.values = [layer.values.new_zeros(self.max_rows, *layer.values.shape[1:2], cap,
                                                  layer.values.shape[-1]) for layer in layers]
            self.mask = mask.new_zeros(self.max_rows, cap)
            self.capacity = cap
            self.layers = [_SlotLayer(self, i) for i in range(len(layers))]
        if w > self.length:
            self._relayout(self.capacity if w < self.capacity else 2 * w, shift=w - self.length)
        assert self.mask is not None
        lo, hi, start = self.rows, self.rows + k, self.length - w
        for mine_k, mine_v, layer in zip(self.keys, self.values, layers):
            mine_k[lo:hi, :, :start] = 0
            mine_v[lo:hi, :, :start] = 0
            mine_k[lo:hi, :, start:self.length] = layer.keys
            mine_v[lo:hi, :, start:self.length] = layer.values
        self.mask[lo:hi, :start] = 0
        self.mask[lo:hi, start:self.length] = mask
        self.rows = hi

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (ascending), compacted to slots 0..len(keep)-1 in that order.

        This is how finished or cancelled requests free their slot: rows after a freed one move up.
        """
        assert keep == sorted(set(keep)) and (not keep or keep[-1] < self.rows), keep
        assert self.mask is not None or not keep
        end = self.length
        for dst, src in enumerate(keep):
            if dst != src:  # src > dst, and slots < dst are final, so in-place moves are safe
                for kb, vb in zip(self.keys, self.values):
                    kb[dst, :, :end] = kb[src, :, :end]
                    vb[dst, :, :end] = vb[src, :, :end]
                assert self.mask is not None  # keep is not empty here: asserted above
                self.mask[dst, :end] = self.mask[src, :end]
        self.rows = len(keep)
        if not keep:
            self.length = 0

    def trim(self) -> int:
        """Drop leading columns that are padding in every running row; return how many."""
        if self.mask is None or self.rows == 0 or self.length == 0:
            return 0
        real = self.mask[: self.rows, : self.length].any(0)
        lead = int(real.to(torch.int8).argmax()) if bool(real.any()) else self.length
        if lead > 0:
            self._relayout(self.capacity, shift=-lead)
        return lead

    # -- storage --------------------------------------------------------------------------------
    def _reserve(self, columns: int) -> None:
        if columns > self.capacity:
            self._relayout(max(columns, 2 * self.capacity), shift=0)

    def _relayout(self, capacity: int, shift: int) -> None:
        """Move the used columns by `shift` (>0: add left padding, <0: drop leading columns)."""
        n, old = self.rows, self.length
        src0 = max(0, -shift)
        new_len = old + shift
        assert new_len <= capacity and self.mask is not None
        if capacity != self.capacity:
            grow = lambda t: t.new_zeros(*t.shape[:2], capacity, t.shape[-1])  # noqa: E731
            keys, values = [grow(t) for t in self.keys], [grow(t) for t in self.values]
            mask = self.mask.new_zeros(self.max_rows, capacity)
        else:  # same buffers; the source is cloned because the ranges overlap
            keys, values, mask = self.keys, self.values, self.mask
        dst0 = max(0, shift)
        for a, b in zip(keys + values, self.keys + self.values):
            a[:n, :, dst0:new_len] = b[:n, :, src0:old].clone()
            a[:n, :, :dst0] = 0
        mask[:n, dst0:new_len] = self.mask[:n, src0:old].clone()
        mask[:n, :dst0] = 0
        self.keys, self.values, self.mask, self.capacity, self.length = keys, values, mask, capacity, new_len
