"""`dflashkit bench generate`: the generate client's overhead against a zero-latency server.

Usage:
    dflashkit bench generate -c run.yaml bench.generate_requests=4000

`bench_generate` starts the zero-latency canned server (`testing.faults`, a raw asyncio HTTP/1.1
server) in its own process, so the numbers are the client's: requests/s and client CPU seconds per
request (`time.process_time`) for (a) `OpenAIClient.chat` alone and (b) the `generate` stage's loop
(`generate.regenerate.generate_conversations`: reading prepared conversations, request bodies,
journal lines with batched fsync, final assembly) on single-turn conversations.
Warm-up requests are excluded from every number.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit.config import config_from_dict
from dflashkit.data.records import read_prepared
from dflashkit.errors import ServerError
from dflashkit.generate.openai_client import OpenAIClient
from dflashkit.generate.regenerate import generate_conversations

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.bench")


def spawn_canned_server(options: dict[str, Any] | None = None) -> tuple[subprocess.Popen, str]:
    """Start `python -m dflashkit.testing.faults` in its own process; return (process, base URL)."""
    proc = subprocess.Popen([sys.executable, "-m", "dflashkit.testing.faults", json.dumps(options or {})],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    url = proc.stdout.readline().decode().strip()
    if not url.startswith("http"):
        proc.kill()

        raise ServerError("the zero-latency bench server did not start")
    return proc, url


async def _client_rate(url: str, n: int, concurrency: int, warmup: int) -> dict[str, float]:
    async with OpenAIClient([url], concurrency=concurrency, max_retries=0, timeout_s=30) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

        async def burst(k: int) -> None:
            await asyncio.gather(*(client.chat({**body, "seed": i}) for i in range(k)))

        await burst(warmup)
        cpu0, t0 = time.process_time(), time.perf_counter()
        await burst(n)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"requests": n, "wall_s": round(wall, 4), "requests_per_s": round(n / wall, 1),
            "client_cpu_s_per_request": cpu / n, "client_cpu_us_per_request": round(1e6 * cpu / n, 1)}


def _stage_rate(url: str, n: int, concurrency: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="dflashkit-bench-") as tmp:
        src = Path(tmp) / "prompts.jsonl"
        lines = [json.dumps({"id": f"{i:016x}", "source": "bench",
                             "messages": [{"role": "user", "content": f"prompt {i}"}]}) for i in range(n)]
        src.write_text("\n".join(lines) + "\n")
        cfg = config_from_dict({"run": {"run_dir": tmp}, "server": {"urls": [url], "model": "m"},
                                "generate": {"concurrency": concurrency, "progress": False, "max_tokens": 8}})
        cpu0, t0 = time.process_time(), time.perf_counter()
        stage_dir = Path(tmp) / "generate"
        stage_dir.mkdir()
        out = generate_conversations(cfg, read_prepared(src), stage_dir, servers=lambda: [url])
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert out.summary["turns_ok"] == n
    return {"requests": n, "wall_s": round(wall, 4), "requests_per_s": round(n / wall, 1),
            "client_cpu_us_per_request": round(1e6 * cpu / n, 1)}


def bench_generate(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    b = cfg.bench
    proc, url = spawn_canned_server()
    try:
        raw = asyncio.run(_client_rate(url, b.generate_requests, b.generate_concurrency,
                                       warmup=min(500, b.generate_requests)))
        stage = _stage_rate(url, b.generate_requests, b.generate_concurrency)
    finally:
        proc.kill()
        proc.wait()
    result = {"client": raw, "stage": stage, "concurrency": b.generate_concurrency,
              "goal_requests_per_s": 2000, "meets_goal": raw["requests_per_s"] >= 2000}
    if not ctx.json:
        print(f"{'path':<8} {'req/s':>9} {'client CPU µs/req':>18}\n"
              f"{'client':<8} {raw['requests_per_s']:>9.0f} {raw['client_cpu_us_per_request']:>18.0f}\n"
              f"{'stage':<8} {stage['requests_per_s']:>9.0f} {stage['client_cpu_us_per_request']:>18.0f}",
              file=sys.stderr)
    return result
