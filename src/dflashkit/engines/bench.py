"""`bench serve` with `server.engine: vllm`: AR vs DFlash vs vLLM's training-free ngram, and `dflashkit serve`.

Usage:
    dflashkit bench serve -c run.yaml server.engine=vllm bench.concurrency=[1,4,16] bench.requests=16

With `bench.urls` empty and `server.engine: vllm`, each method in `bench.engine_methods` is served
in turn on 127.0.0.1 (one server at a time) and swept over `bench.concurrency` with the same prompts
(prepare's held-out split, else a fixed set), greedy, `bench.max_tokens` per request:
  dflashkit  `dflashkit serve` for the target (our regeneration server), no speculation;
  ar         vLLM, no speculation (the baseline of the speedups);
  ngram      vLLM prompt lookup: {"method": "ngram", "num_speculative_tokens": 7,
             "prompt_lookup_max": 3, "prompt_lookup_min": 1} — the floor a trained drafter must clear;
  dflash     vLLM with the exported drafter (`eval.drafter`, else <run_dir>/export),
             num_speculative_tokens = B − 1; skipped (logged) when there is no export.
Per row: output tokens/s, requests/s, latency p50/p90/p99, and for the speculative methods the
acceptance over the row (τ = 1 + accepted / drafts, per-position acceptance; warm-up requests
included). `speedup_vs_ar` is tokens/s over vLLM AR at the same concurrency.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dflashkit.engines import vllm
from dflashkit.export.hf import read_config, read_contract
from dflashkit.export.speculators import drafter_format, read_speculators_contract
from dflashkit.http1 import get_json
from dflashkit.serving.local import start_local_server

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.bench")

NGRAM = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SERVED_NAME = "target"


def _export_dir(cfg: RunConfig, rd: RunDir) -> Path | None:
    p = Path(cfg.eval.drafter) if cfg.eval.drafter else rd.export_dir
    return p if (p / "config.json").is_file() else None


def _speculative(method: str, cfg: RunConfig, rd: RunDir) -> dict[str, Any] | None:
    if method == "ngram":
        return dict(NGRAM)
    if method == "dflash":
        d = _export_dir(cfg, rd)
        if d is None:
            return None
        contract = (read_speculators_contract(read_config(d)[1])[0] if drafter_format(d) == "speculators"
                    else read_contract(d))
        return {"method": contract.family.decoding.vllm_method, "model": str(d.resolve()),
                "num_speculative_tokens": contract.block_size - 1}
    return None


def _sweep(cfg: RunConfig, url: str, model: str, prompts: list[str], counters: bool, sweep_one: Callable
           ) -> list[dict[str, Any]]:
    b = cfg.bench
    rows = []
    for c in b.concurrency:
        before = vllm.metrics(url) if counters else None
        row = asyncio.run(sweep_one(url, model, prompts, c, b.requests, b.warmup, b.max_tokens))
        if before is not None:
            spent = vllm.metrics(url) - before
            row["tau"] = round(spent.tau, 4)
            row["per_position_acceptance"] = [round(x, 4) for x in spent.per_position_acceptance]
            row["drafts"] = spent.drafts
        rows.append(row)
        log.info("%s c=%d: %.1f tok/s", url, c, row["output_tokens_per_s"])
    return rows


def bench_engine_serve(cfg: RunConfig, rd: RunDir, ctx: StageContext, prompts: list[str], sweep_one: Callable) -> dict[str, Any]:
    """Serve each of `bench.engine_methods` in turn and sweep each with `sweep_one` (bench/serve.py's
    one-concurrency sweep, passed in by its caller); the result of `bench serve`."""
    from dflashkit.engines.launch import start_vllm_for_target
    from dflashkit.target.load import cpu_facts

    methods: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dflashkit-bench-") as tmp:
        for method in cfg.bench.engine_methods:
            spec = _speculative(method, cfg, rd)
            if method == "dflash" and spec is None:
                log.warning("bench serve: no exported drafter (eval.drafter or %s): the dflash row is skipped",
                            rd.export_dir)
                continue
            with ExitStack() as stack:
                if method == "dflashkit":
                    url, model = stack.enter_context(start_local_server(cfg, log_path=Path(tmp) / "serve.log")), None
                else:
                    eng = stack.enter_context(start_vllm_for_target(
                        cfg, log_path=Path(tmp) / f"engine-{method}.log", speculative=spec, served_name=SERVED_NAME,
                        what=f"bench.engine_methods {method}"))
                    url, model = eng.base_url, SERVED_NAME
                if model is None:
                    model = get_json(url + "/models", timeout_s=30)["data"][0]["id"]
                rows = _sweep(cfg, url, model, prompts, counters=spec is not None, sweep_one=sweep_one)
            methods.append({"method": method, "server": "dflashkit serve" if method == "dflashkit" else "vllm",
                            "speculative": spec, "sweep": rows})
    ar = next((m for m in methods if m["method"] == "ar"), None)
    if ar:
        base = {r["concurrency"]: r["output_tokens_per_s"] for r in ar["sweep"]}
        for m in methods:
            for r in m["sweep"]:
                b = base.get(r["concurrency"])
                r["speedup_vs_ar"] = round(r["output_tokens_per_s"] / b, 3) if b else None
    result = {"engine": "vllm", "methods": methods, "max_tokens": cfg.bench.max_tokens, "prompts": len(prompts),
              "requests": cfg.bench.requests, **cpu_facts()}
    if not ctx.json:
        print(f"{'method':<10} {'conc':>4} {'tok/s':>8} {'vs AR':>6} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'tau':>5}",
              file=sys.stderr)
        for m in methods:
            for r in m["sweep"]:
                p = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("latency_p50_s", "latency_p90_s",
                                                                         "latency_p99_s")]
                print(f"{m['method']:<10} {r['concurrency']:>4} {r['output_tokens_per_s']:>8.1f} "
                      f"{r.get('speedup_vs_ar') or '-':>6} {p[0]:>7} {p[1]:>7} {p[2]:>7} "
                      f"{r.get('tau', '-'):>5}", file=sys.stderr)
    return result
