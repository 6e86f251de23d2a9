"""Decoding engines behind `dflashkit serve`: padded batches of a HF target, or one-at-a-time Decoders.

Usage:
    engine = BatchEngine(target, max_batch=8, batch_wait_ms=5)     # also a `Decoder`
    engine.start()
    req = engine.submit(prompt_ids, ServeParams(max_new_tokens=64, stop=["\\n\\n"]), stream=True)
    for delta in req.deltas(): ...                                  # text pieces (stream)
    out = req.wait()                                                # Completion: text, token_ids, …
    engine.generate(prompt_ids, SamplingParams(...))                # Decoder protocol (blocking)

    engine = SerialEngine(SpecDecoder(target, drafter), tokenizer)  # --drafter: one request at a time

Batching is static: a worker thread takes up to `max_batch` waiting requests (waiting at most
`batch_wait_ms` for company), left-pads the prompts, and decodes them together with a 2-D
attention mask and explicit position ids (each row counts positions from its first real token),
so a request's greedy output does not depend on its batch-mates. Finished rows leave the batch
(the KV cache rows are dropped). Sampling is per row (temperature, top_p, top_k, seeded generator).
A request ends at a stop token (kept in `token_ids`, not in the text), at a stop string (the text is
cut before it) or at `max_new_tokens` ("length").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from dflashkit.decode.api import GenerationResult, SamplingParams

log = logging.getLogger("dflashkit.serve")


@dataclass
class ServeParams:
    """What one HTTP request asks for."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    acceptance_lengths: list[int] = field(default_factory=list)


def default_stop_ids(target) -> tuple[int, ...]:
    """The tokenizer's eos plus the model's generation_config eos id(s)."""
    tok = target.tokenizer
    ids = {tok.eos_token_id} if tok is not None and tok.eos_token_id is not None else set()
    gen_eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return tuple(sorted(int(i) for i in ids))


class _TextTracker:
    """Incremental detokenisation with stop strings; streamed deltas concatenate to the final text."""

    def __init__(self, tokenizer, stop: list[str], stream: bool):
        self.tok, self.stop, self.stream = tokenizer, [s for s in stop if s], stream
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.sent = 0

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def check(self, ids: list[int]) -> tuple[str | None, str]:
        """(text cut at a stop string or None, streamable delta)."""
        if not self.stop and not self.stream:
            return None, ""
        text = self.text(ids)
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            return text[: min(cuts)], ""
        if not self.stream:
            return None, ""
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            safe -= 1
        if safe <= self.sent:
            return None, ""
        delta, self.sent = text[self.sent: safe], safe
        return None, delta


class Request:
    """A submitted request: `deltas()` yields streamed text, `wait()` the Completion."""

    def __init__(self, prompt_ids: list[int], params: ServeParams, stream: bool):
        self.prompt_ids, self.params, self.stream = list(prompt_ids), params, stream
        self.events: queue.Queue = queue.Queue()
        self.result: Completion | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    def _finish(self, result: Completion | None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self._done.set()
        self.events.put(None)

    def deltas(self) -> Iterator[str]:
        while True:
            item = self.events.get()
            if item is None:
                return
            yield item

    def wait(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError("request did not finish in time")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class _EngineBase:
    """Queue + worker thread + counters shared by both engines."""

    def __init__(self, tokenizer, stop_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.queue: queue.Queue[Request] = queue.Queue()
        self.metrics = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "batches": 0,
                        "batched_requests": 0, "errors": 0, "acceptance_steps": 0, "accepted_tokens": 0}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> "_EngineBase":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dflashkit-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, prompt_ids: list[int], params: ServeParams, stream: bool = False) -> Request:
        req = Request(prompt_ids, params, stream)
        self.queue.put(req)
        return req

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """The `Decoder` protocol: one blocking request (stop tokens from `params`)."""
        sp = ServeParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                         max_new_tokens=params.max_new_tokens, seed=params.seed)
        req = Request(prompt_ids, sp, False)
        req.stop_token_ids = tuple(params.stop_token_ids) or self.stop_token_ids  # type: ignore[attr-defined]
        self.queue.put(req)
        out = req.wait()
        return GenerationResult(token_ids=out.token_ids, finish_reason=out.finish_reason,  # type: ignore[arg-type]
                                acceptance_lengths=out.acceptance_lengths)

    def _count(self, req: Request, out: Completion) -> None:
        with self._lock:
            m = self.metrics
            m["requests"] += 1
            m["prompt_tokens"] += len(req.prompt_ids)
            m["completion_tokens"] += len(out.token_ids)
            m["acceptance_steps"] += len(out.acceptance_lengths)
            m["accepted_tokens"] += sum(out.acceptance_lengths)

    def _loop(self) -> None:
        raise NotImplementedError


class BatchEngine(_EngineBase):
    """Static padded batching over a HF causal LM (the `Target` from `load_target`)."""

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
        import inspect

        params = inspect.signature(target.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x renamed it

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.max_batch:
                left = deadline - time.monotonic()
                try:
                    batch.append(self.queue.get(timeout=left) if left > 0 else self.queue.get_nowait())
                except queue.Empty:
                    break
            try:
                with torch.inference_mode():
                    self._decode(batch)
            except Exception as e:  # noqa: BLE001 - report to every waiting request, keep serving
                log.exception("batch of %d failed", len(batch))
                with self._lock:
                    self.metrics["errors"] += len(batch)
                for r in batch:
                    if not r._done.is_set():
                        r._finish(None, e)

    def _pick(self, logits: torch.Tensor, p: ServeParams, gen: torch.Generator | None) -> int:
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        from dflashkit.decode.sampling import sample, sampling_probs

        probs = sampling_probs(logits.float()[None], p.temperature, p.top_p, p.top_k)
        return int(sample(probs, gen).reshape(-1)[0])

    def _decode(self, batch: list[Request]) -> None:
        from transformers import DynamicCache

        model, dev = self.target.model, self.target.device
        with self._lock:
            self.metrics["batches"] += 1
            self.metrics["batched_requests"] += len(batch)
        rows = list(batch)
        lens = [len(r.prompt_ids) for r in rows]
        width = max(lens)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - lens[i]:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - lens[i]:] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        state = []
        for r in rows:
            gen = None
            if r.params.temperature > 0:
                gen = torch.Generator(device=dev)
                gen.manual_seed(r.params.seed if r.params.seed is not None else int(time.time_ns() % (1 << 31)))
            limit = max(0, min(r.params.max_new_tokens, self.max_context - len(r.prompt_ids)))
            state.append({"out": [], "gen": gen, "limit": limit,
                          "stops": getattr(r, "stop_token_ids", self.stop_token_ids),
                          "text": _TextTracker(self.tokenizer, r.params.stop, r.stream)})
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                       **{self._cache_kw: cache}).logits[:, -1]
        active = list(range(len(rows)))
        next_pos = pos[:, -1] + 1
        while active:
            keep, new_tokens = [], []
            for j, i in enumerate(active):
                r, st = rows[i], state[i]
                if st["limit"] == 0:
                    self._complete(r, st, "length", None)
                    continue
                tok = self._pick(logits[j], r.params, st["gen"])
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
                    new_tokens.append(tok)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=dev)
                cache.batch_select_indices(idx)
                mask, next_pos = mask[idx], next_pos[idx]
                active = [active[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype, device=dev)], dim=1)
            step_ids = torch.tensor(new_tokens, dtype=torch.long, device=dev)[:, None]
            logits = model(input_ids=step_ids, attention_mask=mask, position_ids=next_pos[:, None],
                           use_cache=True, **{self._cache_kw: cache}).logits[:, -1]
            next_pos = next_pos + 1

    def _complete(self, r: Request, st: dict[str, Any], reason: str, cut: str | None) -> None:
        tracker: _TextTracker = st["text"]
        text = cut if cut is not None else tracker.text(st["out"])
        if r.stream and len(text) > tracker.sent:
            r.events.put(text[tracker.sent:])
        out = Completion(text=text, token_ids=list(st["out"]), finish_reason=reason,
                         prompt_tokens=len(r.prompt_ids))
        self._count(r, out)
        r._finish(out)


class SerialEngine(_EngineBase):
    """Any `Decoder` (e.g. the speculative `SpecDecoder`), one request at a time."""

    def __init__(self, decoder, tokenizer, stop_token_ids: tuple[int, ...]):
        super().__init__(tokenizer, stop_token_ids)
        self.decoder = decoder

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                r = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            p = r.params
            try:
                res = self.decoder.generate(r.prompt_ids, SamplingParams(
                    temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_new_tokens=p.max_new_tokens,
                    seed=p.seed, stop_token_ids=getattr(r, "stop_token_ids", self.stop_token_ids)))
                tracker = _TextTracker(self.tokenizer, p.stop, False)
                ids, reason, text = list(res.token_ids), res.finish_reason, None
                if tracker.stop and tracker.check(ids)[0] is not None:
                    for n in range(1, len(ids) + 1):  # first prefix that completes a stop string
                        cut, _ = tracker.check(ids[:n])
                        if cut is not None:
                            ids, reason, text = ids[:n], "stop", cut
                            break
                out = Completion(text=text if text is not None else tracker.text(ids), token_ids=ids,
                                 finish_reason=reason, prompt_tokens=len(r.prompt_ids),
                                 acceptance_lengths=list(res.acceptance_lengths))
                if r.stream and out.text:
                    r.events.put(out.text)
                self._count(r, out)
                with self._lock:
                    self.metrics["batches"] += 1
                    self.metrics["batched_requests"] += 1
                r._finish(out)
            except Exception as e:  # noqa: BLE001
                log.exception("request failed")
                with self._lock:
                    self.metrics["errors"] += 1
                r._finish(None, e)
