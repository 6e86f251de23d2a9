"""Conversation bookkeeping for `generate`: which turns to regenerate, prompts, final assembly; the owner of
generate's outputs `generate/conversations.jsonl` (`RunDir.conversations_path`), `failures.jsonl` and
`settings.json`.

Usage:
    convs = read_prepared(rd.prepared_train)      # dflashkit.data.records
    turns = plan_turns(conv["messages"])          # index of the message each regenerated answer follows
    prompt = build_prompt(conv["messages"], turns, answers, t)   # messages to send for turn t
    cut = tool_mismatch(conv["messages"], turns, t, calls)       # does the conversation end at answer t?
    n, cut = settled(conv, journal_records_by_turn)              # turns the journal settles, in order
    rec = assemble(conv, [journal records by turn], reasoning="keep", on_length="flag", cut=cut)
    write_conversations(stage_dir, rows) / write_failures(stage_dir, failures)   # atomic JSONL
    write_settings(stage_dir, settings) / read_settings(stage_dir)   # the journal's sampling settings
    path = regenerated_file(rd)            # conversations.jsonl, exit 3 when missing

Rules: every original assistant message is replaced by the target's own answer. A turn is a user
message (or the last tool result of a group) followed by an assistant message or the end; turns are
generated in order, each prompt carrying the target's previous answers exactly as stored
(`answer_message`), so the server renders the very messages `tokenize` renders. `reasoning: keep`
stores `<think>…</think>` before the content; `meta` lists (prompt tokens, prompt id summaries,
reasoning) have one entry per assistant message. Agent turns keep the target's `tool_calls` and the
data's tool results while the calls match the data's; on a mismatch the conversation is cut after
that answer (`meta.cut_at_tool_mismatch`, a `tool_mismatch:turn<t>` flag). Details:
docs/training-data.md, "Regenerating agent turns". The journal `shards/` is `journal.py`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from dflashkit.data.records import inline_reasoning, message_of
from dflashkit.errors import MissingArtifactError
from dflashkit.rundir import atomic_path, atomic_write_json, read_json

CONVERSATIONS_FILE = "conversations.jsonl"
FAILURES_FILE = "failures.jsonl"
SETTINGS_FILE = "settings.json"


def write_conversations(stage_dir: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write `conversations.jsonl` atomically, one record per line, as `rows` yields them."""
    with atomic_path(Path(stage_dir) / CONVERSATIONS_FILE) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_failures(stage_dir: Path, failures: list[dict[str, Any]]) -> None:
    """Write `failures.jsonl` atomically (one row per failed turn; empty when none failed)."""
    with atomic_path(Path(stage_dir) / FAILURES_FILE) as tmp:
        tmp.write_text("".join(json.dumps(f, ensure_ascii=False) + "\n" for f in failures), encoding="utf-8")


def write_settings(stage_dir: Path, settings: dict[str, Any]) -> None:
    atomic_write_json(Path(stage_dir) / SETTINGS_FILE, settings)


def read_settings(stage_dir: Path) -> dict[str, Any] | None:
    """The settings the journal in `stage_dir` was generated with, or None when there are none."""
    path = Path(stage_dir) / SETTINGS_FILE
    return read_json(path) if path.is_file() else None


def regenerated_file(rd: Any) -> Path:
    """`generate/conversations.jsonl`.

    Raises:
        MissingArtifactError: it does not exist (exit 3; run `dflashkit generate`)."""
    path = rd.conversations_path
    if not path.is_file():
        raise MissingArtifactError("generated conversations (or set tokenize.source=prepare to train on "
                                   "the dataset's own answers)", path, run="dflashkit generate -c run.yaml")
    return path


def plan_turns(messages: list[dict[str, Any]]) -> list[int]:
    """Index of the message each regenerated answer follows, in order: a user message or a tool result,
    followed by an assistant message or ending the conversation."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] not in ("user", "tool"):
            continue
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if nxt in (None, "assistant"):
            out.append(i)
    return out


def build_prompt(messages: list[dict[str, Any]], turns: list[int], answers: list[Any], t: int,
                 ) -> list[dict[str, Any]]:
    """Messages to send for turn `t`: the originals up to message `turns[t]`, the data's assistant messages
    left out and answers 0..t-1 (assistant message dicts, or plain strings) in their place; the tool results
    after answer k answer its calls in order (their `tool_call_id`s re-paired to the answer's call ids)."""
    out: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []  # the calls of the last answer placed
    k, j = 0, 0  # the next answer to place; the results seen since the last one
    for i, m in enumerate(messages[: turns[t] + 1]):
        if m["role"] == "assistant":
            continue
        msg = message_of(m)
        if m["role"] == "tool":
            if j < len(calls):
                msg["tool_call_id"] = calls[j]["id"]
            j += 1
        out.append(msg)
        if k < t and i == turns[k]:
            answer = answers[k] if isinstance(answers[k], dict) else {"role": "assistant", "content": answers[k]}
            out.append(answer)
            k, calls, j = k + 1, answer.get("tool_calls") or [], 0
    return out


def _results_after(messages: list[dict[str, Any]], turns: list[int], t: int) -> tuple[int, list[dict[str, Any]]]:
    """(index of the first message after the data's answer to turn t, the tool results that follow it)."""
    q = turns[t] + 1
    while q < len(messages) and messages[q]["role"] == "assistant":
        q += 1
    r = q
    while r < len(messages) and messages[r]["role"] == "tool":
        r += 1
    return q, messages[q:r]


def tool_mismatch(messages: list[dict[str, Any]], turns: list[int], t: int, calls: list[dict[str, Any]] | None,
                  ) -> dict[str, Any] | None:
    """Why the conversation ends at the target's answer to turn `t` (its `calls`), or None: the function
    names the data's following tool results answer differ from those it called, in order ("expected" and
    "called", [] for none). An answer that nothing follows in the data is never cut."""
    q, results = _results_after(messages, turns, t)
    if q >= len(messages):
        return None
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}
    expected = [names.get(m["tool_call_id"], m.get("name", "")) for m in results]
    called = [c["function"]["name"] for c in calls or []]
    return None if called == expected else {"turn": t, "expected": expected, "called": called}


def own_call_ids(calls: list[dict[str, Any]] | None, t: int, used: set[str]) -> list[dict[str, Any]] | None:
    """The target's calls of turn `t` with ids unique in the conversation (`used`, updated): the server's
    id, or `call_<t>_<k>` where it gave none or one an earlier call of the conversation has."""
    if not calls:
        return None
    out = []
    for k, c in enumerate(calls):
        cid = c.get("id") or ""
        if not isinstance(cid, str) or not cid or cid in used:
            cid = f"call_{t}_{k}"
            while cid in used:
                cid += "_"
        used.add(cid)
        out.append({**c, "id": cid})
    return out


def stored_answer(content: str, reasoning: str | None, mode: str) -> str:
    """The assistant text written to conversations.jsonl (reasoning re-inserted with `keep`)."""
    return inline_reasoning(content, reasoning) if mode == "keep" else content


def answer_message(rec: dict[str, Any], reasoning: str) -> dict[str, Any]:
    """The assistant message of a journal record, as stored and as later prompts carry it: the content
    (`stored_answer`) and the target's tool calls when it made any."""
    msg: dict[str, Any] = {"role": "assistant", "content": stored_answer(rec["content"], rec.get("reasoning"),
                                                                         reasoning)}
    if rec.get("tool_calls"):
        msg["tool_calls"] = rec["tool_calls"]
    return msg


def settled(conv: dict[str, Any], have: dict[int, dict[str, Any]]) -> tuple[int, dict[str, Any] | None]:
    """(n, cut): the journal records `have` (by turn) settle turns 0..n-1 of `conv`, in order: up to the
    first missing one, or up to and including a turn whose answer cuts the conversation (`cut`, from
    `tool_mismatch`). The conversation is finished when `cut` is set or n is its number of turns."""
    messages = conv["messages"]
    turns = plan_turns(messages)
    for t in range(len(turns)):
        rec = have.get(t)
        if rec is None:
            return t, None
        cut = tool_mismatch(messages, turns, t, rec.get("tool_calls"))
        if cut is not None:
            return t + 1, cut
    return len(turns), None


def assemble(conv: dict[str, Any], records: list[dict[str, Any]], *, reasoning: str, on_length: str,
             cut: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The output record of a finished conversation, or None if `on_length: drop` removes it. `records`
    has one journal record per turn, up to the cut turn when `cut` (`settled`) is set."""
    messages = conv["messages"]
    turns = plan_turns(messages)
    assert len(records) == len(turns) or (cut is not None and len(records) == cut["turn"] + 1)
    finish = [r.get("finish_reason") for r in records]
    if on_length == "drop" and "length" in finish:
        return None
    answers = [answer_message(r, reasoning) for r in records]
    if cut is not None:
        out_msgs = build_prompt(messages, turns, answers, cut["turn"]) + [answers[-1]]
    elif turns:
        out_msgs = build_prompt(messages, turns + [len(messages)], answers + [""], len(turns))
    else:
        out_msgs = [message_of(m) for m in messages if m["role"] != "assistant"]
    flags = [f"length:turn{t}" for t, fr in enumerate(finish) if fr == "length"] if on_length == "flag" else []
    ids = [r.get("token_ids") for r in records]
    prompt_tokens = [r.get("prompt_tokens") for r in records]
    prompt_ids = [r.get("prompt_ids") for r in records]
    meta: dict[str, Any] = {
        "finish_reasons": finish, "flags": flags + ([f"tool_mismatch:turn{cut['turn']}"] if cut else []),
        "token_ids": ids if all(isinstance(x, list) for x in ids) else None,
        "prompt_tokens": prompt_tokens if any(x is not None for x in prompt_tokens) else None,
        "prompt_ids": prompt_ids if any(x is not None for x in prompt_ids) else None,
        "reasoning": [r.get("reasoning") if reasoning == "keep" else None for r in records],
        "model": records[0].get("model") if records else None,
    }
    if cut is not None:
        meta["cut_at_tool_mismatch"] = cut
    out: dict[str, Any] = {"id": conv["id"], "source": conv.get("source", ""), "messages": out_msgs}
    if conv.get("tools"):
        out["tools"] = conv["tools"]
    out["meta"] = meta
    return out
