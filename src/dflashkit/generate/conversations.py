"""Conversation bookkeeping for `generate`: which turns to regenerate, prompts, final assembly.

Usage:
    convs = load_prepared(rd.prepared_train)
    turns = plan_turns(conv["messages"])          # message index of each user turn that gets an answer
    prompt = build_prompt(conv["messages"], turns, answers, t)   # messages to send for turn t
    rec = assemble(conv, [journal records by turn], reasoning="keep", on_length="flag")

Rules: every original assistant message is replaced by the target's own answer. A turn is a user
message followed by an assistant message or ending the conversation; turns are generated in order
and each prompt carries the target's previous answers (without their reasoning, as chat templates
do). With `reasoning: keep` the stored answer is `<think>\\n{reasoning}\\n</think>\\n\\n{content}`
and `meta.reasoning[t]` holds the raw text; with `drop` both are left out. `meta.prompt_tokens[t]`
(the server's usage.prompt_tokens) and `meta.prompt_ids[t]` (a summary of the prompt ids it returned,
`dflashkit.data.drift.ids_summary`) let `tokenize` check that the server saw the prompt it renders.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflashkit.errors import MissingArtifactError, UsageError

ROLES = ("system", "user", "assistant")


def load_prepared(path: Path) -> list[dict[str, Any]]:
    """Read `prepare/train.jsonl`; a malformed line is a UsageError naming file:line."""
    if not path.is_file():
        raise MissingArtifactError("prepared conversations", path, run="dflashkit prepare -c run.yaml")
    convs: list[dict[str, Any]] = []
    seen: set[str] = set()
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise UsageError(f"{where}: not UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})",
                                 hint="re-run `dflashkit prepare -c run.yaml`") from None
            except json.JSONDecodeError as e:
                raise UsageError(f"{where}: not JSON ({e.msg})",
                                 hint="re-run `dflashkit prepare -c run.yaml`") from None
            msgs = rec.get("messages") if isinstance(rec, dict) else None
            if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or not isinstance(msgs, list):
                raise UsageError(f"{where}: expected {{\"id\": str, \"messages\": [...]}}",
                                 hint="re-run `dflashkit prepare -c run.yaml`")
            for j, m in enumerate(msgs):
                if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                    raise UsageError(f"{where}: messages[{j}] needs a role in {ROLES} and string content",
                                     hint="re-run `dflashkit prepare -c run.yaml`")
            if rec["id"] in seen:
                raise UsageError(f"{where}: duplicate id {rec['id']!r}", hint="re-run `dflashkit prepare -c run.yaml`")
            seen.add(rec["id"])
            convs.append(rec)
    return convs


def plan_turns(messages: list[dict[str, Any]]) -> list[int]:
    """Indices of the user messages that receive a regenerated answer, in order."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "user":
            continue
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if nxt in (None, "assistant"):
            out.append(i)
    return out


def build_prompt(messages: list[dict[str, Any]], turns: list[int], answers: list[str], t: int,
                 ) -> list[dict[str, str]]:
    """Messages to send for turn `t`: the originals up to user turn t, answers 0..t-1 in place."""
    out: list[dict[str, str]] = []
    k = 0
    for i, m in enumerate(messages[: turns[t] + 1]):
        if m["role"] == "assistant":
            continue
        out.append({"role": m["role"], "content": m["content"]})
        if k < t and i == turns[k]:
            out.append({"role": "assistant", "content": answers[k]})
            k += 1
    return out


def stored_answer(content: str, reasoning: str | None, mode: str) -> str:
    """The assistant text written to conversations.jsonl (reasoning re-inserted with `keep`)."""
    if mode == "keep" and reasoning:
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{content}"
    return content


def assemble(conv: dict[str, Any], records: list[dict[str, Any]], *, reasoning: str, on_length: str,
             ) -> dict[str, Any] | None:
    """The output record of a finished conversation, or None if `on_length: drop` removes it."""
    messages = conv["messages"]
    turns = plan_turns(messages)
    assert len(records) == len(turns)
    finish = [r.get("finish_reason") for r in records]
    if on_length == "drop" and "length" in finish:
        return None
    answers = [stored_answer(r["content"], r.get("reasoning"), reasoning) for r in records]
    out_msgs = build_prompt(messages, turns + [len(messages)], answers + [""], len(turns)) \
        if turns else [m for m in messages if m["role"] != "assistant"]
    flags = [f"length:turn{t}" for t, fr in enumerate(finish) if fr == "length"] if on_length == "flag" else []
    ids = [r.get("token_ids") for r in records]
    prompt_tokens = [r.get("prompt_tokens") for r in records]
    prompt_ids = [r.get("prompt_ids") for r in records]
    return {
        "id": conv["id"], "source": conv.get("source", ""), "messages": out_msgs,
        "meta": {
            "finish_reasons": finish, "flags": flags,
            "token_ids": ids if all(isinstance(x, list) for x in ids) else None,
            "prompt_tokens": prompt_tokens if any(x is not None for x in prompt_tokens) else None,
            "prompt_ids": prompt_ids if any(x is not None for x in prompt_ids) else None,
            "reasoning": [r.get("reasoning") if reasoning == "keep" else None for r in records],
            "model": records[0].get("model") if records else None,
        },
    }
