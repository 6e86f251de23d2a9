"""Replay conversations as traffic to an OpenAI-compatible server (the flywheel demo's clients).

Usage:
    convs = interleaved([read_prepared_lines(p) for p in files])      # file by file, in turn
    out = replay(url, convs[:64], max_tokens=96, concurrency=4)       # one row per request, in order

Each conversation is sent as a chat request: its messages up to its last assistant turn (the answer the data
had is not sent: the target writes its own), its tools, greedy. A row holds the request's source, whether it
succeeded, and the server's `usage.acceptance_lengths` (the τ of each verify step the serving drafter took).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx


def read_conversations(path: str | Path) -> list[dict[str, Any]]:
    """The records of a prepared JSONL file (prepare's train.jsonl / heldout.jsonl), in file order."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def interleaved(lists: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One item of each list in turn until all are used up (so every round sees every kind of traffic)."""
    out, i = [], 0
    while any(i < len(x) for x in lists):
        out += [x[i] for x in lists if i < len(x)]
        i += 1
    return out


def request_of(conv: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    msgs = conv["messages"]
    last = max((j for j, m in enumerate(msgs) if m.get("role") == "assistant"), default=len(msgs))
    body: dict[str, Any] = {"messages": msgs[:last], "max_tokens": max_tokens, "temperature": 0.0}
    if conv.get("tools"):
        body["tools"] = conv["tools"]
    return body


def replay(url: str, convs: list[dict[str, Any]], *, max_tokens: int, concurrency: int = 4,
           timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Send `convs` to `url` (…/v1) with `concurrency` clients; one row per conversation, in order."""
    rows: list[dict[str, Any]] = [{} for _ in convs]
    lock = threading.Lock()
    nxt = [0]

    def worker() -> None:
        with httpx.Client(timeout=timeout_s) as client:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(convs):
                    return
                conv = convs[i]
                row: dict[str, Any] = {"id": conv.get("id"), "source": conv.get("source")}
                try:
                    r = client.post(url.rstrip("/") + "/chat/completions", json=request_of(conv, max_tokens))
                    row["ok"] = r.status_code == 200
                    if row["ok"]:
                        usage = r.json().get("usage") or {}
                        row["acceptance_lengths"] = usage.get("acceptance_lengths") or []
                    else:
                        row["error"] = r.text[:200]
                except httpx.HTTPError as e:
                    row.update(ok=False, error=f"{type(e).__name__}: {e}")
                rows[i] = row

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def live_tau(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """τ the server measured over the replayed requests (all verify steps pooled), overall and per source."""
    def pooled(rs: list[dict[str, Any]]) -> float | None:
        steps = [a for r in rs for a in r.get("acceptance_lengths") or []]
        return round(sum(steps) / len(steps), 4) if steps else None

    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(str(r.get("source") or "all"), []).append(r)
    return {"tau": pooled(rows), "requests": len(rows), "failed": sum(1 for r in rows if not r.get("ok")),
            "by_source": {k: pooled(v) for k, v in sorted(by.items())}}
