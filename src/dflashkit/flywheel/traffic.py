"""Recorded traffic as training data: the window since a cursor, its checks, and prepare's conversation format.

Usage:
    fp = run_fingerprint(cfg)                                  # the recorder's fingerprint of the run's target
    win = read_window(record_dir, cursor, expected=fp, on_corrupt="skip")
    win.records                                                # new records, oldest first (by `time`)
    win.cursor                                                 # {segment: complete lines consumed} after it
    train, heldout = split_newest(win.records, fraction=0.2, minimum=2, maximum=64)
    conv = to_conversation(rec)                                # prepare/tokenize's record (the reply = the turn)

A record dir is what `serving/record.py` writes (its module docstring has the layout): JSONL segments
`records-NNNNNNNN.jsonl`, read in name order, one record a line; a chat record's `messages` end with the target's
reply, `target.fingerprint` names who served it, `completion_token_ids` are the reply's ids. Records of
/v1/completions (no messages) are skipped and counted.
Only complete lines (ending in a newline) are read: a line still being written stays for the next round. The
cursor counts the complete lines consumed per segment; nothing in the record dir is ever written or moved.
Refusals (exit 2, `UsageError`, before anything is written): a record served by another target or tokenizer
(its fingerprint differs from the run's), naming file:line; a segment shorter than the cursor says it was
rewritten. A corrupt line (not JSON, or not a record) is named file:line and skipped and counted
(`learn.on_corrupt: skip`) or refused (`fail`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.data.records import inline_reasoning, record_problem
from dflashkit.errors import UsageError
from dflashkit.serving.record import complete_lines, section_fingerprint, segments

log = logging.getLogger("dflashkit.learn")

def run_fingerprint(cfg: Any) -> str:
    """The fingerprint the recorder writes for the run's target (`serving.record.section_fingerprint`:
    record.target_fingerprint when set, else the digest of target.path's config.json, the tokenizer files and
    target.chat_template)."""
    return section_fingerprint(cfg.target, cfg.record.target_fingerprint)[0]


@dataclass
class Window:
    """The records of one round (oldest first), the cursor after them and the corrupt lines skipped."""

    records: list[dict[str, Any]]
    cursor: dict[str, int]
    corrupt: list[str] = field(default_factory=list)   # "file:line: why"
    span: dict[str, list[int]] = field(default_factory=dict)  # segment -> [first line, last line] read (1-based)
    skipped: int = 0   # /v1/completions records (no conversation to train on)
    earlier: list[dict[str, Any]] = field(default_factory=list)  # `since` → cursor (oldest first), not in `records`


def record_error(obj: Any) -> str | None:
    """Why `obj` is not a chat traffic record, or None."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    for key in ("id", "messages", "target"):
        if key not in obj:
            return f"no `{key}`"
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "assistant":
        return "`messages` must end with the target's reply (an assistant turn)"
    if not isinstance(obj["target"], dict) or not isinstance(obj["target"].get("fingerprint"), str):
        return "`target.fingerprint` must be a string"
    ids = obj.get("completion_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
        return "`completion_token_ids` must be a list of token ids"
    try:
        conv = to_conversation(obj)
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        return f"cannot build a conversation ({type(e).__name__}: {e})"
    return record_problem(conv["messages"], conv.get("tools"))


def to_conversation(rec: dict[str, Any]) -> dict[str, Any]:
    """The prepare-format conversation of a record: its messages, the last one the target's reply (its reasoning
    inline, tool calls with JSON-string arguments); `meta.completion_ids` = the reply's token ids when recorded."""
    msgs = [dict(m) for m in rec["messages"]]
    reply = msgs[-1]
    reply["content"] = inline_reasoning(reply.get("content") or "", reply.pop("reasoning_content", None))
    if reply.get("tool_calls"):
        reply["tool_calls"] = [{"id": c.get("id") or f"call_{i}", "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": c["function"]["arguments"]
                                             if isinstance(c["function"]["arguments"], str)
                                             else json.dumps(c["function"]["arguments"])}}
                               for i, c in enumerate(reply["tool_calls"])]
    else:
        reply.pop("tool_calls", None)
    for m in msgs:
        if m.get("content") is None:
            m["content"] = ""
    tools = rec.get("tools") or None
    out: dict[str, Any] = {"id": str(rec["id"]), "source": str(rec.get("source") or ("agent" if tools else "chat")),
                           "messages": msgs}
    if tools:
        out["tools"] = tools
    meta: dict[str, Any] = {"recorded_at": rec.get("time")}
    if rec.get("completion_token_ids") is not None:
        meta["completion_ids"] = list(rec["completion_token_ids"])
    if rec.get("chat_template_kwargs"):
        meta["chat_template_kwargs"] = rec["chat_template_kwargs"]
    out["meta"] = meta
    return out


def read_window(record_dir: str | Path, cursor: dict[str, int], *, expected: str | None,
                on_corrupt: str = "skip", since: dict[str, int] | None = None) -> Window:
    """The records after `cursor` (see the module docstring), oldest first by `time` (then file, line).

    `since` (a cursor at or before `cursor`: where the serving drafter's unlearned traffic starts) also reads, in
    the same pass, the records between it and `cursor` into `Window.earlier` (oldest first; their corrupt lines are
    skipped quietly, the rounds that read them reported them); everything else describes the new records only."""
    found: list[tuple[Any, str, int, dict[str, Any]]] = []
    before: list[tuple[Any, str, int, dict[str, Any]]] = []
    new_cursor: dict[str, int] = {}
    corrupt: list[str] = []
    span: dict[str, list[int]] = {}
    skipped = 0
    for path in segments(record_dir, named="--records"):
        name = path.name
        lines = complete_lines(path)
        done = int(cursor.get(name, 0))
        if len(lines) < done:
            raise UsageError(f"{path}: {len(lines)} complete lines, but earlier rounds consumed {done}: the segment "
                             "was rewritten", hint="records are append-only; restore the segment, or start a new "
                             "learn cursor (remove <run_dir>/learn/cursor.json) to read everything again")
        for n in range(done if since is None else min(done, int(since.get(name, 0))), len(lines)):
            where, new = f"{path}:{n + 1}", n >= done
            raw = lines[n].strip()
            if not raw:
                continue
            why: str | None
            try:
                obj = json.loads(raw)
            except ValueError as e:
                obj, why = None, f"not JSON ({e})"
            else:
                completions = isinstance(obj, dict) and (obj.get("endpoint") == "completions"
                                                         or ("messages" not in obj and "prompt" in obj))
                why = None if completions else record_error(obj)
            if why is not None and not new:
                continue
            if why is not None:
                if on_corrupt == "fail":
                    raise UsageError(f"{where}: corrupt record: {why}",
                                     hint="fix or remove that line, or set learn.on_corrupt=skip to skip and count it")
                log.warning("%s: corrupt record skipped: %s", where, why)
                corrupt.append(f"{where}: {why}")
                continue
            assert isinstance(obj, dict)
            if obj.get("endpoint") == "completions" or "messages" not in obj and "prompt" in obj:
                skipped += new
                continue
            if expected is not None and obj["target"]["fingerprint"] != expected:
                raise UsageError(f"{where}: traffic from another target or tokenizer (fingerprint "
                                 f"{obj['target']['fingerprint'][:16]}…; this run's target is {expected[:16]}…)",
                                 hint="learn only from traffic its own target served: point --records at that "
                                      "target's record dir, or set target.* to the target that served it")
            if not new:
                before.append((obj.get("time") or 0, name, n, obj))
                continue
            found.append((obj.get("time") or 0, name, n, obj))
            span.setdefault(name, [n + 1, n + 1])[1] = n + 1
        new_cursor[name] = len(lines)
    records = [t[3] for t in sorted(found, key=_by_time)]
    ids = {str(r["id"]) for r in records}
    return Window(records=records, cursor=new_cursor, corrupt=corrupt, span=span, skipped=skipped,
                  earlier=[t[3] for t in sorted(before, key=_by_time) if str(t[3]["id"]) not in ids])


def _by_time(t: tuple[Any, str, int, dict[str, Any]]) -> tuple[float, str, int]:
    return float(t[0]) if isinstance(t[0], (int, float)) else 0.0, t[1], t[2]


def split_newest(records: list[dict[str, Any]], *, fraction: float, minimum: int,
                 maximum: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out): the held-out slice is the newest records (the list is oldest first), `fraction` of
    them, at least `minimum` and at most `maximum`, always leaving one to train on."""
    n = len(records)
    k = min(max(int(round(n * fraction)), minimum), maximum, max(0, n - 1))
    return records[:n - k], records[n - k:]
