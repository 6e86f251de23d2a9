"""The config of regenerating agent turns: vLLM's parsers, a source's tool_choice and chat-template variables.
Each refusal comes before any server starts (`check_generate` is what a run and its dry run call)."""

from __future__ import annotations

import pytest

from dflashkit.config import load_config
from dflashkit.errors import ConfigError
from dflashkit.generate.preflight import request_body, sampling_settings, source_settings
from dflashkit.generate.regenerate import check_generate

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
AGENT = {"id": "a" * 16, "source": "agent", "tools": TOOLS,
         "messages": [{"role": "user", "content": "call f"},
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}
CHAT = {"id": "b" * 16, "source": "chat", "messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]}


def _cfg(*over: str):
    return load_config(None, ["data.sources=[{path: agent.jsonl, tool_choice: required, "
                              "chat_template_kwargs: {enable_thinking: false}}, {path: chat.jsonl}]",
                              "generate.chat_template_kwargs={enable_thinking: true, x: 1}", *over])


def test_a_source_sends_its_tool_choice_with_tools_only_and_its_template_variables():
    cfg = _cfg()
    by = source_settings(cfg)
    settings = sampling_settings(cfg, "target")
    agent = request_body(settings, AGENT["messages"][:1], token_ids=False, tools=TOOLS, source=by["agent"])
    assert agent["tools"] == TOOLS and agent["tool_choice"] == "required"
    assert agent["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}  # the source's over the run's
    chat = request_body(settings, CHAT["messages"][:1], token_ids=False, source=by["chat"])
    assert "tools" not in chat and "tool_choice" not in chat
    assert chat["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}


def test_required_tool_choice_is_refused_for_the_dflashkit_server(tmp_path):
    with pytest.raises(ConfigError, match=r"tool_choice: required \(source 'agent'\)"):
        check_generate(_cfg(), [AGENT, CHAT], tmp_path)
    check_generate(_cfg("server.urls=[http://127.0.0.1:9/v1]"), [AGENT, CHAT], tmp_path)  # a server of yours


def test_agent_data_through_a_started_vllm_needs_its_tool_call_parser(tmp_path):
    cfg = _cfg("server.engine=vllm", "data.sources=[{path: agent.jsonl}]")
    with pytest.raises(ConfigError, match="server.tool_call_parser: conversation a+ .*plain text"):
        check_generate(cfg, [AGENT], tmp_path)
    check_generate(cfg, [CHAT], tmp_path)  # chat needs no parser
    check_generate(_cfg("server.engine=vllm", "data.sources=[{path: agent.jsonl}]", "server.tool_call_parser=hermes"),
                   [AGENT], tmp_path)


@pytest.mark.parametrize("key, value", [("tool_call_parser", "'hermes --trust-remote-code'"),
                                        ("reasoning_parser", "../x")])
def test_a_parser_is_a_name(key, value):
    with pytest.raises(ConfigError, match=f"server.{key}: .* is not a parser name"):
        load_config(None, [f"server.{key}={value}"])


def test_vllm_gets_the_parser_flags():
    from dflashkit.engines.launch import parser_args

    assert parser_args(_cfg()) == []
    assert parser_args(_cfg("server.tool_call_parser=kimi_k2", "server.reasoning_parser=kimi_k2")) == [
        "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2"]
