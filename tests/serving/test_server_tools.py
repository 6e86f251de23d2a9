"""`dflashkit serve` with function tools: the template renders them, Hermes `<tool_call>` blocks come back as
`tool_calls`, bad requests get 400 naming the field; and `generate` through it records the prompts it saw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import httpx
import pytest

from dflashkit.cli import main
from dflashkit.data.chat import ChatTemplate, encode_pieces
from dflashkit.data.drift import ids_summary
from dflashkit.data.records import iter_conversations
from dflashkit.decode.api import GenerationResult
from dflashkit.serving.engine import Request
from dflashkit.serving.server import App, serve_in_thread
from dflashkit.serving.tools import parse_tool_calls
from tests.harness.servers import serving

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                          "required": ["q"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = ASK + [  # one call made and answered
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"q\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "18 C"}]
BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"q": "Rome"}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen3_template(tmp_path_factory) -> Path:
    """The real Qwen3 chat template (from the cached Qwen3 tokenizer) as a file for target.chat_template."""
    from dflashkit.assets import asset_path

    config = json.loads((asset_path("tokenizer-qwen3") / "tokenizer_config.json").read_text())
    path = tmp_path_factory.mktemp("template") / "qwen3.jinja"
    path.write_text(config["chat_template"])
    return path


@pytest.fixture(scope="module")
def served_tools(tiny_qwen3, qwen3_template):
    with serving({"target": {"path": str(tiny_qwen3), "chat_template": str(qwen3_template)},
                  "serve": {"model_name": "tiny"}}) as app_url:
        yield app_url


def post(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/chat/completions", json={"max_tokens": 1, **body}, timeout=60)


def test_parse_hermes_tool_calls():
    content, calls = parse_tool_calls(f"Let me check.\n{BLOCK}\n{BLOCK.replace('Rome', 'Oslo')}\n", first=3)
    assert content == "Let me check."
    assert [(c["id"], c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("call_3", "function", "get_weather", {"q": "Rome"}), ("call_4", "function", "get_weather", {"q": "Oslo"})]
    assert parse_tool_calls(BLOCK) == ("", [calls[0] | {"id": "call_0"}])
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')[1][0]["function"] == {
        "name": "f", "arguments": "{}"}
    for text in ("no call here",
                 "<tool_call>\n{not json}\n</tool_call>",                              # not JSON
                 f"{BLOCK}\n<tool_call>\n[1, 2]\n</tool_call>",                        # a block not an object
                 '<tool_call>\n{"name": "f", "arguments": "x"}\n</tool_call>',          # arguments not an object
                 '<tool_call>\n{"arguments": {}}\n</tool_call>',                        # no name
                 f'{BLOCK}\n<tool_call>\n{{"name": "get_weather", "argu'):             # cut by max_tokens
        assert parse_tool_calls(text) is None, text


def test_tools_are_rendered_by_the_template(served_tools):
    app, url = served_tools
    bare = post(url, messages=ASK, return_token_ids=True).json()
    with_tools = post(url, messages=ASK, tools=TOOLS, return_token_ids=True).json()
    assert with_tools["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"]
    prompt = app.tok.decode(with_tools["prompt_token_ids"])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt.rsplit("<tools>", 1)[1]
    assert with_tools["prompt_token_ids"] == app.tok.encode(
        app.tok.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)
    # the history's call and result render too; tool_choice "none" renders the tools all the same
    out = post(url, messages=HISTORY, tools=TOOLS, tool_choice="none", return_token_ids=True).json()
    prompt = app.tok.decode(out["prompt_token_ids"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"q": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt and "<tools>" in prompt


def test_bad_tool_requests_get_400_naming_the_field(served_tools, tiny_qwen3):
    _, url = served_tools
    for body, named in (({"tools": {"type": "function"}}, "`tools`"),
                        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
                        ({"tools": TOOLS, "tool_choice": "required"}, "`tool_choice`"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                         "`tool_choice`"),
                        ({"tools": TOOLS, "stream": True}, "`stream`")):
        r = post(url, messages=ASK, **body)
        assert r.status_code == 400 and named in r.json()["error"]["message"], (body, r.text)
    # the tiny target's own template renders role and content only: tools are refused, naming the key to set
    with serving({"target": {"path": str(tiny_qwen3)}}) as (_, plain):
        r = post(plain, messages=ASK, tools=TOOLS)
        assert r.status_code == 400 and "target.chat_template" in r.json()["error"]["message"]
        assert post(plain, messages=ASK).status_code == 200


class CannedEngine:
    """A serve engine that answers `answer(prompt text)` at once (the random tiny target never calls a tool)."""

    max_context = None

    def __init__(self, tok, answer: Callable[[str], str]):
        self.tok, self.answer = tok, answer
        self.metrics: dict = {}

    def submit(self, prompt_ids, params, stream: bool = False) -> Request:
        text = self.answer(self.tok.decode(prompt_ids))
        req = Request(prompt_ids, params, stream)
        req._finish(GenerationResult(token_ids=self.tok.encode(text, add_special_tokens=False), finish_reason="stop",
                                     text=text, prompt_tokens=len(prompt_ids)))
        return req


def canned_app(tiny_qwen3, template: Path, answer: Callable[[str], str]) -> App:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    tok.chat_template = template.read_text()
    return App(CannedEngine(tok, answer), tok, model_name="canned")


def test_tool_call_blocks_come_back_as_tool_calls(tiny_qwen3, qwen3_template):
    app = canned_app(tiny_qwen3, qwen3_template, lambda prompt: f"Let me check.\n{BLOCK}")
    with serve_in_thread(app) as url:
        choice = post(url, messages=HISTORY, tools=TOOLS).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me check."
        assert choice["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"q": "Rome"}'}}]  # numbered on from the history's call
        for body in ({"tool_choice": "none", "tools": TOOLS}, {}):  # nothing parsed: the text stays the content
            choice = post(url, messages=ASK, **body).json()["choices"][0]
            assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
            assert choice["message"]["content"] == f"Let me check.\n{BLOCK}"
    broken = canned_app(tiny_qwen3, qwen3_template, lambda prompt: "<tool_call>\n{oops}\n</tool_call>")
    with serve_in_thread(broken) as url:
        choice = post(url, messages=ASK, tools=TOOLS).json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "<tool_call>\n{oops}\n</tool_call>"}


def test_generate_through_serve_records_the_agent_prompts(tmp_path, capsys, tiny_qwen3, qwen3_template):
    """`generate` against our server: the target's call is kept, the data's result re-paired, and each
    turn's server prompt ids are those of the record's own prefix rendered here with its tools."""

    def answer(prompt: str) -> str:  # call when the last user turn is a question, answer after a result
        return "It is 18 C." if "<tool_response>" in prompt.rsplit("<|im_start|>user", 1)[1] else BLOCK

    conv = {"id": "a" * 16, "source": "agent", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "d1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"q\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "d1", "content": "18 C"},
        {"role": "assistant", "content": "18 C."}]}
    (tmp_path / "prepare").mkdir()
    (tmp_path / "prepare" / "train.jsonl").write_text(json.dumps(conv) + "\n")
    app = canned_app(tiny_qwen3, qwen3_template, answer)
    with serve_in_thread(app) as url:
        rc = main(["generate", f"run.run_dir={tmp_path}", f"server.urls=[{url}]", f"target.path={tiny_qwen3}",
                   f"target.chat_template={qwen3_template}", "generate.progress=false", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    assert out["preflight"]["status"] == "ok" and out["preflight"]["ids_equal"] is True
    (rec,) = iter_conversations(tmp_path / "generate" / "conversations.jsonl")
    assert [m["role"] for m in rec.messages] == ["user", "assistant", "tool", "assistant"]
    assert rec.messages[1]["tool_calls"][0]["id"] == "call_0" and rec.messages[2]["tool_call_id"] == "call_0"
    assert rec.messages[3]["content"] == "It is 18 C." and rec.meta["finish_reasons"] == ["tool_calls", "stop"]
    chat = ChatTemplate(app.tok)
    local = [ids_summary(encode_pieces(app.tok, [chat.render(rec.messages[:j], add_generation_prompt=True,
                                                            tools=rec.tools)])[0]) for j in (1, 3)]
    assert rec.meta["prompt_ids"] == local
    assert rec.meta["prompt_tokens"] == [s["n"] for s in local]
