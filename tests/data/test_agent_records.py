"""Agent conversations as records: tools, tool calls and their results round-trip; each malformed agent
turn is named; a plain chat record keeps the id it had before agent fields existed."""

from __future__ import annotations

import hashlib
import json

import pytest

from dflashkit.data.records import Conversation, content_id, read_prepared, record_problem
from dflashkit.errors import UsageError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def call(cid: str, city: str, name: str = "get_weather") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps({"city": city})}}


def agent_messages() -> list[dict]:
    return [{"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "<think>\nTwo cities.\n</think>\n\n",
             "tool_calls": [call("c1", "Paris"), call("c2", "Rome")]},
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18 C"},
            {"role": "tool", "tool_call_id": "c2", "name": "get_weather", "content": "24 C"},
            {"role": "assistant", "content": "Paris 18 C, Rome 24 C."}]


def test_an_agent_conversation_round_trips_with_its_tools_and_calls():
    conv = Conversation.from_messages("agentic", agent_messages(), tools=TOOLS)
    back = Conversation.from_dict(json.loads(json.dumps(conv.to_dict())))
    assert back == conv and back.tools == TOOLS and back.messages[1]["tool_calls"][1]["id"] == "c2"
    assert back.messages[2]["tool_call_id"] == "c1"
    # tools, calls and results are part of the id: another argument is another conversation
    other = agent_messages()
    other[1]["tool_calls"][0] = call("c1", "Lyon")
    assert Conversation.from_messages("agentic", other, tools=TOOLS).id != conv.id
    assert Conversation.from_messages("agentic", agent_messages()).id != conv.id


def test_a_chat_record_keeps_its_old_id():
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    old = hashlib.sha256(json.dumps([[m["role"], m["content"]] for m in msgs], ensure_ascii=False,
                                    separators=(",", ":")).encode()).hexdigest()[:16]
    assert content_id(msgs) == old == Conversation.from_messages("s", msgs).id
    assert "tools" not in Conversation.from_messages("s", msgs).to_dict()


def test_a_conversation_may_end_on_a_call():
    msgs = agent_messages()[:2]
    assert record_problem(msgs, TOOLS) is None


def _bad(mutate) -> str:
    msgs, tools = agent_messages(), json.loads(json.dumps(TOOLS))
    tools = mutate(msgs, tools) or tools  # a mutation of the messages returns None; one of the tools, them
    problem = record_problem(msgs, tools)
    assert problem is not None
    return problem


@pytest.mark.parametrize("mutate, needle", [
    (lambda m, t: m.__delitem__(2), "tool call 'c1' has no result before messages[3]"),
    (lambda m, t: m.insert(1, {"role": "tool", "tool_call_id": "zz", "content": "x"}),
     "a tool result for 'zz', which no earlier assistant turn called"),
    (lambda m, t: m[1]["tool_calls"][0]["function"].update(arguments="{city: Paris"),
     "(get_weather): arguments are not a JSON object"),
    (lambda m, t: m[1]["tool_calls"][0]["function"].update(arguments="[1, 2]"), "arguments are not a JSON object"),
    (lambda m, t: {"type": "function"}, "`tools` must be a list"),
    (lambda m, t: [{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
    (lambda m, t: m[2].__delitem__("tool_call_id"), "messages[2]: a tool turn needs the `tool_call_id`"),
    (lambda m, t: m[3].update(tool_call_id="c1"), "a second result for tool call 'c1'"),
    (lambda m, t: m[0].update(tool_calls=[call("c9", "x")]), "a user turn has tool_calls"),
    (lambda m, t: m[1].update(tool_calls=[]), "tool_calls must be a non-empty list"),
    (lambda m, t: m[1]["tool_calls"][1].update(id="c1"), "tool call id 'c1' is used twice"),
    (lambda m, t: m[1]["tool_calls"][0].__delitem__("id"), "needs an `id` and a `function`"),
])
def test_each_malformed_agent_turn_is_named(mutate, needle):
    assert needle in _bad(mutate)


def test_read_prepared_names_the_line_of_a_malformed_agent_record(tmp_path):
    good = Conversation.from_messages("a", agent_messages(), tools=TOOLS).to_dict()
    bad = {**good, "id": "x" * 16, "messages": agent_messages()[:2] + agent_messages()[3:]}
    p = tmp_path / "train.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(UsageError, match=r"train.jsonl:2: messages\[1\]: tool call 'c1' has no result"):
        read_prepared(p)
    p.write_text(json.dumps(good) + "\n")
    assert read_prepared(p)[0]["tools"] == TOOLS
