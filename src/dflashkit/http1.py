"""A minimal keep-alive HTTP/1.1 client on asyncio protocols: dflashkit's one HTTP client.

Usage:
    http = Http1Client(timeout_s=600, headers={"Authorization": "Bearer …"})
    status, headers, body = await http.request("POST", "http://127.0.0.1:8000/v1/chat/completions", payload)
    await http.aclose()
    models = get_json("http://127.0.0.1:8000/v1/models", timeout_s=5)     # from synchronous code
    reply = post_json(url + "/chat/completions", {"messages": [...]})     # raises HttpStatusError on non-2xx

Why: a chat request through httpx/httpcore/anyio costs milliseconds of client CPU on a busy
2-core box, aiohttp about 2.4x this client's; this one costs tens of microseconds, so `generate`
is never the bottleneck of a fast server fleet (`dflashkit bench generate`; the numbers are in
docs/architecture.md). It is the one HTTP client of the library: `generate`'s hot path, and through
`request_sync` / `get_json` / `post_json` the health checks, `doctor`, `bench serve`, the engines'
metrics and verify-engine (httpx is a test-only dependency: an independent client for the server's
tests). It speaks exactly what
OpenAI-compatible servers answer: Content-Length, chunked, or read-until-close bodies; http and
https; one request per connection at a time (no pipelining); idle connections are reused per
host. Not supported: HTTP proxies and HTTP/2.
Errors: `HttpTimeout`, `HttpConnectError`, `HttpDropped` (connection closed mid-response); their
messages show URLs redacted (`dflashkit.redact`). A URL's `user:password@` is sent as HTTP Basic auth
(unless the client has its own Authorization header), never in the Host header.
Secrets: the client registers every credential it sends (`redact.remember_header` for its headers,
a URL's user info), and every response it returns comes with them masked: a 2xx body where a whole
secret appears, an error's body and header values also where 8 or more of a secret's first or last
characters do (`redact.mask_bytes`), and every `HttpError` message. So a server that echoes the API
key in a 401 cannot put it into a failure record, a manifest or a log line.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import ssl
from typing import Any
from urllib.parse import unquote, urlsplit

from dflashkit.redact import mask_bytes, mask_secrets, redact_text, redact_url, remember_header, remember_secret


class HttpError(Exception):
    """Every HTTP failure; its message has the URLs redacted and the credentials sent masked (`redact_text`)."""

    def __init__(self, message: str = ""):
        super().__init__(redact_text(message))


class HttpTimeout(HttpError):
    pass


class HttpConnectError(HttpError):
    pass


class HttpDropped(HttpError):
    pass


class HttpStatusError(HttpError):
    """A complete response with a non-2xx status (`get_json` / `post_json`)."""

    def __init__(self, url: str, status: int, body: bytes, headers: dict[str, str] | None = None):
        super().__init__(f"{redact_url(url)}: HTTP {status} ({excerpt(headers or {}, body, 200)})")
        self.status, self.body = status, body


class _Conn(asyncio.Protocol):
    """One connection; `send` returns a future of (status, headers, body, keep_alive)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] | None = None
        self.length: int | None = None
        self.chunked = False
        self.head_only = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def send(self, data: bytes, head_only: bool = False) -> asyncio.Future:
        self._reset()
        self.head_only = head_only
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(data)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None and not self.waiter.done():
            try:
                self._parse()
            except (ValueError, IndexError) as e:
                self._fail(HttpDropped(f"unparsable response: {e}"))

    def _parse(self) -> None:
        buf = self.buf
        if self.headers is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            self.status = int(lines[0].split(" ", 2)[1])
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            self.headers = headers
            del buf[: end + 4]
            if self.status in (204, 304) or 100 <= self.status < 200 or self.head_only:
                self.length = 0
            elif "chunked" in headers.get("transfer-encoding", "").lower():
                self.chunked = True
            elif "content-length" in headers:
                self.length = int(headers["content-length"])
        if self.chunked:
            body = self._dechunk()
            if body is not None:
                self._done(body)
        elif self.length is not None and len(buf) >= self.length:
            body = bytes(buf[: self.length])
            del buf[: self.length]
            self._done(body)

    def _dechunk(self) -> bytes | None:
        out, pos, buf = bytearray(), 0, self.buf
        while True:
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                return None
            size = int(bytes(buf[pos:nl]).split(b";")[0], 16)
            if size == 0:
                end = buf.find(b"\r\n\r\n", nl)  # optional trailers end with an empty line
                if end < 0:
                    if buf[nl + 2: nl + 4] == b"\r\n":
                        end = nl
                    else:
                        return None
                del buf[: end + 4]
                return bytes(out)
            if len(buf) < nl + 2 + size + 2:
                return None
            out += buf[nl + 2: nl + 2 + size]
            pos = nl + 2 + size + 2

    def _done(self, body: bytes) -> None:
        assert self.headers is not None
        keep = self.headers.get("connection", "").lower() != "close"
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.status, self.headers, body, keep))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self.headers is not None and self.length is None and not self.chunked:
                self._done(bytes(self.buf))  # body delimited by the close
            else:
                self.waiter.set_exception(HttpDropped("connection closed mid-response"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Http1Client:
    """Keep-alive connection pools per (scheme, host, port); safe for many concurrent tasks."""

    def __init__(self, *, timeout_s: float = 600.0, headers: dict[str, str] | None = None):
        self.timeout_s = timeout_s
        for k, v in (headers or {}).items():
            remember_header(k, v)
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def _connect(self, scheme: str, host: str, port: int) -> _Conn:
        loop = asyncio.get_running_loop()
        kw: dict[str, Any] = {}
        if scheme == "https":
            self._ssl = self._ssl or ssl.create_default_context()
            kw = {"ssl": self._ssl, "server_hostname": host}
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, host, port, **kw),
                                             timeout=min(self.timeout_s, 30.0))
        except asyncio.TimeoutError:
            raise HttpConnectError(f"connect to {host}:{port} timed out") from None
        except OSError as e:
            raise HttpConnectError(f"{host}:{port}: {e}") from None
        return conn

    async def request(self, method: str, url: str, body: bytes = b"",
                      ) -> tuple[int, dict[str, str], bytes]:
        parts = urlsplit(url)
        scheme = parts.scheme or "http"
        port = parts.port or (443 if scheme == "https" else 80)
        host = parts.hostname or "127.0.0.1"
        key = (scheme, host, port)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        netloc, headers = parts.netloc, self.headers
        if "@" in netloc:  # user info: Basic auth, and never in the Host header
            netloc = netloc.rpartition("@")[2]
            _remember_userinfo(parts.username, parts.password)
            headers += _basic_auth(parts.username, parts.password, headers)
        head = (f"{method} {target} HTTP/1.1\r\nHost: {netloc}\r\nAccept: */*\r\n{headers}"
                f"Content-Length: {len(body)}\r\n\r\n") if method != "GET" else \
            f"GET {target} HTTP/1.1\r\nHost: {netloc}\r\nAccept: */*\r\n{headers}\r\n"
        data = head.encode("latin-1") + body
        idle = self._idle.setdefault(key, [])
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            try:
                return await self._exchange(conn, data, idle, method)
            except HttpDropped:
                if conn.headers is not None or conn.buf:
                    raise  # the server did answer something: a real mid-response drop
                # a kept-alive connection the server had already closed: try a fresh one
        conn = await self._connect(scheme, host, port)
        return await self._exchange(conn, data, idle, method)

    async def _exchange(self, conn: _Conn, data: bytes, idle: list[_Conn], method: str,
                        ) -> tuple[int, dict[str, str], bytes]:
        fut = conn.send(data, head_only=method == "HEAD")
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.timeout_s, conn._fail, HttpTimeout(f"no response within {self.timeout_s}s"))
        try:
            status, headers, body, keep = await fut
        except asyncio.CancelledError:
            conn.close()
            raise
        finally:
            timer.cancel()
        if keep and not conn.closed:
            idle.append(conn)
        else:
            conn.close()
        ok = 200 <= status < 300
        if not ok:
            headers = {k: mask_secrets(v) for k, v in headers.items()}
        return status, headers, mask_bytes(body, partial=not ok)

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()


JSON_HEADERS = {"Content-Type": "application/json"}


def _remember_userinfo(user: str | None, password: str | None) -> None:
    """Register a URL's credentials as sent: the password (as written and decoded), `user:password` and its
    Basic token."""
    if user is None:
        return
    remember_secret(password)
    remember_secret(unquote(password or ""))
    remember_header("Authorization", "Basic " + base64.b64encode(
        f"{unquote(user)}:{unquote(password or '')}".encode()).decode("ascii"))


def _basic_auth(user: str | None, password: str | None, headers: str) -> str:
    """The Authorization header line for a URL's user info (none when there is none, or the client has one)."""
    if user is None or "\nauthorization:" in "\n" + headers.lower():
        return ""

    token = base64.b64encode(f"{unquote(user)}:{unquote(password or '')}".encode()).decode("ascii")
    return f"Authorization: Basic {token}\r\n"


def request_sync(method: str, url: str, body: bytes = b"", *, headers: dict[str, str] | None = None,
                 timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One request from synchronous code (its own event loop and connection): status, headers, body.

    Raises: HttpTimeout, HttpConnectError, HttpDropped (never for a non-2xx status).
    """
    async def one() -> tuple[int, dict[str, str], bytes]:
        http = Http1Client(timeout_s=timeout_s, headers=headers)
        try:
            return await http.request(method, url, body)
        finally:
            await http.aclose()

    return asyncio.run(one())


def excerpt(headers: dict[str, str], body: bytes, limit: int = 120) -> str:
    """What answered, in one short line: the content type and an HTML page's <title> or the body's start."""
    kind = headers.get("content-type", "").split(";")[0].strip() or "body"
    text = body[:4096].decode("utf-8", "replace")
    title = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
    if title:
        text = title.group(1)
    elif "html" in kind:
        text = re.sub(r"<[^>]+>", " ", text)
    text = " ".join(text.split())
    return f"{kind}: {text[:limit] + ('…' if len(text) > limit else '')!r}"


def _json(url: str, status: int, body: bytes, headers: dict[str, str] | None = None) -> Any:
    if not 200 <= status < 300:
        raise HttpStatusError(url, status, body, headers)
    try:
        return json.loads(body)
    except ValueError:
        raise HttpError(f"{redact_url(url)}: the reply is not JSON: {body[:200]!r}") from None


def get_json(url: str, *, headers: dict[str, str] | None = None, timeout_s: float = 30.0) -> Any:
    """GET `url` and decode its JSON body; HttpStatusError on a non-2xx status, HttpError on non-JSON."""
    status, got, body = request_sync("GET", url, headers=headers, timeout_s=timeout_s)
    return _json(url, status, body, got)


def post_json(url: str, payload: Any, *, headers: dict[str, str] | None = None, timeout_s: float = 600.0) -> Any:
    """POST `payload` as JSON to `url` and decode the JSON reply (errors as get_json)."""
    status, got, body = request_sync("POST", url, json.dumps(payload).encode(),
                                     headers={**JSON_HEADERS, **(headers or {})}, timeout_s=timeout_s)
    return _json(url, status, body, got)
