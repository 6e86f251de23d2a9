"""Conversation bookkeeping for `generate`: which turns to regenerate, prompts, final assembly; the owner of
generate's outputs `generate/conversations.jsonl` (`RunDir.conversations_path`), `failures.jsonl` and
`settings.json`.

Usage:
    convs = read_prepared(rd.prepared_train)      # dflashkit.data.records
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

Files (in the generate stage dir; `regenerate.py` calls the writers, `tokenize` the reader):
    write_conversations(stage_dir, rows)   # conversations.jsonl, atomic: one assembled record per line
    write_failures(stage_dir, failures)    # failures.jsonl, atomic: one failed turn per line
    write_settings(stage_dir, settings) / read_settings(stage_dir)   # the sampling settings of the journal
    path = regenerated_file(rd)            # conversations.jsonl, exit 3 when missing; its records are
                                           # read with `data.records.iter_conversations` (same layout)
The journal `shards/` is `journal.py`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

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
