"""The recording proxy of `dflashkit record`: any OpenAI-compatible server (vLLM, SGLang) behind it, every
answered chat / completions request recorded (`serving.record`).

Usage:
    proxy = RecordingProxy("http://127.0.0.1:8000/v1", recorder, timeout_s=600, api_key=None)
    server = proxy.make_server("127.0.0.1", 8001)      # clients use http://127.0.0.1:8001/v1
    server.serve_forever()

Pass-through: the request's method, path (`/v1/...` mapped onto the upstream's base path), query, body and
headers (all but the hop-by-hop ones and Host; `Accept-Encoding: identity`, so streams stay parseable) go
upstream as they came; the answer comes back byte for byte. A stream (`text/event-stream`) is relayed event
by event as the upstream sends them, and assembled beside (`record.Assembler`). The upstream is reached
with the stdlib `http.client`, one connection per request: `http1` hands back whole bodies, a proxy must
relay a stream as it arrives.

Recording: a 200 answer to POST …/chat/completions or …/completions is recorded before its last bytes
reach the client: the whole non-streamed body after the record is on disk, a stream's `data: [DONE]`
event likewise. A stream that ends without `[DONE]`, an error status, a client that goes away: not
recorded. A record that cannot be written fails the request (503, or a stream without `[DONE]`).
Credentials: the upstream URL's `user:password@` is sent as Basic auth, `api_key` (record.api_key_env)
as a Bearer token when the client sends no Authorization; both, and every credential header a client
sends, are registered with `redact` (so the recorder masks them if a body quotes them); headers are never
recorded, and log lines show the upstream redacted.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import re
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from dflashkit.errors import UsageError
from dflashkit.redact import redact_text, redact_url, remember_header, remember_secret
from dflashkit.serving.record import Assembler, Recorder, add_reply, reply_of, request_record

log = logging.getLogger("dflashkit.record")

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding"}
RECORDED = {"/chat/completions": True, "/completions": False}  # upstream-relative path → chat
EVENT_END = re.compile(rb"\r?\n\r?\n")
DISCONNECTS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class Upstream:
    """The upstream's parts: scheme, host, port, base path, and its URL credentials as a Basic header."""

    def __init__(self, url: str):
        u = urlsplit(url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UsageError(f"record.upstream {redact_url(url)!r} is not an http(s) URL",
                             hint="pass --upstream http://HOST:PORT/v1")
        self.https = u.scheme == "https"
        self.host, self.port = u.hostname, u.port or (443 if self.https else 80)
        self.base = u.path.rstrip("/") or "/v1"  # a URL without a path: the usual /v1
        self.shown = redact_url(url)
        self.basic: str | None = None
        if u.username is not None or u.password is not None:
            user, pw = unquote(u.username or ""), unquote(u.password or "")
            remember_secret(pw)
            remember_secret(f"{user}:{pw}")
            self.basic = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
            remember_secret(self.basic.split(" ", 1)[1])

    def path_for(self, path: str) -> str:
        """The upstream path of a client path: `/v1/x` → `<base>/x`; anything else as it is."""
        if path == "/v1" or path.startswith("/v1/") or path.startswith("/v1?"):
            return self.base + path[3:]
        return path

    def connect(self, timeout_s: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout_s)


class RecordingProxy:
    """See the module docstring."""

    def __init__(self, upstream: str, recorder: Recorder, *, timeout_s: float = 600.0, api_key: str | None = None):
        self.upstream, self.recorder, self.timeout_s = Upstream(upstream), recorder, timeout_s
        self.api_key = api_key
        if api_key:
            remember_secret(api_key)
        self.requests = self.recorded = self.failed = 0

    def headers_for(self, incoming: Any) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, value in incoming.items():
            if name.lower() in HOP_BY_HOP:
                continue
            remember_header(name, value)
            out[name] = value
        if not any(k.lower() == "authorization" for k in out):
            if self.upstream.basic:
                out["Authorization"] = self.upstream.basic
            elif self.api_key:
                out["Authorization"] = f"Bearer {self.api_key}"
        out["Accept-Encoding"] = "identity"
        return out

    def make_server(self, host: str, port: int) -> ThreadingHTTPServer:
        handler = type("BoundProxyHandler", (ProxyHandler,), {"proxy": self})
        server = _ProxyServer((host, port), handler)
        server.daemon_threads = True
        return server


class ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dflashkit-record"
    proxy: RecordingProxy

    def log_message(self, fmt: str, *args) -> None:  # the request line only (never headers), a key in it hidden
        log.debug("%s %s", self.address_string(), redact_text(fmt % args))

    def do_GET(self) -> None:  # noqa: N802
        self._relay("GET", b"")

    def do_DELETE(self) -> None:  # noqa: N802
        self._relay("DELETE", b"")

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        self._relay("POST", self.rfile.read(length) if length else b"")

    def _error(self, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "proxy_error", "code": status}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _relay(self, method: str, raw: bytes) -> None:
        p, t0 = self.proxy, time.time()
        path = p.upstream.path_for(self.path)
        route = path[len(p.upstream.base):].split("?")[0].rstrip("/") if path.startswith(p.upstream.base) else ""
        body: Any = None
        if method == "POST" and route in RECORDED:
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = None
            body = body if isinstance(body, dict) else None
        p.requests += 1
        conn = p.upstream.connect(p.timeout_s)
        try:
            conn.request(method, path, body=raw or None, headers=p.headers_for(self.headers))
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            log.warning("upstream %s: %s: %s", p.upstream.shown, type(e).__name__, e)
            return self._error(502, f"upstream {p.upstream.shown} did not answer ({type(e).__name__})")
        try:
            ctype = resp.getheader("Content-Type") or ""
            record = body is not None and resp.status == 200
            if "text/event-stream" in ctype:
                self._relay_stream(resp, body if record else None, RECORDED.get(route, False), t0)
            else:
                data = resp.read()
                if record:
                    try:
                        reply = reply_of(json.loads(data))
                    except (ValueError, AttributeError, IndexError, TypeError):
                        reply = None
                    if reply is not None and not self._record(body, RECORDED[route], reply, t0):
                        return self._error(503, "the request could not be recorded (record.dir)")
                self.send_response(resp.status)
                self._copy_headers(resp)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
        except DISCONNECTS:
            self.close_connection = True
        except (OSError, http.client.HTTPException) as e:  # the upstream dropped mid-answer: not acknowledged
            log.warning("upstream %s dropped the answer: %s", p.upstream.shown, type(e).__name__)
            self.close_connection = True
        finally:
            conn.close()

    def _copy_headers(self, resp: http.client.HTTPResponse) -> None:
        for name, value in resp.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)

    def _record(self, body: dict[str, Any], chat: bool, reply: dict[str, Any], t0: float) -> bool:
        p = self.proxy
        try:
            p.recorder.write(add_reply(request_record(body, chat, t0=t0), reply))
        except OSError as e:
            p.failed += 1
            log.error("recording failed (%s: %s); the request fails rather than go unrecorded", type(e).__name__, e)
            return False
        p.recorded += 1
        return True

    def _relay_stream(self, resp: http.client.HTTPResponse, body: dict[str, Any] | None, chat: bool,
                      t0: float) -> None:
        """Relay a Server-Sent-Events answer event by event; record (when `body`) before `[DONE]` goes out."""
        self.send_response(resp.status)
        self._copy_headers(resp)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        asm, held = Assembler(), b""
        while True:
            data = resp.read1(65536)
            if not data:
                break
            held += data
            out: list[bytes] = []
            start = 0
            for m in EVENT_END.finditer(held):
                event = held[start:m.end()]
                start = m.end()
                asm.feed(event)
                if asm.done and body is not None:
                    if out:
                        self.wfile.write(b"".join(out))
                        out = []
                    if not self._record(body, chat, asm.reply(), t0):
                        return
                    body = None
                out.append(event)
            held = held[start:]
            if out:
                self.wfile.write(b"".join(out))
                self.wfile.flush()
        if held:
            self.wfile.write(held)
            self.wfile.flush()


class _ProxyServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        import sys

        if isinstance(sys.exc_info()[1], DISCONNECTS):
            return
        super().handle_error(request, client_address)
