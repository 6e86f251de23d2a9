"""Continuous padded batching of a HF causal LM: the default engine of `dflashkit serve`.

Usage:
    engine = BatchEngine(target, max_batch=8, batch_wait_ms=5).start()   # also a `Decoder`
    req = engine.submit(prompt_ids, SamplingParams(max_new_tokens=64), stream=True)
    out = req.wait()

How: one worker thread owns a running batch: a preallocated KV cache (`serving.kvcache.SlotCache`:
row slots × shared left-padded columns, each decode step writes one column in place) and per-row
next positions. Between decode steps it admits waiting requests (up to `max_batch` rows): they are
prefilled together, left-padded, and join as new slots right-aligned with the running columns.
Finished rows free their slot (`_keep`, which compacts the batch and trims columns that are
padding in every row). Position ids are explicit per row (counted from its first real token), so
padding never shifts RoPE and a request's greedy output does not depend on its batch-mates.
Greedy rows are picked with one batched argmax; the prefill computes logits for the last position only.

A target with linear-attention / state-space layers (Qwen3-Next, Qwen3.5, Bamba, Nemotron-H, Falcon-H1:
`target.hybrid`) keeps a recurrent state per row that left padding would disturb (a convolution's bias, a
state fed padding), and the slot cache holds keys and values only. Its rows keep a cache each
(`DynamicCache(config=…)`, `_RowCaches`): a request is prefilled alone, and a decode step runs one forward
per row, so each row computes exactly what one-sequence decoding computes; admission, picking, stops and
cancellation are the same.
"""

from __future__ import annotations

import inspect
import logging
import queue
import time
from typing import Any, Literal

import torch
from transformers import DynamicCache

from dflashkit.decode.api import GenerationResult, default_stop_ids
from dflashkit.decode.sampling import sample, sampling_probs
from dflashkit.target.hybrid import layer_types, recurrent_summary
from dflashkit.target.packed import use_grouped_attention
from dflashkit.target.load import cache_kwarg
from dflashkit.serving.engine import Request, _EngineBase, _TextTracker
from dflashkit.serving.kvcache import SlotCache

log = logging.getLogger("dflashkit.serve")


class BatchEngine(_EngineBase):
    """Continuous batching over the `Target` from `load_target` (greedy/temperature, stop strings)."""

    def __init__(self, target, *, max_batch: int = 8, batch_wait_ms: float = 5.0,
                 stop_token_ids: tuple[int, ...] | None = None):
        tok = target.tokenizer
        super().__init__(tok, stop_token_ids if stop_token_ids is not None else default_stop_ids(target))
        self.target = target
        self.max_batch = max(1, max_batch)
        self.batch_wait_s = batch_wait_ms / 1000.0
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else None
        self.pad_id = int(pad if pad is not None else (self.stop_token_ids or (0,))[0])
        self.max_context = int(getattr(target.config, "max_position_embeddings", 0) or 1 << 30)
        params = inspect.signature(target.model.forward).parameters
        self._cache_kw = cache_kwarg(target.model)
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.kv_capacity = 256  # initial KV columns; the cache doubles them when a step needs more

        self.per_row = recurrent_summary(layer_types(target.config)) is not None  # a cache per row (module doc)
        if target.device.type == "cpu":
            # With a padding mask, transformers' SDPA path copies K/V once per query-head group (repeat_kv) every
            # step; the grouped-KV attention hands torch's kernel the grouped heads (`target/packed.py`), same result
            use_grouped_attention(target.model)
        self._reset()

    def _reset(self) -> None:
        self.rows: list[tuple[Request, dict[str, Any]]] = []
        self.cache: SlotCache | _RowCaches = (_RowCaches() if self.per_row
                                              else SlotCache(self.max_batch, self.kv_capacity))
        self.next_pos: torch.Tensor | None = None   # [b]
        self.logits: torch.Tensor | None = None     # [b, V] for the next pick

    # -- worker ------------------------------------------------------------------------------
    def _take(self, block: bool) -> list[Request]:
        room = self.max_batch - len(self.rows)
        new: list[Request] = []
        if room <= 0:
            return new
        if block:
            try:
                new.append(self.queue.get(timeout=0.1))
            except queue.Empty:
                return new
            deadline = time.monotonic() + self.batch_wait_s
        while len(new) < room:
            left = deadline - time.monotonic() if block else 0.0
            try:
                new.append(self.queue.get(timeout=left) if left > 0 else self.queue.get_nowait())
            except queue.Empty:
                break
        return [r for r in new if not self._drop_if_cancelled(r)]

    def _loop(self) -> None:
        while not self._stop.is_set():
            new = self._take(block=not self.rows)
            if not new and not self.rows:
                continue
            try:
                with torch.inference_mode():
                    if new:
                        self._admit(new)
                    self._step()
            except Exception as e:  # noqa: BLE001 - report to every request involved, keep serving
                log.exception("decode step failed (%d running, %d new)", len(self.rows), len(new))
                victims = [r for r, _ in self.rows] + new
                with self._lock:
                    self.metrics["errors"] += len(victims)
                for r in victims:
                    if not r._done.is_set():
                        r._finish(None, e)
                self._reset()

    def _forward(self, ids, mask, pos, cache) -> torch.Tensor:
        return self.target.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                                 **self._last_only, **{self._cache_kw: cache}).logits[:, -1]

    def _admit(self, new: list[Request]) -> None:
        dev = self.target.device
        with self._lock:
            self.metrics["batches"] += 1
            self.metrics["batched_requests"] += len(new)
        if isinstance(self.cache, _RowCaches):
            self._admit_rows(new)
            return
        lens = [len(r.prompt_ids) for r in new]
        width = max(lens)
        ids = torch.full((len(new), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for i, r in enumerate(new):
            ids[i, width - lens[i]:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - lens[i]:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        prefill = DynamicCache()
        logits = self._forward(ids, mask, pos, prefill)
        self.cache.add_rows(prefill, mask)
        del prefill
        self.rows += [(r, self._row_state(r)) for r in new]
        nxt = pos[:, -1] + 1
        self.next_pos = nxt if self.next_pos is None else torch.cat([self.next_pos, nxt])
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])

    def _admit_rows(self, new: list[Request]) -> None:
        """Per-row caches: prefill each new request alone (no padding) into a cache of its own."""
        assert isinstance(self.cache, _RowCaches)
        dev = self.target.device
        logits, nxt = [], []
        for r in new:
            cache = DynamicCache(config=self.target.config)
            n = len(r.prompt_ids)
            ids = torch.tensor([r.prompt_ids], dtype=torch.long, device=dev)
            logits.append(self._forward(ids, torch.ones_like(ids), torch.arange(n, device=dev)[None], cache))
            self.cache.caches.append(cache)
            nxt.append(n)
        self.rows += [(r, self._row_state(r)) for r in new]
        pos = torch.tensor(nxt, dtype=torch.long, device=dev)
        out = torch.cat(logits)
        self.next_pos = pos if self.next_pos is None else torch.cat([self.next_pos, pos])
        self.logits = out if self.logits is None else torch.cat([self.logits, out])

    def _row_state(self, r: Request) -> dict[str, Any]:
        gen = None
        if r.params.temperature > 0:
            gen = torch.Generator(device=self.target.device)
            gen.manual_seed(r.params.seed if r.params.seed is not None else int(time.time_ns() % (1 << 31)))
        limit = max(0, min(r.params.max_new_tokens, self.max_context - len(r.prompt_ids)))
        return {"out": [], "gen": gen, "limit": limit, "stops": self.stop_ids(r),
                "text": _TextTracker(self.tokenizer, r.params.stop, r.stream)}

    def _picks(self) -> list[int]:
        """One token per row: a single argmax for the batch, sampling only for rows that ask for it."""
        assert self.logits is not None
        out = self.logits.argmax(-1).tolist()
        for j, (r, st) in enumerate(self.rows):
            p = r.params
            if p.temperature > 0 and st["limit"] > 0:
                probs = sampling_probs(self.logits[j].float()[None], p.temperature, p.top_p, p.top_k)
                out[j] = int(sample(probs, st["gen"]).reshape(-1)[0])
        return out

    def _keep(self, keep: list[int]) -> None:
        """Keep only running rows `keep` (ascending): free the other slots (finished or cancelled).

        Runs on the worker thread, between decode steps (a cancellation is handed to it, e.g. by
        marking the request, and applied in `_step`).
        """
        if len(keep) == len(self.rows):
            return
        if not keep:
            self._reset()
            return
        assert self.next_pos is not None and self.logits is not None
        self.cache.keep_rows(keep)
        if isinstance(self.cache, SlotCache):
            self.cache.trim()
        idx = torch.tensor(keep, device=self.next_pos.device)
        self.next_pos, self.logits = self.next_pos[idx], self.logits[idx]
        self.rows = [self.rows[j] for j in keep]

    def _step(self) -> None:
        """Pick one token per row, retire finished rows, run one decode forward for the rest."""
        assert self.logits is not None and self.next_pos is not None
        keep, tokens = [], []
        for j, ((r, st), tok) in enumerate(zip(self.rows, self._picks())):
            if self._drop_if_cancelled(r):  # the client went away: free the row
                continue
            if st["limit"] == 0:
                self._complete(r, st, "length", None)
                continue
            st["out"].append(tok)
            cut, delta = st["text"].check(st["out"])
            if delta:
                r.events.put(delta)
            if tok in st["stops"]:
                self._complete(r, st, "stop", None)
            elif cut is not None:
                self._complete(r, st, "stop", cut)
            elif len(st["out"]) >= st["limit"]:
                self._complete(r, st, "length", None)
            else:
                keep.append(j)
                tokens.append(tok)
        self._keep(keep)
        if not keep:
            return
        assert self.next_pos is not None
        with self._lock:
            self.metrics["decode_steps"] += 1
            self.metrics["decode_rows"] += len(keep)
        step_ids = torch.tensor(tokens, dtype=torch.long, device=self.target.device)[:, None]
        if isinstance(self.cache, _RowCaches):  # one forward per row, each over its own cache
            pos = self.next_pos[:, None]
            self.logits = torch.cat([self._forward(step_ids[j:j + 1], None, pos[j:j + 1], cache)
                                     for j, cache in enumerate(self.cache.caches)])
        else:
            mask = self.cache.open_column()
            self.logits = self._forward(step_ids, mask, self.next_pos[:, None], self.cache)
            self.cache.advance()
        self.next_pos = self.next_pos + 1

    def _complete(self, r: Request, st: dict[str, Any], reason: Literal["stop", "length"], cut: str | None) -> None:
        tracker: _TextTracker = st["text"]
        text = cut if cut is not None else tracker.text(st["out"])
        if r.stream and len(text) > tracker.sent:
            r.events.put(text[tracker.sent:])
        out = GenerationResult(text=text, token_ids=list(st["out"]), finish_reason=reason,
                               prompt_tokens=len(r.prompt_ids))
        self._count(r, out)
        r._finish(out)


class _RowCaches:
    """One transformers cache per running row (targets with recurrent layers; see the module doc)."""

    def __init__(self) -> None:
        self.caches: list[Any] = []

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (ascending), in that order."""
        self.caches = [self.caches[j] for j in keep]
