"""A stub OpenAI-compatible upstream on 127.0.0.1 (no model): what `bench record` and the proxy's tests put
behind `dflashkit record`.

Usage:
    with stub_upstream(chunks=8, delay_s=0.0) as url:      # "http://127.0.0.1:<port>/v1"
        ...
    python -m dflashkit.testing.upstream --port 0 --chunks 8 --delay 0.02   # prints its URL, serves until killed

It answers GET /v1/models (model "stub") and POST /v1/chat/completions and /v1/completions, streamed or not:
the reply is `chunks` words "w0 w1 …" (one SSE event each, `delay_s` apart), token ids 0 … chunks−1 (as vLLM's
`return_token_ids`), then a final event with finish_reason "stop" and `data: [DONE]`. With `echo_auth`
the reply starts with the request's Authorization header: a server that quotes a credential back.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator


def _handler(chunks: int, delay_s: float, echo_auth: bool) -> type[BaseHTTPRequestHandler]:
    class Stub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args) -> None:
            pass

        def _json(self, status: int, obj: Any) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") == "/v1/models":
                return self._json(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})
            self._json(404, {"error": {"message": "no route"}})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            path = self.path.rstrip("/")
            if path not in ("/v1/chat/completions", "/v1/completions"):
                return self._json(404, {"error": {"message": "no route"}})
            chat = path.endswith("chat/completions")
            words = [f"w{i} " for i in range(chunks)]
            if echo_auth:
                words[0] = f"auth={self.headers.get('Authorization', '')} " + words[0]
            if not body.get("stream"):
                if delay_s:
                    time.sleep(delay_s * chunks)
                text = "".join(words)
                choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "token_ids": list(range(chunks))}
                choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                return self._json(200, {"id": "stub-1", "object": "chat.completion", "model": "stub",
                                        "choices": [choice], "prompt_token_ids": [1, 2, 3]})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            for i, w in enumerate(words):
                c: dict[str, Any] = {"index": 0, "finish_reason": None, "token_ids": [i]}
                c.update({"delta": {"content": w}} if chat else {"text": w})
                self.wfile.write(b"data: " + json.dumps({"model": "stub", "choices": [c]}).encode() + b"\n\n")
                self.wfile.flush()
                if delay_s:
                    time.sleep(delay_s)
            end: dict[str, Any] = {"index": 0, "finish_reason": "stop", **({"delta": {}} if chat else {"text": ""})}
            self.wfile.write(b"data: " + json.dumps({"model": "stub", "choices": [end]}).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Stub


@contextmanager
def stub_upstream(*, chunks: int = 8, delay_s: float = 0.0, echo_auth: bool = False,
                  port: int = 0) -> Iterator[str]:
    """Serve the stub from a thread on 127.0.0.1; yield its base URL (…/v1)."""
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(chunks, delay_s, echo_auth))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="stub OpenAI-compatible upstream (tests, bench record)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--echo-auth", action="store_true")
    a = ap.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", a.port), _handler(a.chunks, a.delay, a.echo_auth))
    server.daemon_threads = True
    print(f"http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
    try:
        server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
