"""`dflashkit serve` cancels the request of a client that disconnects, streaming or not.

A long request (1500 tokens) is sent over a raw socket that is closed after the first bytes of
the answer (streaming) or after a moment (non-streaming): the engine must count one cancellation,
free the batch row (nothing in flight, the running batch empty) well before the request could
have finished, log one line instead of a traceback, and then serve the next client normally.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest

from tests.harness.servers import serving


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    with serving({"target": {"path": str(tiny_qwen3)}, "serve": {"max_batch": 4, "model_name": "tiny"}}) as s:
        yield s


def _send(url: str, body: dict) -> socket.socket:
    host, port = url.split("//")[1].split("/")[0].split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def _wait_idle(app, cancelled: int, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if app.engine.metrics["cancelled"] == cancelled and app.in_flight == 0 and not app.engine.rows:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"not cancelled: metrics {app.engine.metrics}, in_flight {app.in_flight}, "
                         f"rows {len(app.engine.rows)}")


@pytest.mark.parametrize("stream", [False, True])
def test_disconnected_client_frees_its_batch_row(served, stream, caplog):
    app, url = served
    before = app.engine.metrics["cancelled"]
    done_before = app.engine.metrics["requests"]
    body = {"prompt": [10, 20, 30, 40], "max_tokens": 1500, "temperature": 0, "stream": stream}
    with caplog.at_level(logging.INFO, logger="dflashkit.serve"):
        sock = _send(url, body)
        if stream:
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # the stream has started
        else:
            deadline = time.monotonic() + 60
            while not app.engine.rows and time.monotonic() < deadline:  # decoding has started
                time.sleep(0.01)
            assert app.engine.rows
        sock.close()
        took = _wait_idle(app, before + 1)
    assert took < 2.0
    assert app.engine.metrics["requests"] == done_before  # it never ran to its 1500 tokens
    assert any("disconnected" in r.getMessage() for r in caplog.records)
    assert not any(r.exc_info for r in caplog.records), "a traceback was logged"
    # the freed row serves the next client normally
    r = httpx.post(url + "/completions", json={"prompt": [1, 2, 3], "max_tokens": 5}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
