"""Requests that leave a server no room to drift: neutral sampling fields, and a one-request pre-flight.

Usage:
    sender = Sender(client, route="chat")                 # or "completions"
    reply = await sender.send(body)                       # drops optional fields a strict server rejects
    check = await preflight(sender, body, local_prompt_ids(chat, messages))
    check.differs, describe(check)                        # server prompt vs the local rendering

Servers default the sampling knobs differently (llama.cpp applies `repeat_penalty` 1.1 and
`min_p` 0.05, SGLang/vLLM read a model's `generation_config.json`), and a request that does not
name a knob gets the server's default. `NEUTRAL_SAMPLING` names each one with the value that turns
it off, in every spelling the common servers read; `top_k` -1 means "off" to vLLM, SGLang,
llama.cpp and `dflashkit serve`. Servers ignore fields they do not know; one that answers HTTP 400
naming a field (the OpenAI API does) gets the request again without it, and the field stays off
for the rest of the run (`Sender.dropped`, logged once).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dflashkit.data.chat import encode_pieces, load_chat
from dflashkit.data.drift import PromptCheck, compare_prompt
from dflashkit.data.mixing import source_names
from dflashkit.errors import ConfigError
from dflashkit.generate.openai_client import ChatReply, OpenAIClient, RequestFailed

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.data.chat import ChatTemplate

log = logging.getLogger("dflashkit.generate")

NEUTRAL_SAMPLING: dict[str, Any] = {
    "repetition_penalty": 1.0,   # vLLM, SGLang, TGI
    "repeat_penalty": 1.0,       # llama.cpp / llama-cpp-python
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "top_k": -1,
}
OPTIONAL_FIELDS = ("return_token_ids", "add_special_tokens", *NEUTRAL_SAMPLING)


def _names(detail: str, key: str) -> bool:
    return key in detail or (key == "return_token_ids" and "token_ids" in detail)


class Sender:
    """Sends requests on one route; optional fields a server rejects (HTTP 400 naming them) are dropped."""

    def __init__(self, client: OpenAIClient, route: str = "chat"):
        if route not in ("chat", "completions"):
            raise ValueError(f"unknown route {route!r}")
        self.client, self.route = client, route
        self.dropped: set[str] = set()

    async def send(self, body: dict[str, Any]) -> ChatReply:
        while True:
            sent = {k: v for k, v in body.items() if k not in self.dropped}
            try:
                if self.route == "completions":
                    return await self.client.complete(sent)
                return await self.client.chat(sent)
            except RequestFailed as e:
                named = [k for k in OPTIONAL_FIELDS if k in sent and _names(e.detail, k)]
                if e.reason != "http 400" or not named:
                    raise
                new = sorted(set(named) - self.dropped)
                self.dropped.update(named)
                if new:
                    log.warning("the server refuses %s (%s); sending requests without it from now on",
                                ", ".join(new), e.detail[:120])


def local_prompt_ids(chat: Any, messages: list[dict[str, str]] | None = None, text: str | None = None,
                     ) -> list[int]:
    """The prompt as this machine renders (the target's chat template) and tokenizes it."""
    if text is None:
        text = chat.render(messages, add_generation_prompt=True)
    return list(encode_pieces(chat.tokenizer, [text])[0])


async def preflight(sender: Sender, body: dict[str, Any], local_ids: list[int]) -> PromptCheck:
    """Send `body` once (1 new token) and compare the server's prompt with `local_ids`."""
    reply = await sender.send({**body, "max_tokens": 1})
    return compare_prompt(local_ids, server_tokens=reply.usage.get("prompt_tokens"),
                          server_ids=reply.prompt_token_ids)


def sampling_settings(cfg: RunConfig, model: str | None) -> dict[str, Any]:
    g = cfg.generate
    return {"model": model, "temperature": g.temperature, "top_p": g.top_p, "max_tokens": g.max_tokens,
            "seed": g.seed if g.seed is not None else cfg.run.seed, "stop": list(g.stop),
            "chat_template_kwargs": dict(g.chat_template_kwargs), "extra_body": dict(g.extra_body),
            "endpoint": g.endpoint, "neutral_sampling": g.neutral_sampling}


def source_settings(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Per source name (`data.sources[].name`, else the file stem): what its requests add to the run's
    settings — its `chat_template_kwargs` merged over generate.chat_template_kwargs, and its `tool_choice`."""
    srcs = cfg.data.sources
    return {name: {"chat_template_kwargs": {**cfg.generate.chat_template_kwargs, **src.chat_template_kwargs},
                   "tool_choice": src.tool_choice} for name, src in zip(source_names(srcs), srcs)}


def request_body(settings: dict[str, Any], messages: list[dict[str, Any]], *, token_ids: bool,
                 prompt: str | None = None, tools: list[dict[str, Any]] | None = None,
                 source: dict[str, Any] | None = None) -> dict:
    """The JSON body for one turn: `messages` (chat; with the conversation's function `tools` when it has
    any, and its source's `tool_choice` when set: servers default to "auto"), or the locally rendered `prompt`
    (completions). `source`: the conversation's entry of `source_settings` (None: the run's settings)."""
    body: dict[str, Any] = {"model": settings["model"], "temperature": settings["temperature"],
                            "top_p": settings["top_p"], "max_tokens": settings["max_tokens"],
                            "seed": settings["seed"]}
    kwargs = settings["chat_template_kwargs"] if source is None else source["chat_template_kwargs"]
    if prompt is None:
        body["messages"] = messages
        if tools:
            body["tools"] = tools
            if source is not None and source.get("tool_choice"):
                body["tool_choice"] = source["tool_choice"]
        if kwargs:
            body["chat_template_kwargs"] = kwargs
    else:
        body["prompt"] = prompt
        body["add_special_tokens"] = False  # the rendered template already holds any BOS (vLLM's field)
    if settings.get("neutral_sampling"):
        body.update(NEUTRAL_SAMPLING)
    if settings["stop"]:
        body["stop"] = settings["stop"]
    if token_ids:
        body["return_token_ids"] = True
    body.update(settings["extra_body"])
    return body


def local_chat(cfg: RunConfig) -> ChatTemplate | None:
    """The target's chat template rendered here (with generate's kwargs), or None without a tokenizer."""
    if not (cfg.target.path or cfg.target.tokenizer):
        if cfg.generate.endpoint == "completions":
            raise ConfigError("generate.endpoint=completions renders prompts locally: set target.path or "
                              "target.tokenizer")
        return None

    return load_chat(cfg, kwargs=cfg.generate.chat_template_kwargs)
