"""Request plumbing shared by the serve engines, and the one-at-a-time engine for any `Decoder`.

Usage:
    engine = SerialEngine(SpecDecoder(target, drafter), tokenizer, default_stop_ids(target)).start()
    req = engine.submit(prompt_ids, SamplingParams(max_new_tokens=64, stop=["\\n\\n"]), stream=True)
    for delta in req.deltas(): ...                                  # text pieces (stream)
    out = req.wait()                                                # GenerationResult: text, token_ids, …
    engine.generate(prompt_ids, SamplingParams(...))                # the Decoder protocol (blocking)

The batched engine for plain targets is `serving.batching.BatchEngine`. Both end a request at a
stop token (kept in `token_ids`, not in the text), at a stop string (the text is cut before it) or
at `max_new_tokens` ("length"); streamed deltas concatenate exactly to the final text. A request's
stop ids are its `params.stop_token_ids`, or the engine's when those are empty.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import replace
from typing import Iterator

from dflashkit.decode.api import GenerationResult, SamplingParams

log = logging.getLogger("dflashkit.serve")


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


class RequestCancelled(Exception):
    """The client went away; the engine dropped the request (its batch row is free again)."""


class Request:
    """A submitted request: `deltas()` yields streamed text, `wait()` the result, `cancel()` drops it."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, stream: bool):
        self.prompt_ids, self.params, self.stream = list(prompt_ids), params, stream
        self.events: queue.Queue = queue.Queue()
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step (thread-safe, idempotent)."""
        self.cancelled.set()

    def _finish(self, result: GenerationResult | None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self._done.set()
        self.events.put(None)

    def deltas(self) -> Iterator[str]:
        while True:
            item = self.events.get()
            if item is None:
                return
            yield item

    def wait(self, timeout: float | None = None) -> GenerationResult:
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
                        "batched_requests": 0, "errors": 0, "acceptance_steps": 0, "accepted_tokens": 0,
                        "decode_steps": 0, "decode_rows": 0, "cancelled": 0}
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

    def submit(self, prompt_ids: list[int], params: SamplingParams, stream: bool = False) -> Request:
        req = Request(prompt_ids, params, stream)
        self.queue.put(req)
        return req

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """The `Decoder` protocol: one blocking request."""
        return self.submit(prompt_ids, params).wait()

    def stop_ids(self, req: Request) -> tuple[int, ...]:
        """The request's stop token ids, else the engine's."""
        return tuple(req.params.stop_token_ids) or self.stop_token_ids

    def _count(self, req: Request, out: GenerationResult) -> None:
        with self._lock:
            m = self.metrics
            m["requests"] += 1
            m["prompt_tokens"] += len(req.prompt_ids)
            m["completion_tokens"] += len(out.token_ids)
            m["acceptance_steps"] += len(out.acceptance_lengths)
            m["accepted_tokens"] += sum(out.acceptance_lengths)

    def _drop_if_cancelled(self, req: Request) -> bool:
        """Finish a request whose client went away (the worker calls this between steps)."""
        if not req.cancelled.is_set():
            return False
        if not req._done.is_set():
            with self._lock:
                self.metrics["cancelled"] += 1
            req._finish(None, RequestCancelled("the client disconnected"))
        return True

    def _loop(self) -> None:
        raise NotImplementedError


class SerialEngine(_EngineBase):
    """Any `Decoder` (e.g. the speculative `SpecDecoder`), one request at a time.

    `swap_decoder` replaces the decoder between requests: the worker takes the decoder once per request, so
    a request in flight finishes on the decoder it started with and the next one starts on the new one."""

    def __init__(self, decoder, tokenizer, stop_token_ids: tuple[int, ...]):
        super().__init__(tokenizer, stop_token_ids)
        self.decoder = decoder

    def swap_decoder(self, decoder) -> None:
        """Serve the following requests with `decoder` (built by the caller, off the request path)."""
        with self._lock:
            self.decoder = decoder

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                r = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if self._drop_if_cancelled(r):
                continue
            p = r.params
            with self._lock:
                decoder = self.decoder  # the whole request on this one (a swap lands between requests)
            try:
                res = decoder.generate(r.prompt_ids, replace(p, stop_token_ids=self.stop_ids(r)))
                tracker = _TextTracker(self.tokenizer, p.stop, False)
                ids, reason, text = list(res.token_ids), res.finish_reason, None
                if tracker.stop and tracker.check(ids)[0] is not None:
                    for n in range(1, len(ids) + 1):  # first prefix that completes a stop string
                        cut, _ = tracker.check(ids[:n])
                        if cut is not None:
                            ids, reason, text = ids[:n], "stop", cut
                            break
                out = GenerationResult(text=text if text is not None else tracker.text(ids), token_ids=ids,
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
