"""`dflashkit generate` on agent conversations against a scripted OpenAI server (real HTTP on 127.0.0.1):
tools sent, the target's tool calls kept, the data's results re-paired, cuts at a mismatch, resume."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, ContextManager

from dflashkit.cli import main
from dflashkit.data.records import iter_conversations
from dflashkit.generate.journal import read_records
from tests.helpers import openai_stub

TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    for n, d in (("get_weather", "Weather of a city."), ("get_time", "Time in a zone."))]


def call(cid: str, name: str, q: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps({"q": q})}}


def agent(cid: str, messages: list[dict], tools=TOOLS) -> dict:
    return {"id": cid, "source": "agent", "messages": messages, **({"tools": tools} if tools else {})}


# The data. The scripted target (SCRIPT) calls what the data called in A and D, other functions in B,
# nothing in C, and a function in E where the data just answered.
CONVS = [
    agent("a" * 16, [  # two sequential calls, a final answer, then one more user turn
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "A: weather and time in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call("d1", "get_weather", "Paris")]},
        {"role": "tool", "tool_call_id": "d1", "name": "get_weather", "content": "18 C"},
        {"role": "assistant", "content": "", "tool_calls": [call("d2", "get_time", "CET")]},
        {"role": "tool", "tool_call_id": "d2", "content": "noon"},
        {"role": "assistant", "content": "18 C at noon."},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "welcome"}]),
    agent("b" * 16, [
        {"role": "user", "content": "B: weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call("b1", "get_weather", "Rome")]},
        {"role": "tool", "tool_call_id": "b1", "content": "24 C"},
        {"role": "assistant", "content": "24 C."}]),
    agent("c" * 16, [
        {"role": "user", "content": "C: weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "get_weather", "Oslo")]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
        {"role": "assistant", "content": "3 C."}]),
    agent("d" * 16, [  # parallel calls; the results come in the order of the calls
        {"role": "user", "content": "D: weather and time in Lima?"},
        {"role": "assistant", "content": "Two calls.", "tool_calls": [call("x1", "get_weather", "Lima"),
                                                                       call("x2", "get_time", "PET")]},
        {"role": "tool", "tool_call_id": "x1", "content": "20 C"},
        {"role": "tool", "tool_call_id": "x2", "content": "9 am"},
        {"role": "assistant", "content": "20 C at 9 am."}]),
    agent("e" * 16, [
        {"role": "user", "content": "E: hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "E: bye"},
        {"role": "assistant", "content": "bye"}]),
    agent("f" * 16, [
        {"role": "user", "content": "F: plain chat"},
        {"role": "assistant", "content": "old"}], tools=None),
]

# first user message -> the target's reply for the request holding n assistant messages:
# (content, [(id, name, q), ...]); an id "" is a server that gives none, "call_0" one that repeats its ids
SCRIPT: dict[str, list[tuple[str, list[tuple[str, str, str]]]]] = {
    "A: weather and time in Paris?": [("", [("call_0", "get_weather", "Paris")]),
                                      ("", [("call_0", "get_time", "CET")]),
                                      ("It is 18 C at noon.", []), ("You are welcome.", [])],
    "B: weather in Rome?": [("", [("srv-b", "get_time", "CET")])],
    "C: weather in Oslo?": [("I cannot check that.", [])],
    "D: weather and time in Lima?": [("Calling both.", [("", "get_weather", "Lima"), ("", "get_time", "PET")]),
                                     ("Lima: 20 C, 9 am.", [])],
    "E: hello": [("", [("srv-e", "get_weather", "here")])],
    "F: plain chat": [("new answer", [])],
}


def first_user(body: dict) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def prompt_tokens(body: dict) -> int:
    """The scripted server's prompt length: a function of everything it was sent (messages and tools)."""
    return len(json.dumps([body["messages"], body.get("tools")], sort_keys=True)) // 4


class ScriptedServer:
    """An OpenAI-compatible chat server answering from SCRIPT; `requests` keeps every body it was sent.
    `fail(body)` True answers HTTP 400 instead."""

    def __init__(self, fail=lambda body: False):
        self.requests: list[dict] = []
        self.fail = fail

    def answer(self, body: dict) -> tuple[int, dict]:
        self.requests.append(body)
        if self.fail(body):
            return 400, {"error": {"message": "refused by the test"}}
        msgs = body["messages"]
        content, calls = SCRIPT[first_user(body)][sum(m["role"] == "assistant" for m in msgs)]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call(i, n, q) for i, n, q in calls]
        n = prompt_tokens(body)
        return 200, {"model": "scripted", "choices": [{
            "index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": n, "completion_tokens": 3}, "prompt_token_ids": list(range(n))}

    def serve(self) -> ContextManager[str]:
        return openai_stub(self.answer, models=("scripted",))


def write_prepared(run_dir: Path, convs=CONVS) -> Path:
    (run_dir / "prepare").mkdir(parents=True, exist_ok=True)
    path = run_dir / "prepare" / "train.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return path


def run_generate(run_dir: Path, url: str, capsys, *extra: str) -> tuple[int, dict]:
    rc = main(["generate", f"run.run_dir={run_dir}", f"server.urls=[{url}]", "server.timeout_s=5",
               "generate.backoff_s=0.005", "generate.concurrency=3", "generate.max_retries=1",
               "generate.progress=false", *extra, "--json"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def read_out(run_dir: Path) -> dict[str, dict]:
    path = run_dir / "generate" / "conversations.jsonl"
    list(iter_conversations(path))  # every record is a valid conversation: calls and results pair up
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_agent_turns_are_regenerated_repaired_and_cut(tmp_path, capsys):
    write_prepared(tmp_path)
    stub = ScriptedServer()
    with stub.serve() as url:
        rc, out = run_generate(tmp_path, url, capsys)
    assert rc == 0, out
    g = out["generate"]
    assert g["tool_mismatch_cut"] == 3 and g["turns_cut"] == 3  # B, C, E: one turn after each cut
    assert g["turns_total"] == g["turns_ok"] + g["turns_cut"] == 4 + 2 + 2 + 2 + 2 + 1
    assert g["conversations_written"] == len(CONVS) and g["turns_failed"] == g["turns_not_attempted"] == 0
    manifest = json.loads((tmp_path / "generate" / "manifest.json").read_text())
    assert manifest["counts"]["tool_mismatch_cut"] == 3 and manifest["counts"]["turns_cut"] == 3
    # every request of an agent conversation carries its tools; the plain one none
    for body in stub.requests:
        assert body.get("tools") == (None if first_user(body).startswith("F:") else TOOLS)
    rows = read_out(tmp_path)

    a = rows["a" * 16]
    calls = [m.get("tool_calls") for m in a["messages"] if m["role"] == "assistant"]
    assert [[c["id"] for c in cs] if cs else None for cs in calls] == [["call_0"], ["call_1_0"], None, None]
    assert [[c["function"]["name"] for c in cs] if cs else None for cs in calls][:2] == [["get_weather"], ["get_time"]]
    results = [m for m in a["messages"] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in results] == [("call_0", "18 C"), ("call_1_0", "noon")]
    assert results[0]["name"] == "get_weather"  # the data's own keys stay
    assert [m["content"] for m in a["messages"] if m["role"] == "assistant"][2:] == [
        "It is 18 C at noon.", "You are welcome."]
    assert a["tools"] == TOOLS and a["meta"]["finish_reasons"] == ["tool_calls", "tool_calls", "stop", "stop"]
    assert "cut_at_tool_mismatch" not in a["meta"] and a["meta"]["flags"] == []
    # the prompt of turn 1 held the target's call and the data's result re-paired to it
    turn1 = next(b for b in stub.requests if first_user(b).startswith("A:")
                 and sum(m["role"] == "assistant" for m in b["messages"]) == 1)
    assert turn1["messages"][-2:] == [a["messages"][2], a["messages"][3]]
    # drift: one server prompt count per assistant message, each that of the record's own prefix
    answers = [j for j, m in enumerate(a["messages"]) if m["role"] == "assistant"]
    assert a["meta"]["prompt_tokens"] == [prompt_tokens({"messages": a["messages"][:j], "tools": TOOLS})
                                          for j in answers]
    assert [p["n"] for p in a["meta"]["prompt_ids"]] == a["meta"]["prompt_tokens"]

    d = rows["d" * 16]
    assert [c["id"] for c in d["messages"][1]["tool_calls"]] == ["call_0_0", "call_0_1"]  # no ids from the server
    assert d["messages"][1]["content"] == "Calling both."
    assert [m["tool_call_id"] for m in d["messages"][2:4]] == ["call_0_0", "call_0_1"]

    for cid, expected, called in (("b", ["get_weather"], ["get_time"]), ("c", ["get_weather"], []),
                                  ("e", [], ["get_weather"])):
        row = rows[cid * 16]
        assert row["meta"]["cut_at_tool_mismatch"] == {"turn": 0, "expected": expected, "called": called}
        assert row["meta"]["flags"] == ["tool_mismatch:turn0"] and len(row["meta"]["finish_reasons"]) == 1
        assert row["messages"][-1]["role"] == "assistant" and len(row["messages"]) == 2  # ends on the answer
    assert rows["b" * 16]["messages"][-1]["tool_calls"][0]["id"] == "srv-b"
    assert rows["c" * 16]["messages"][-1] == {"role": "assistant", "content": "I cannot check that."}
    assert "tools" not in rows["f" * 16] and rows["f" * 16]["messages"][-1]["content"] == "new answer"
    # no request after a cut
    assert Counter(first_user(b)[:2] for b in stub.requests) == {"A:": 4, "B:": 1, "C:": 1, "D:": 2, "E:": 1,
                                                                 "F:": 1}


def test_resume_after_an_interruption_gives_the_same_output(tmp_path, capsys):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    write_prepared(whole)
    write_prepared(parts)
    with ScriptedServer().serve() as url:
        assert run_generate(whole, url, capsys)[0] == 0
    # the first run loses A after its first call and D's last turn: the others finish (B, C, E cut)
    lost = ScriptedServer(fail=lambda b: first_user(b)[:2] in ("A:", "D:") and len(b["messages"]) > 3)
    with lost.serve() as url:
        rc, out = run_generate(parts, url, capsys)
    assert rc == 2 and out["generate"]["turns_failed"] == 2  # HTTP 400: a permanent failure, named
    assert out["generate"]["conversations_failed"] == 2 and out["generate"]["tool_mismatch_cut"] == 3
    resumed = ScriptedServer()
    with resumed.serve() as url:
        rc, out = run_generate(parts, url, capsys)
    assert rc == 0, out
    g = out["generate"]
    assert g["turns_skipped_done"] == 1 + 1 + 1 + 1 + 1 + 1 and g["turns_ok"] == 3 + 1
    assert g["turns_total"] == g["turns_skipped_done"] + g["turns_ok"] + g["turns_cut"]
    assert len(resumed.requests) == 4  # only A's and D's missing turns: the cut conversations are settled
    assert (parts / "generate" / "conversations.jsonl").read_bytes() == \
        (whole / "generate" / "conversations.jsonl").read_bytes()
    keys = Counter((r["id"], r["turn"]) for r in read_records(parts / "generate" / "shards"))
    assert max(keys.values()) == 1
    # a third run has nothing to do and sends nothing
    idle = ScriptedServer()
    with idle.serve() as url:
        rc, out = run_generate(parts, url, capsys)
    assert rc == 0 and idle.requests == [] and out["generate"]["tool_mismatch_cut"] == 3


def test_agent_conversations_refused_where_calls_cannot_come_back(tmp_path, capsys, tiny_qwen3):
    src = write_prepared(tmp_path)
    before = src.read_bytes()
    stub = ScriptedServer()
    with stub.serve() as url:
        rc, out = run_generate(tmp_path, url, capsys, "generate.endpoint=completions",
                               f"target.path={tiny_qwen3}")
        assert rc == 2 and "generate.endpoint" in out["error"] and "generate.endpoint=chat" in out["hint"]
        # the tiny target's template renders role and content only: its tools would be lost
        rc, out = run_generate(tmp_path, url, capsys, f"target.path={tiny_qwen3}")
        assert rc == 2 and "target.chat_template" in out["error"] and "target.chat_template" in out["hint"]
        assert "a" * 16 in out["error"]
        rc, out = run_generate(tmp_path, url, capsys, f"target.path={tiny_qwen3}", "--dry-run")
        assert rc == 2 and "target.chat_template" in out["error"]
    assert stub.requests == [] and src.read_bytes() == before
    assert not (tmp_path / "generate" / "conversations.jsonl").exists()
