"""Lean asyncio client for OpenAI-compatible `/v1/chat/completions` (and `/v1/completions`), with retries.

Usage:
    async with OpenAIClient(["http://127.0.0.1:8000/v1"], concurrency=32, timeout_s=600) as client:
        model = await client.model_name()
        reply = await client.chat({"model": model, "messages": [...], "max_tokens": 64})
        reply.content, reply.reasoning, reply.finish_reason, reply.token_ids, reply.attempts
        reply.tool_calls            # [{"id", "type": "function", "function": {"name", "arguments"}}] or None
        reply.usage["prompt_tokens"], reply.prompt_token_ids       # what the server saw (ids if returned)
        reply = await client.complete({"model": model, "prompt": "<rendered text>", ...})  # same reply type

One keep-alive connection pool serves every endpoint: the lean `Http1Client` (the one HTTP
client of `generate`; `dflashkit bench generate` measured it against httpx and aiohttp, see
docs/architecture.md). Each request goes to the endpoint
with the fewest requests in flight. Retryable failures (HTTP 408/409/425/429/5xx, timeouts,
connection errors, malformed JSON) are retried with exponential backoff and jitter, honouring
`Retry-After`; anything else (HTTP 400, 401, 404, …) fails at once. After the last retry
`chat` raises `RequestFailed` whose `reason` is short and countable ("http 500", "timeout", …).
A reply's `tool_calls` are kept in OpenAI's shape, `arguments` a JSON object as a string (an object
sent as such is serialised); a call without a function name or with arguments that are not a JSON
object fails the request at once ("invalid tool call", not retried: a re-run asks again).
The API key is read once from the environment and only ever placed in the Authorization header;
the HTTP client registers it, so a server that echoes it (a 401 quoting the key) has it masked in every
reply body, `RequestFailed.detail` and log line (`dflashkit.redact`).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from dflashkit.config import redact_text, redact_url
from dflashkit.errors import ServerError
from dflashkit.http1 import Http1Client, HttpConnectError, HttpDropped, HttpError, HttpTimeout

log = logging.getLogger("dflashkit.generate")

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524})
MAX_BACKOFF_S = 60.0


def permanent_reason(reason: str) -> bool:
    """A failure reason (`http 400`, `timeout`, …) that a re-run of the same request repeats: an HTTP
    status the client never retries (400, 401, 404, 422, …)."""
    parts = reason.split()
    return len(parts) == 2 and parts[0] == "http" and parts[1].isdigit() and int(parts[1]) not in RETRY_STATUS \
        and 400 <= int(parts[1]) < 500


class RequestFailed(Exception):
    """A request that did not succeed after its retries; `reason` is a short countable label."""

    def __init__(self, reason: str, detail: str = "", attempts: int = 1):
        detail = redact_text(detail)  # the server's words: never the credentials it was sent
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.attempts = attempts


class _Retryable(Exception):
    def __init__(self, reason: str, detail: str = "", retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.detail = redact_text(detail)
        self.retry_after = retry_after


@dataclass
class ChatReply:
    """One parsed choice of a chat completion."""

    content: str
    reasoning: str | None
    finish_reason: str | None
    token_ids: list[int] | None
    usage: dict[str, Any]
    model: str | None
    url: str
    attempts: int = 1
    retry_reasons: list[str] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # vLLM (`return_token_ids`) and `dflashkit serve` return them
    tool_calls: list[dict[str, Any]] | None = None  # the target's function calls (None: it called none)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def parse_chat_response(body: bytes, route: str = "chat") -> tuple[dict[str, Any], dict[str, Any]]:
    """(choice, response) from a response body; raises `_Retryable("malformed json")` if unusable.

    `route="completions"`: the choice carries `text` instead of `message`.
    """
    try:
        data = json.loads(body)
        choice = data["choices"][0]
        if route == "completions":
            if not isinstance(choice.get("text") or "", str):
                raise TypeError("choices[0].text is not a string")
        else:
            message = choice["message"]
            if not isinstance(message, dict) or not isinstance(message.get("content") or "", str):
                raise TypeError("message.content is not a string")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError) as e:
        raise _Retryable("malformed json", f"{type(e).__name__}: {str(e)[:120]}") from None
    return choice, data


def _token_ids(choice: dict[str, Any], keys=("token_ids", "output_token_ids", "output_ids")) -> list[int] | None:
    for key in keys:
        ids = choice.get(key)
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return ids
    return None


def tool_calls(message: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A reply message's `tool_calls` in OpenAI's shape (the server's ids, "" when it gave none), or None when
    it has none; raises RequestFailed("invalid tool call") naming the call that is not a function call."""
    calls = message.get("tool_calls")
    if not calls:
        return None
    out = []
    for k, c in enumerate(calls if isinstance(calls, list) else [calls]):
        fn = c.get("function") if isinstance(c, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        try:
            ok = isinstance(name, str) and bool(name) and isinstance(json.loads(args), dict)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise RequestFailed("invalid tool call", f"tool_calls[{k}] is not a function call with a name and "
                                f"JSON-object arguments: {json.dumps(c, ensure_ascii=False)[:160]}")
        cid = c.get("id")
        out.append({"id": cid if isinstance(cid, str) else "", "type": "function",
                    "function": {"name": name, "arguments": args}})
    return out


def prompt_ids(choice: dict[str, Any], data: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids: top level (vLLM chat), or on the choice (vLLM completions)."""
    return _token_ids(data, ("prompt_token_ids",)) or _token_ids(choice, ("prompt_token_ids",))


class OpenAIClient:
    """Bounded-concurrency, load-balanced, retrying chat-completions client."""

    def __init__(self, urls: list[str], *, concurrency: int = 32, timeout_s: float = 600.0,
                 max_retries: int = 5, backoff_s: float = 0.5, api_key_env: str | None = None,
                 seed: int = 0):
        if not urls:
            raise ValueError("no endpoint URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.in_flight = {u: 0 for u in self.urls}
        self._cooldown_until = {u: 0.0 for u in self.urls}
        self._rr = 0
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._rng = random.Random(seed)
        self._sem = asyncio.Semaphore(concurrency)
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(api_key_env) if api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._http = Http1Client(timeout_s=timeout_s, headers=headers)
        self.stats = {"requests": 0, "retries": 0}

    async def __aenter__(self) -> "OpenAIClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def pick_url(self) -> str:
        """The endpoint with the fewest requests in flight (round robin among ties; cooled-down last)."""
        now = time.monotonic()
        n = len(self.urls)
        best, best_score = self.urls[0], None
        for k in range(n):
            u = self.urls[(self._rr + k) % n]
            score = (self._cooldown_until[u] > now, self.in_flight[u])
            if best_score is None or score < best_score:
                best, best_score = u, score
        self._rr = (self._rr + 1) % n
        return best

    async def model_info(self) -> dict[str, Any]:
        """The first entry of the first endpoint's /v1/models (has at least "id")."""
        url = self.urls[0] + "/models"
        try:
            status, _, body = await self._http.request("GET", url)
            if status != 200:
                raise ValueError(f"HTTP {status}")
            entry = json.loads(body)["data"][0]
            str(entry["id"])
            return entry
        except (HttpError, KeyError, IndexError, TypeError, ValueError) as e:
            raise ServerError(f"could not read the model name from {redact_url(url)}: {type(e).__name__}: {e}",
                              hint="set server.model, or check that the server is up") from None

    async def model_name(self) -> str:
        """The first model id of the first endpoint's /v1/models."""
        return str((await self.model_info())["id"])

    async def chat(self, body: dict[str, Any]) -> ChatReply:
        """POST one chat completion with retries; returns the first choice or raises RequestFailed."""
        return await self._request(body, "chat")

    async def complete(self, body: dict[str, Any]) -> ChatReply:
        """POST one text completion (`prompt` already rendered) to /completions, like `chat`."""
        return await self._request(body, "completions")

    async def _request(self, body: dict[str, Any], route: str) -> ChatReply:
        payload = json.dumps(body, ensure_ascii=False).encode()
        reasons: list[str] = []
        for attempt in range(self.max_retries + 1):
            url = self.pick_url()
            try:
                async with self._sem:
                    self.in_flight[url] += 1
                    self.stats["requests"] += 1
                    try:
                        reply = await self._post(url, payload, route)
                    finally:
                        self.in_flight[url] -= 1
                reply.attempts = attempt + 1
                reply.retry_reasons = reasons
                return reply
            except RequestFailed as e:
                e.attempts = attempt + 1
                raise
            except _Retryable as e:
                reasons.append(e.reason)
                if attempt == self.max_retries:
                    raise RequestFailed(e.reason, e.detail, attempts=attempt + 1) from None
                delay = self.backoff_s * (2 ** attempt) * (0.5 + self._rng.random())
                if e.retry_after is not None:
                    delay = max(delay, e.retry_after)
                delay = min(delay, MAX_BACKOFF_S)
                if e.reason in ("connect error", "timeout"):
                    self._cooldown_until[url] = time.monotonic() + delay
                self.stats["retries"] += 1
                log.debug("retry %d/%d in %.2fs after %s (%s) from %s", attempt + 1, self.max_retries,
                          delay, e.reason, e.detail, redact_url(url))
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _post(self, url: str, payload: bytes, route: str = "chat") -> ChatReply:
        endpoint = url + ("/completions" if route == "completions" else "/chat/completions")
        try:
            status, headers, body = await self._http.request("POST", endpoint, payload)
        except HttpTimeout as e:
            raise _Retryable("timeout", type(e).__name__) from None
        except HttpConnectError as e:
            raise _Retryable("connect error", str(e)[:120]) from None
        except (HttpDropped, OSError) as e:
            raise _Retryable("connection dropped", f"{type(e).__name__}: {str(e)[:120]}") from None
        if status != 200:
            detail = body[:200].decode("utf-8", "replace")
            if status in RETRY_STATUS:
                raise _Retryable(f"http {status}", detail, parse_retry_after(headers.get("retry-after")))
            raise RequestFailed(f"http {status}", detail)
        choice, data = parse_chat_response(body, route)
        message = choice.get("message") or {"content": choice.get("text") or ""}
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        usage = data.get("usage")
        return ChatReply(
            content=message.get("content") or "", reasoning=reasoning if isinstance(reasoning, str) else None,
            finish_reason=choice.get("finish_reason"), token_ids=_token_ids(choice),
            usage=usage if isinstance(usage, dict) else {}, model=data.get("model"), url=url,
            prompt_token_ids=prompt_ids(choice, data), tool_calls=tool_calls(message),
        )
