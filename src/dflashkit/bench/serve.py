"""`dflashkit bench serve`: concurrency sweeps over one or two OpenAI-compatible endpoints.

Usage:
    dflashkit bench serve -c run.yaml bench.urls='[http://127.0.0.1:8000/v1,http://127.0.0.1:8001/v1]'

`bench_serve` sweeps `bench.concurrency` over one or two endpoints (none: a local `dflashkit serve`
for target.path) and reports output tokens/s, requests/s, latency p50/p90/p99 and, with two
endpoints, the tokens/s speedup of the second over the first at each concurrency.
Warm-up requests are excluded from every number.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from dflashkit.data.records import heldout_user_prompts
from dflashkit.engines.bench import bench_engine_serve
from dflashkit.engines.launch import check_vllm_for_target
from dflashkit.errors import ServerError
from dflashkit.http1 import JSON_HEADERS, Http1Client, HttpError, get_json
from dflashkit.redact import redact_url
from dflashkit.serving.local import start_local_server

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.bench")

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain the difference between a list and a tuple in Python.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "What are the main causes of inflation?",
    "Write a haiku about autumn leaves.",
    "How does a hash map handle collisions?",
    "Give three tips for writing clear technical documentation.",
    "Translate 'good morning, how are you?' into French and Spanish.",
]


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def _sweep_one(url: str, model: str, prompts: list[str], concurrency: int, n: int, warmup: int,
                     max_tokens: int) -> dict[str, Any]:
    lat: list[float] = []
    tokens = 0
    errors = 0
    http = Http1Client(timeout_s=600, headers=JSON_HEADERS)
    try:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, timed: bool) -> None:
            nonlocal tokens, errors
            body = {"model": model, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                    "max_tokens": max_tokens, "temperature": 0.0}
            async with sem:
                t0 = time.perf_counter()
                try:
                    status, _, reply = await http.request("POST", url + "/chat/completions", json.dumps(body).encode())
                    if status != 200:
                        raise HttpError(f"HTTP {status}")
                    ntok = int(json.loads(reply)["usage"]["completion_tokens"])
                except (HttpError, KeyError, ValueError, TypeError):
                    errors += timed
                    return
                if timed:
                    lat.append(time.perf_counter() - t0)
                    tokens += ntok

        await asyncio.gather(*(one(i, False) for i in range(warmup)))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, True) for i in range(n)))
        wall = time.perf_counter() - t0
    finally:
        await http.aclose()
    return {"concurrency": concurrency, "requests": n, "errors": errors, "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 2), "requests_per_s": round(len(lat) / wall, 3),
            "latency_p50_s": _percentile(lat, 0.5), "latency_p90_s": _percentile(lat, 0.9),
            "latency_p99_s": _percentile(lat, 0.99), "completion_tokens": tokens}


def _prompts(rd) -> list[str]:
    return heldout_user_prompts(rd) or DEFAULT_PROMPTS


ENGINE_KEY = "bench serve with server.engine=vllm and no bench.urls"


def check_bench_serve(cfg: RunConfig) -> None:
    """Every refusal of `bench serve` before it starts a server (its --dry-run too): the vLLM its engine
    methods need."""
    if not cfg.bench.urls and cfg.server.engine == "vllm" and set(cfg.bench.engine_methods) - {"dflashkit"}:
        check_vllm_for_target(cfg, ENGINE_KEY)


def failed_requests(result: dict[str, Any]) -> tuple[int, int]:
    """(failed, sent) timed requests over every endpoint / engine method and concurrency of a result."""
    rows = [r for group in result.get("endpoints", result.get("methods", [])) for r in group["sweep"]]
    return sum(int(r["errors"]) for r in rows), sum(int(r["requests"]) for r in rows)


def bench_serve(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    b = cfg.bench
    check_bench_serve(cfg)
    prompts = _prompts(rd)
    if not b.urls and cfg.server.engine == "vllm":  # AR vs ngram vs DFlash (vs `dflashkit serve`) in vLLM

        return bench_engine_serve(cfg, rd, ctx, prompts, _sweep_one)
    with ExitStack() as stack:
        urls = [u.rstrip("/") for u in b.urls]
        if not urls:
            urls = [stack.enter_context(start_local_server(cfg))]
        endpoints: list[dict[str, Any]] = []
        for url in urls[:2]:
            shown = redact_url(url)  # what results, tables and messages show
            try:
                model = cfg.server.model or get_json(url + "/models", timeout_s=30)["data"][0]["id"]
            except (HttpError, KeyError, IndexError, ValueError, TypeError) as e:
                raise ServerError(f"bench.urls: cannot read {shown}/models ({type(e).__name__}: {e})",
                                  hint="start the server, or fix bench.urls") from None
            rows = [asyncio.run(_sweep_one(url, model, prompts, c, b.requests, b.warmup, b.max_tokens))
                    for c in b.concurrency]
            endpoints.append({"url": shown, "model": model, "sweep": rows})
    from dflashkit.target.load import cpu_facts

    result: dict[str, Any] = {"endpoints": endpoints, "max_tokens": b.max_tokens, "prompts": len(prompts),
                              **cpu_facts()}  # this machine's CPU (where a local server runs)
    if len(endpoints) == 2:
        result["speedup"] = [
            {"concurrency": a["concurrency"],
             "output_tokens_per_s": (round(c["output_tokens_per_s"] / a["output_tokens_per_s"], 3)
                                     if a["output_tokens_per_s"] else None)}
            for a, c in zip(endpoints[0]["sweep"], endpoints[1]["sweep"])]
    if not ctx.json:
        if result.get("cpu"):
            print(f"CPU: {result['cpu']} (bf16: {', '.join(result['bf16']) or 'none'})", file=sys.stderr)
        print(f"{'endpoint':<34} {'conc':>4} {'tok/s':>9} {'req/s':>8} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7}",
              file=sys.stderr)
        for ep in endpoints:
            for r in ep["sweep"]:
                p = [f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("latency_p50_s", "latency_p90_s",
                                                                          "latency_p99_s")]
                print(f"{ep['url'][:34]:<34} {r['concurrency']:>4} {r['output_tokens_per_s']:>9.1f} "
                      f"{r['requests_per_s']:>8.2f} {p[0]:>7} {p[1]:>7} {p[2]:>7}", file=sys.stderr)
        for s in result.get("speedup", []):
            print(f"speedup at concurrency {s['concurrency']}: {s['output_tokens_per_s']}x", file=sys.stderr)
    return result
