"""`dflashkit bench record`: the latency the recording proxy adds, against a local stub upstream.

Usage:
    dflashkit bench record -c run.yaml bench.requests=200 bench.max_tokens=64

A stub OpenAI server (`testing.upstream`: no model, `bench.max_tokens` SSE events of one word each, no
delay) and the proxy (`serving.proxy`, recording into a temp dir with fsync, as in production) run in this
process on 127.0.0.1. The same requests are sent one at a time, in turns, straight to the stub and through
the proxy: a streamed chat request (time to the first body byte, and to `[DONE]`) and a non-streamed one
(total). Each row gives the median and p90 of both paths and the median added by the proxy; `bench.warmup`
requests per path are sent first and not timed. The client is stdlib `http.client`, a fresh connection
per request on both paths, as the proxy opens one upstream.
"""

from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from dflashkit.serving.proxy import RecordingProxy
from dflashkit.serving.record import Recorder, RecordPolicy
from dflashkit.testing.upstream import stub_upstream

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir


def _one(base: str, stream: bool) -> tuple[float, float]:
    """(seconds to the first body byte, seconds to the end) of one chat request to `base` (…/v1)."""
    u = urlsplit(base)
    body = json.dumps({"messages": [{"role": "user", "content": "Say something."}], "stream": stream}).encode()
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=60)
    try:
        conn.request("POST", u.path + "/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = resp.read1(1) if stream else resp.read()
        t1 = time.perf_counter()
        rest = resp.read()
        t2 = time.perf_counter()
        if resp.status != 200 or (stream and b"[DONE]" not in first + rest):
            raise RuntimeError(f"bench record: {base} answered {resp.status}")
    finally:
        conn.close()
    return t1 - t0, t2 - t0


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": round(1e3 * statistics.median(xs), 3), "p90_ms": round(1e3 * xs[int(0.9 * (len(xs) - 1))], 3)}


def bench_record(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    n, warm, chunks = max(1, cfg.bench.requests), max(0, cfg.bench.warmup), max(1, cfg.bench.max_tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dflashkit-bench-record-") as tmp, \
            stub_upstream(chunks=chunks) as direct:
        rec = Recorder(tmp, fingerprint="bench", policy=RecordPolicy.from_config(cfg)).open()
        proxy = RecordingProxy(direct, rec)
        server = proxy.make_server("127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        proxied = f"http://127.0.0.1:{server.server_address[1]}/v1"
        try:
            for label, stream in (("stream", True), ("non-stream", False)):
                got: dict[str, list[tuple[float, float]]] = {"direct": [], "proxy": []}
                for i in range(warm + n):
                    for path, url in (("direct", direct), ("proxy", proxied)):
                        t = _one(url, stream)
                        if i >= warm:
                            got[path].append(t)
                row: dict[str, Any] = {"request": label, "requests": n}
                for path in ("direct", "proxy"):
                    if stream:
                        row[f"{path}_ttfb"] = _stats([a for a, _ in got[path]])
                    row[f"{path}_total"] = _stats([b for _, b in got[path]])
                if stream:
                    row["added_ttfb_ms"] = round(row["proxy_ttfb"]["p50_ms"] - row["direct_ttfb"]["p50_ms"], 3)
                row["added_total_ms"] = round(row["proxy_total"]["p50_ms"] - row["direct_total"]["p50_ms"], 3)
                rows.append(row)
        finally:
            server.shutdown()
            server.server_close()
            rec.close()
        recorded = proxy.recorded
    if not ctx.json:
        print(f"recording proxy vs direct, {n} requests each (medians; {chunks} SSE events a reply; "
              f"stub upstream on 127.0.0.1; {recorded} records fsync'd)", flush=True)
        print(f"{'request':>11} {'direct ttfb':>12} {'proxy ttfb':>11} {'+ttfb':>8} {'direct total':>13} "
              f"{'proxy total':>12} {'+total':>8}   (ms)", flush=True)
        for r in rows:
            dt, pt = r.get("direct_ttfb", {}).get("p50_ms"), r.get("proxy_ttfb", {}).get("p50_ms")
            f = (lambda v: f"{v:.3f}" if v is not None else "-")
            print(f"{r['request']:>11} {f(dt):>12} {f(pt):>11} {f(r.get('added_ttfb_ms')):>8} "
                  f"{r['direct_total']['p50_ms']:>13.3f} {r['proxy_total']['p50_ms']:>12.3f} "
                  f"{r['added_total_ms']:>8.3f}", flush=True)
    return {"rows": rows, "sse_events": chunks, "recorded": recorded}
