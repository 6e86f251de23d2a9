"""The lean HTTP/1.1 client against raw socket servers: framing, keep-alive, drops, timeouts."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from dflashkit.http1 import Http1Client, HttpConnectError, HttpDropped, HttpTimeout


class RawServer:
    """Answers each request with the next canned byte string; `None` closes without answering."""

    def __init__(self, replies: list[bytes | None], delay: float = 0.0):
        self.replies, self.delay = list(replies), delay
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while self.replies:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, rest = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(rest) < length:
                    rest += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + rest[:length])
                buf = rest[length:]
                reply = self.replies.pop(0)
                time.sleep(self.delay)
                if reply is None:
                    return
                close = reply.endswith(b"<CLOSE>")
                conn.sendall(reply.removesuffix(b"<CLOSE>"))
                if close or b"Connection: close" in reply:
                    return

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/x"


def run(coro):
    return asyncio.run(coro)


def test_content_length_chunked_and_close_delimited_with_keep_alive():
    body = json.dumps({"ok": 1}).encode()
    srv = RawServer([
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4;x=1\r\ndefg\r\n0\r\n\r\n",
        b"HTTP/1.1 429 Too Many\r\nRetry-After: 2\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    ])

    async def go():
        http = Http1Client(timeout_s=5, headers={"Authorization": "Bearer k"})
        out = [await http.request("POST", srv.url, b'{"a":1}') for _ in range(4)]
        await http.aclose()
        return out

    out = run(go())
    assert out[0][0] == 200 and json.loads(out[0][2]) == {"ok": 1}
    assert out[1][2] == b"abcdefg"
    assert out[2][0] == 429 and out[2][1]["retry-after"] == "2"
    assert out[3][2] == b"until the end"
    assert srv.connections == 1  # one kept-alive connection for all four
    assert all(b"Authorization: Bearer k" in r and r.endswith(b'{"a":1}') for r in srv.requests)


def test_drop_mid_response_and_timeout_and_refused():
    srv = RawServer([b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nonly part<CLOSE>"])

    async def go(url, timeout=5.0):
        http = Http1Client(timeout_s=timeout)
        try:
            return await http.request("POST", url, b"{}")
        finally:
            await http.aclose()

    with pytest.raises(HttpDropped):
        run(go(srv.url))
    slow = RawServer([b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"], delay=10.0)  # a daemon thread: no wait
    t0 = time.monotonic()
    with pytest.raises(HttpTimeout):
        run(go(slow.url, timeout=0.2))
    assert time.monotonic() - t0 < 5.0  # gave up at its timeout, not at the reply (a loaded machine stalls for seconds)
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with pytest.raises(HttpConnectError):
        run(go(f"http://127.0.0.1:{port}/v1"))


def test_stale_keep_alive_connection_is_replaced():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi"
    srv = RawServer([ok, None, ok])  # after the first answer the server closes the idle connection

    async def go():
        http = Http1Client(timeout_s=5)
        a = await http.request("POST", srv.url, b"{}")
        await asyncio.sleep(0.05)
        b = await http.request("POST", srv.url, b"{}")
        await http.aclose()
        return a, b

    a, b = run(go())
    assert a[2] == b[2] == b"hi" and srv.connections == 2


def test_sync_json_helpers_send_json_and_raise_on_status_and_non_json():
    from dflashkit.http1 import HttpError, HttpStatusError, get_json, post_json

    ok = json.dumps({"data": [{"id": "m"}]}).encode()
    srv = RawServer([
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(ok) + ok,
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(ok) + ok,
        b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nnot",
    ])
    assert get_json(srv.url, timeout_s=5) == {"data": [{"id": "m"}]}
    assert post_json(srv.url, {"q": [1, 2]}, headers={"Authorization": "Bearer k"}, timeout_s=5)["data"][0]["id"] == "m"
    post = srv.requests[1]
    assert post.startswith(b"POST /v1/x ") and b"Content-Type: application/json" in post
    assert b"Authorization: Bearer k" in post and json.loads(post.partition(b"\r\n\r\n")[2]) == {"q": [1, 2]}
    with pytest.raises(HttpStatusError) as e:
        get_json(srv.url, timeout_s=5)
    assert e.value.status == 503 and "busy" in str(e.value)
    with pytest.raises(HttpError, match="not JSON"):
        get_json(srv.url, timeout_s=5)


def test_user_info_is_basic_auth_never_the_host_header_and_errors_are_redacted():
    import base64

    from dflashkit.http1 import HttpStatusError, get_json

    page = b"<html><head><title>Not Found</title></head><body>" + b"<p>x</p>" * 500 + b"</body></html>"
    ok = b'{"data": []}'
    srv = RawServer([b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(ok) + ok,
                     b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(ok) + ok,
                     b"HTTP/1.1 404 Not Found\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n" % len(page)
                     + page])
    url = srv.url.replace("http://", "http://al%40ice:p%3Aw@")  # percent-encoded user and password
    assert get_json(url, timeout_s=5) == {"data": []}
    head = srv.requests[0].split(b"\r\n\r\n")[0].decode()
    assert f"Host: 127.0.0.1:{srv.port}\r\n" in head and "p%3Aw" not in head and "ice" not in head
    assert f"Authorization: Basic {base64.b64encode(b'al@ice:p:w').decode()}" in head
    get_json(url, headers={"Authorization": "Bearer k"}, timeout_s=5)  # the client's own header wins
    head = srv.requests[1].split(b"\r\n\r\n")[0].decode()
    assert "Authorization: Bearer k" in head and "Basic" not in head
    with pytest.raises(HttpStatusError) as e:
        get_json(url, timeout_s=5)
    msg = str(e.value)
    assert "p%3Aw" not in msg and "http://***@127.0.0.1" in msg and "HTTP 404 (text/html: 'Not Found')" in msg, msg
    assert "<p>" not in msg and len(msg) < 200
