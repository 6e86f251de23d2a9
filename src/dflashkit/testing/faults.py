"""A fast, fault-injecting OpenAI-compatible server (raw asyncio HTTP/1.1) for tests and `bench generate`.

Usage:
    with FaultServer(Faults(rates={"429": 0.1, "500": 0.1, "timeout": 0.05, "drop": 0.05,
                                   "malformed": 0.05}, seed=0)) as srv:
        srv.url                    # "http://127.0.0.1:<port>/v1"; srv.stats counts every outcome
    python -m dflashkit.testing.faults '{"latency_s": [0.001, 0.01]}'   # prints its URL, serves forever

Answers are canned and deterministic: `canned_answer(messages)` (the test oracle) depends on the
whole conversation sent, so a client that feeds the wrong history gets a different answer. Faults
are deterministic by seed: the outcome of the n-th attempt of a given request body is drawn from
`Random(f"{seed}:{body hash}:{n}")`, independent of arrival order. After `max_faults_per_key`
faulty attempts a request succeeds; `always_fail` (a fraction of request bodies) answers 500 forever.
With no faults and no latency it answers from the protocol callback (the zero-latency bench server).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

FAULT_KINDS = ("429", "500", "timeout", "drop", "malformed")


@dataclass
class Faults:
    rates: dict[str, float] = field(default_factory=dict)   # kind -> probability per attempt
    seed: int = 0
    latency_s: tuple[float, float] = (0.0, 0.0)             # uniform per request
    retry_after: str = "0"                                    # Retry-After header on 429
    timeout_sleep_s: float = 5.0                              # how long a "timeout" stalls
    max_faults_per_key: int = 3
    always_fail: float = 0.0                                  # fraction of bodies that always get 500
    length_rate: float = 0.0                                  # fraction answered with finish_reason=length
    reasoning: bool = False                                   # add reasoning_content
    model: str = "fault-model"
    reject_token_ids: bool = False                            # 400 on `return_token_ids` (strict APIs)
    reject_fields: tuple[str, ...] = ()                       # 400 naming the first of these in a request


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def canned_answer(messages: list[dict[str, Any]]) -> str:
    """The deterministic answer for a conversation (turn number + hash of everything sent)."""
    n = sum(1 for m in messages if m.get("role") == "assistant")
    return f"answer {n} " + _digest(messages)[:12]


def _unit(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 0x100000000


def _response(status: int, body: bytes, extra: str = "", reason: str = "OK") -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


class _Proto(asyncio.Protocol):
    def __init__(self, server: "FaultServer"):
        self.srv = server
        self.buf = b""
        self.busy = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._drain()

    def _drain(self) -> None:
        while not self.busy and self.transport is not None and not self.transport.is_closing():
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1")
            lines = head.split("\r\n")
            length = 0
            for line in lines[1:]:
                low = line[:15].lower()
                if low == "content-length:":
                    length = int(line[15:].strip())
                elif low == "authorization: ":
                    self.srv.auth_seen.add(line[15:].strip())
            if len(self.buf) < head_end + 4 + length:
                return
            body = self.buf[head_end + 4: head_end + 4 + length]
            self.buf = self.buf[head_end + 4 + length:]
            parts = lines[0].split(" ")
            out = self.srv.handle(parts[0], parts[1] if len(parts) > 1 else "/", body)
            if isinstance(out, bytes):
                self.transport.write(out)
            else:
                self.busy = True
                asyncio.ensure_future(self._slow(out))

    async def _slow(self, action) -> None:
        delay, payload = action
        await asyncio.sleep(delay)
        if self.transport is None or self.transport.is_closing():
            return
        if payload is None:  # dropped connection: half a status line, then a hard close
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Le")
            self.transport.abort()
            return
        self.transport.write(payload)
        self.busy = False
        self._drain()

    def connection_lost(self, exc) -> None:
        self.transport = None


class FaultServer:
    """Run the fake server on its own event loop in a background thread."""

    def __init__(self, faults: Faults | None = None, host: str = "127.0.0.1", port: int = 0):
        self.faults = faults or Faults()
        self.host, self.port = host, port
        self.stats: Counter = Counter()
        self.attempts: Counter = Counter()
        self.auth_seen: set[str] = set()
        self.lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # -- request handling ------------------------------------------------------------------
    def handle(self, method: str, path: str, body: bytes):
        """bytes to write now, or (delay_s, bytes | None for a dropped connection)."""
        f = self.faults
        if method == "GET":
            if path.endswith("/models"):
                models = {"object": "list", "data": [{"id": f.model, "object": "model"}]}
                return _response(200, json.dumps(models).encode())
            if path.endswith("/health"):
                return _response(200, b'{"status":"ok"}')
            return _response(404, b'{"error":"not found"}', reason="Not Found")
        try:
            req = json.loads(body)
            messages = req["messages"]
        except (json.JSONDecodeError, KeyError, TypeError):
            return _response(400, b'{"error":"bad request"}', reason="Bad Request")
        if f.reject_token_ids and "return_token_ids" in req:
            with self.lock:
                self.stats["rejected_token_ids"] += 1
            return _response(400, b'{"error":{"message":"Unrecognized request argument: return_token_ids"}}',
                             reason="Bad Request")
        bad = next((k for k in f.reject_fields if k in req), None)
        if bad is not None:
            with self.lock:
                self.stats["rejected_fields"] += 1
            msg = json.dumps({"error": {"message": f"Unrecognized request argument supplied: {bad}"}})
            return _response(400, msg.encode(), reason="Bad Request")
        key = _digest(messages)
        with self.lock:
            n = self.attempts[key]
            self.attempts[key] += 1
            self.stats["requests"] += 1
        kind = None
        if f.always_fail and _unit(f"{f.seed}:always:{key}") < f.always_fail:
            kind = "500"
        elif n < f.max_faults_per_key and f.rates:
            u = random.Random(f"{f.seed}:{key}:{n}").random()
            acc = 0.0
            for k in FAULT_KINDS:
                acc += f.rates.get(k, 0.0)
                if u < acc:
                    kind = k
                    break
        with self.lock:
            self.stats[kind or "ok"] += 1
        lo, hi = f.latency_s
        delay = random.Random(f"{f.seed}:lat:{key}:{n}").uniform(lo, hi) if hi > 0 else 0.0
        if kind == "429":
            payload = _response(429, b'{"error":"rate limited"}', f"Retry-After: {f.retry_after}\r\n",
                                "Too Many Requests")
        elif kind == "500":
            payload = _response(500, b'{"error":"internal"}', reason="Internal Server Error")
        elif kind == "timeout":
            return (f.timeout_sleep_s, _response(200, self._completion(messages)))
        elif kind == "drop":
            return (delay, None)
        elif kind == "malformed":
            payload = _response(200, b'{"id":"x","choices":[{"message":{"content":"tru')
        else:
            payload = _response(200, self._completion(messages))
        return (delay, payload) if delay > 0 else payload

    def _completion(self, messages: list[dict[str, Any]]) -> bytes:
        f = self.faults
        text = canned_answer(messages)
        key = _digest(messages)
        finish = "length" if f.length_rate and _unit(f"{f.seed}:len:{key}") < f.length_rate else "stop"
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if f.reasoning:
            msg["reasoning_content"] = "thinking " + key[:6]
        ids = list(text.encode())
        choice: dict[str, Any] = {"index": 0, "message": msg, "finish_reason": finish}
        if not f.reject_token_ids:
            choice["token_ids"] = ids
        return json.dumps({
            "id": "chatcmpl-" + key[:16], "object": "chat.completion", "model": f.model,
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(ids), "total_tokens": len(ids) + 1},
        }).encode()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "FaultServer":
        ready = threading.Event()

        def main() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            server = self._server = self._loop.run_until_complete(
                self._loop.create_server(lambda: _Proto(self), self.host, self.port, backlog=1024))
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            server.close()
            self._loop.run_until_complete(server.wait_closed())
            self._loop.close()

        self._thread = threading.Thread(target=main, name="fault-server", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> "FaultServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """`python -m dflashkit.testing.faults '<Faults JSON>' [port]`: print the URL, serve until killed."""
    argv = sys.argv[1:] if argv is None else argv
    opts = json.loads(argv[0]) if argv else {}
    if "latency_s" in opts:
        opts["latency_s"] = tuple(opts["latency_s"])
    srv = FaultServer(Faults(**opts), port=int(argv[1]) if len(argv) > 1 else 0).start()
    print(srv.url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    main()
