"""The OpenAI-compatible HTTP front of `dflashkit serve` (stdlib ThreadingHTTPServer, HTTP/1.1).

Usage:
    app = App(engine, tokenizer, model_name="tiny", max_new_tokens=4096)
    with serve_in_thread(app, "127.0.0.1", 0) as url:      # "http://127.0.0.1:<port>/v1"
        ...
    run_forever(app, host, port)                           # the CLI (returns on SIGTERM/Ctrl-C)

Routes:
    POST /v1/chat/completions   messages, temperature, top_p, top_k, max_tokens, seed, stop, stream,
                                chat_template_kwargs, tools, tool_choice (the model's chat template renders)
    POST /v1/completions        prompt (string or token ids), add_special_tokens, same sampling fields
    GET  /v1/models, /health, /metrics (JSON: requests, tokens, batches, acceptance when speculating)
    POST /admin/drafter         {"drafter": DIR, "id"?}: hot swap of the drafter (loopback clients only); the
                                serving drafter's id is in /v1/models and /health
A request's tenant (whose suffix pool a suffix / hybrid server matches and feeds: `serve.proposer`) is its
X-Tenant header, else its OpenAI `user` field; none = the one default tenant.
Each choice carries `finish_reason` and `token_ids`; `return_token_ids: true` adds `prompt_token_ids`
(as vLLM); `usage` adds `acceptance_lengths` / `mean_acceptance` with a drafter. Streams are
Server-Sent Events ending with `data: [DONE]`. Bad requests get 400 with an OpenAI-style error body.
Function tools (`serving.tools`): Hermes-style `<tool_call>` blocks of the answer come back as
`message.tool_calls` (ids `call_<n>`), with `finish_reason: "tool_calls"` when the model stopped by
itself. `tool_choice` "auto" or "none"; "required", a named function, `stream` with `tools`, and
`tools` with a template that does not render them get 400.
A client that disconnects has its request cancelled: the engine frees its batch row at the next
step, and the log gets one line, not a broken-pipe traceback.
With `serve.record_dir` (`App.recording`) every answered request is recorded (`serving.record`) before its last
bytes go out (a non-streamed body, a stream's final chunk and `[DONE]`); one that cannot be recorded gets 503
(a stream ends without `[DONE]`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import select
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

from dflashkit.data.records import tools_problem
from dflashkit.decode.api import SamplingParams
from dflashkit.redact import redact_text
from dflashkit.serving.engine import RequestCancelled
from dflashkit.serving.tools import parse_tool_calls, renders_tools

log = logging.getLogger("dflashkit.serve")

DISCONNECTS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
POLL_S = 0.2  # how often a waiting handler checks whether its client is still there


class BadRequest(Exception):
    pass


class App:
    """Request parsing, chat templating and response shaping around an engine."""

    def __init__(self, engine, tokenizer, *, model_name: str, max_new_tokens: int = 4096,
                 speculative: bool = False):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.max_new_tokens = max_new_tokens
        self.speculative = speculative
        self.started = time.time()
        self.in_flight = 0
        self._lock = threading.Lock()
        template = getattr(tokenizer, "chat_template", None) or ""
        self.template_sha256 = hashlib.sha256(template.encode()).hexdigest() if template else None
        self._renders_tools: bool | None = None  # probed at the first request with tools
        self.recording: Any = None  # a `serving.record.ServeRecording` when serve.record_dir is set
        self.drafter_id: str | None = None  # the drafter serving now (/v1/models, /health); set by serve_app
        self.swap_drafter: Any = None  # serve_app's `DrafterSwap.load(dir, id)`: POST /admin/drafter (loopback only)

    def chat_tools(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, int | None]:
        """(the request's function tools or None, the id number of its first tool call — None: do not parse
        tool calls); BadRequest for what this server does not do (module docstring)."""
        tools, choice = body.get("tools"), body.get("tool_choice")
        if tools is None or tools == []:
            return None, None
        problem = tools_problem(tools)
        if problem is not None:
            raise BadRequest(problem)
        if choice not in (None, "auto", "none"):
            raise BadRequest(f"`tool_choice` {json.dumps(choice)[:80]} is not supported: this server takes "
                             "\"auto\" (the default) or \"none\", not \"required\" or a named function")
        if body.get("stream"):
            raise BadRequest("`stream` with `tools` is not supported (a stream does not carry tool calls): "
                             "send the request without `stream`")
        if self._renders_tools is None:
            self._renders_tools = renders_tools(self.tok)
        if not self._renders_tools:
            raise BadRequest(f"`tools`: the chat template of {self.model_name} does not render tools (a probe "
                             "renders the same with a tool as without), so the model would never see them; set "
                             "target.chat_template to a Jinja template that renders `tools` and `tool_calls` "
                             "(configs/templates/smollm2-tools.jinja for SmolLM2) and restart `dflashkit serve`")
        messages = body.get("messages")
        calls = [m.get("tool_calls") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        first = sum(len(c) for c in calls if isinstance(c, list))
        return tools, None if choice == "none" else first

    def render_chat(self, messages: Any, template_kwargs: dict[str, Any],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                    not isinstance(m.get("content", ""), (str, type(None))):
                raise BadRequest(f"messages[{i}] needs a string role and string content")
        try:
            text = self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                **template_kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are the caller's input
            raise BadRequest(f"chat template failed: {type(e).__name__}: {e}") from None
        return list(self.tok.encode(text, add_special_tokens=False))

    def params(self, body: dict[str, Any]) -> SamplingParams:
        def num(key: str, default, cast):
            v = body.get(key)
            if v is None:
                return default
            try:
                return cast(v)
            except (TypeError, ValueError):
                raise BadRequest(f"`{key}` must be a number, got {v!r}") from None

        if body.get("n", 1) not in (1, None):
            raise BadRequest("only n=1 is supported")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("`stop` must be a string or a list of strings")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        p = SamplingParams(temperature=num("temperature", 0.0, float), top_p=num("top_p", 1.0, float),
                           top_k=num("top_k", 0, int), seed=num("seed", None, int),
                           max_new_tokens=min(self.max_new_tokens, int(max_tokens)) if max_tokens is not None
                           else min(self.max_new_tokens, 1024), stop=stop)
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.max_new_tokens < 0:
            raise BadRequest("need temperature >= 0, 0 < top_p <= 1, max_tokens >= 0")
        return p

    @staticmethod
    def tenant(body: dict[str, Any], headers: Any) -> str | None:
        """The request's tenant: the X-Tenant header (a gateway's), else the OpenAI `user` field; None when neither."""
        value = headers.get("X-Tenant") or body.get("user")
        if value is None or value == "":
            return None
        if not isinstance(value, str) or len(value) > 256:
            raise BadRequest("`user` (or the X-Tenant header) must be a string of at most 256 characters")
        return value

    def usage(self, out) -> dict[str, Any]:
        u: dict[str, Any] = {"prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
                             "total_tokens": out.prompt_tokens + len(out.token_ids)}
        if self.speculative:
            acc = out.acceptance_lengths
            u["acceptance_lengths"] = acc
            u["mean_acceptance"] = sum(acc) / len(acc) if acc else None
        return u

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(self.started), "owned_by": "dflashkit",
            "chat_template_sha256": self.template_sha256, "speculative": self.speculative,
            **({"drafter": self.drafter_id} if self.drafter_id else {})}]}

    def metrics(self) -> dict[str, Any]:
        m = dict(self.engine.metrics)
        m["in_flight"] = self.in_flight
        m["mean_batch_size"] = m["batched_requests"] / m["batches"] if m["batches"] else None
        m["mean_running_batch"] = m["decode_rows"] / m["decode_steps"] if m["decode_steps"] else None
        if self.speculative:
            m["mean_acceptance"] = m["accepted_tokens"] / m["acceptance_steps"] if m["acceptance_steps"] else None
        m["uptime_s"] = round(time.time() - self.started, 3)
        return m


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dflashkit"
    app: App  # set on the subclass made by make_server

    def log_message(self, fmt: str, *args) -> None:  # access logs to logging (debug); a key in the query hidden
        log.debug("%s %s", self.address_string(), redact_text(fmt % args))

    def _send_json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        self._send_json(status, {"error": {"message": message, "type": kind, "code": status}})

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            self._send_json(200, self.app.models())
        elif path in ("/health", "/v1/health"):
            self._send_json(200, {"status": "ok", **({"drafter": self.app.drafter_id} if self.app.drafter_id else {})})
        elif path in ("/metrics", "/v1/metrics"):
            self._send_json(200, self.app.metrics())
        else:
            self._error(404, f"no route GET {path}", "not_found")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?")[0].rstrip("/")
        t0 = time.time()
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
        except (ValueError, BadRequest) as e:
            return self._error(400, f"bad JSON body: {e}")
        app = self.app
        if path == "/admin/drafter":
            return self._admin_drafter(body)
        first_call: int | None = None  # parse tool calls, numbering them from here
        try:
            params = app.params(body)
            params.tenant = app.tenant(body, self.headers)
            if path in ("/v1/chat/completions", "/chat/completions"):
                kwargs = body.get("chat_template_kwargs") or {}
                if not isinstance(kwargs, dict):
                    raise BadRequest("`chat_template_kwargs` must be an object")
                tools, first_call = app.chat_tools(body)
                prompt_ids, chat = app.render_chat(body.get("messages"), kwargs, tools), True
            elif path in ("/v1/completions", "/completions"):
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    prompt_ids = list(app.tok.encode(  # vLLM's field: False for an already rendered prompt
                        prompt, add_special_tokens=body.get("add_special_tokens") is not False))
                elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
                    prompt_ids = prompt
                else:
                    raise BadRequest("`prompt` must be a string or a list of token ids")
                chat = False
            else:
                return self._error(404, f"no route POST {path}", "not_found")
            if not prompt_ids:
                raise BadRequest("the prompt is empty")
            limit = getattr(app.engine, "max_context", None)
            if limit is not None and len(prompt_ids) >= limit:
                raise BadRequest(f"the prompt has {len(prompt_ids)} tokens; the model's context is {limit}")
        except BadRequest as e:
            return self._error(400, str(e))
        with app._lock:
            app.in_flight += 1
        req = None
        try:
            req = app.engine.submit(prompt_ids, params, stream=bool(body.get("stream")))
            rec = app.recording
            if body.get("stream"):
                self._stream(req, chat, None if rec is None else (
                    lambda out: rec.record(body, chat, prompt_ids, out, {"content": out.text}, t0, req)))
            else:
                out = self._wait(req)
                if out is not None:
                    resp = self._full(out, chat, prompt_ids if body.get("return_token_ids") else None, first_call)
                    if rec is not None and not rec.record(body, chat, prompt_ids, out, _reply(resp), t0, req):
                        return self._error(503, "the request could not be recorded (serve.record_dir)",
                                           "server_error")
                    self._send_json(200, resp)
        except (RequestCancelled, *DISCONNECTS, socket.timeout):
            self._gone(req)
        except Exception as e:  # noqa: BLE001 - the engine's error goes back to this client only
            log.warning("request failed: %s: %s", type(e).__name__, e)
            self._error(500, f"{type(e).__name__}: {e}", "server_error")
        finally:
            with app._lock:
                app.in_flight -= 1

    def _admin_drafter(self, body: dict[str, Any]) -> None:
        """POST /admin/drafter {"drafter": DIR, "id"?: str}: load that drafter and serve the next requests with it
        (from 127.0.0.1 / ::1 only; 404 when this server has no drafter to swap)."""
        if self.client_address[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
            return self._error(403, "/admin/drafter is served on the loopback interface only", "forbidden")
        if self.app.swap_drafter is None:
            return self._error(404, "this server decodes without a drafter: nothing to swap", "not_found")
        drafter = body.get("drafter")
        if not isinstance(drafter, str) or not drafter:
            return self._error(400, "`drafter` must be a drafter dir")
        try:
            served = self.app.swap_drafter(drafter, body.get("id") or None)
        except Exception as e:  # noqa: BLE001 - the old drafter keeps serving; say why
            return self._error(400, f"drafter not swapped ({type(e).__name__}: {e}); still serving "
                               f"{self.app.drafter_id}")
        self._send_json(200, {"drafter": served})

    def _client_gone(self) -> bool:
        """True when the client closed its connection (readable with nothing to read = EOF)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _gone(self, req) -> None:
        """The client disconnected: cancel its request (frees the batch row); no traceback."""
        if req is not None:
            req.cancel()
        self.close_connection = True
        log.info("client %s disconnected; its request was cancelled", self.address_string())

    def _wait(self, req):
        """The GenerationResult, or None when the client went away meanwhile (the request is cancelled)."""
        while True:
            try:
                return req.wait(timeout=POLL_S)
            except TimeoutError:
                if self._client_gone():
                    self._gone(req)
                    return None

    def _full(self, out, chat: bool, prompt_ids: list[int] | None = None, first_call: int | None = None,
              ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "token_ids": out.token_ids}
        parsed = parse_tool_calls(out.text, first_call) if chat and first_call is not None else None
        if parsed is not None:
            choice["message"] = {"role": "assistant", "content": parsed[0], "tool_calls": parsed[1]}
            if out.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        elif chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        resp: dict[str, Any] = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.app.model_name, "choices": [choice], "usage": self.app.usage(out)}
        if prompt_ids is not None:  # as vLLM does with `return_token_ids`
            resp["prompt_token_ids"] = list(prompt_ids)
        return resp

    def _stream(self, req, chat: bool, on_done=None) -> None:
        """Stream the request's deltas as Server-Sent Events; `on_done(result)` (recording) runs before the last
        chunk, and a False from it ends the stream without `[DONE]` (not acknowledged)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.app.model_name}

        def chunk(text: str | None, extra: dict[str, Any] | None = None, first: bool = False) -> bytes:
            c: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                c["delta"] = {"role": "assistant", "content": text or ""} if first else \
                    ({"content": text} if text is not None else {})
            else:
                c["text"] = text or ""
            obj = {**base, "choices": [{**c, **(extra or {})}]}
            return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

        self.wfile.write(chunk("", first=True))
        self.wfile.flush()
        while True:
            try:
                delta = req.events.get(timeout=POLL_S)
            except queue.Empty:
                if self._client_gone():
                    return self._gone(req)
                continue
            if delta is None:
                break
            self.wfile.write(chunk(delta))
            self.wfile.flush()
        out = req.wait()
        if on_done is not None and not on_done(out):
            return
        final = chunk(None, {"finish_reason": out.finish_reason, "token_ids": out.token_ids})
        obj = json.loads(final[6:])
        obj["usage"] = self.app.usage(out)
        self.wfile.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def _reply(resp: dict[str, Any]) -> dict[str, Any]:
    """The recorded reply of a response this server built (`serving.record.reply_of`)."""
    from dflashkit.serving.record import reply_of

    return reply_of(resp)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], DISCONNECTS):  # a client that went away is not our error
            log.debug("client %s disconnected", client_address)
            return
        super().handle_error(request, client_address)


def make_server(app: App, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"app": app})
    server = _Server((host, port), handler)
    server.daemon_threads = True
    return server


@contextmanager
def serve_in_thread(app: App, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve `app` from a background thread; yield the base URL (…/v1)."""
    server = make_server(app, host, port)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
