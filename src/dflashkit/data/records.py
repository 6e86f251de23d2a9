"""The conversation record every data stage reads and writes, its content id, and JSONL I/O; the owner of
prepare's outputs `prepare/train.jsonl` and `prepare/heldout.jsonl` (`RunDir.prepared_train`, `prepared_heldout`).

Usage:
    conv = Conversation.from_messages("sharegpt", [{"role": "user", "content": "Hi"}])
    conv.id                                   # 16 hex chars: sha256 of the normalised messages
    write_jsonl(path, [c.to_dict() for c in convs])        # atomic, byte-identical on re-runs
    for line_no, obj in read_jsonl(path, on_malformed="fail"):   # UsageError names file:line
        ...
    for conv in iter_conversations(path): ...               # Conversation per record (tokenize)

Prepared conversations: `write_prepared(rd, train, heldout)` is their only writer (the prepare stage);
`read_prepared(path)` reads the train split for `generate` (strict), and `prepared_file(rd, split)`
hands the file to the readers above, exit 3 naming it when it is missing.

Record layout (`prepare/*.jsonl`, `generate/conversations.jsonl`):
    {"id": "<16 hex>", "source": "<name>", "messages": [{"role": ..., "content": ...}], "tools": [...],
     "meta": {...}}
`meta` is optional (generate's finish reasons, flags, server token ids, reasoning); `tools` only for
agent conversations, which use OpenAI's chat shape (`tool_calls` with JSON-string `arguments`, `tool`
turns with `tool_call_id`; thinking inline as `<think>…</think>`). Invariants (`agent_problem`): every
result answers an earlier call, once; every call is answered before the next user or assistant turn,
except those of the last assistant turn. A plain chat record's id does not depend on the agent fields.
Layout in full: docs/training-data.md, "Agent conversations".
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.rundir import atomic_path

ROLES = ("system", "user", "assistant", "tool")
AGENT_KEYS = ("tool_calls", "tool_call_id", "name")  # the message keys kept beside role and content


def content_id(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """Stable id of a conversation: sha256 over its (role, content) pairs — with a message's agent keys
    and the tools when there are any — first 16 hex chars."""
    rows: list[Any] = [[m["role"], m["content"], *([extra] if (extra := {k: m[k] for k in AGENT_KEYS if k in m})
                                                    else [])] for m in messages]
    if tools:
        rows.append(["tools", tools])
    blob = json.dumps(rows, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def inline_reasoning(content: str, reasoning: str | None) -> str:
    """An assistant turn's content with its reasoning inline before it: `<think>\n{reasoning}\n</think>\n\n
    {content}` (the reasoning stripped), or `content` alone when there is no reasoning (None or "")."""
    if reasoning:
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{content}"
    return content


def message_of(m: dict[str, Any]) -> dict[str, Any]:
    """A record's message: its role, content and agent keys (`AGENT_KEYS`), nothing else."""
    return {"role": m["role"], "content": m["content"], **{k: m[k] for k in AGENT_KEYS if k in m}}


def _json_object(text: Any) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (TypeError, ValueError):
        return False


def tools_problem(tools: Any) -> str | None:
    """Why `tools` is not a list of OpenAI function tools, or None."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        return f"`tools` must be a list of function tools, got {type(tools).__name__}"
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            return f"tools[{i}] is not {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"tools[{i}].function.name must be a non-empty string"
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            return f"tools[{i}].function.parameters must be a JSON schema object"
    return None


def message_problem(m: Any, j: int) -> str | None:
    """Why `m` is not a valid message `j` of a record (its own fields only), or None."""
    if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
        return f"messages[{j}] needs a role in {ROLES} and string content"
    role = m["role"]
    if "tool_calls" in m:
        calls = m["tool_calls"]
        if role != "assistant":
            return f"messages[{j}]: a {role} turn has tool_calls (only assistant turns call tools)"
        if not isinstance(calls, list) or not calls:
            return f"messages[{j}].tool_calls must be a non-empty list"
        for i, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(c.get("id"), str) or not c["id"]:
                return f"messages[{j}].tool_calls[{i}] needs an `id` and a `function`"
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                return f"messages[{j}].tool_calls[{i}].function.name must be a non-empty string"
            if not isinstance(fn.get("arguments"), str) or not _json_object(fn["arguments"]):
                return (f"messages[{j}].tool_calls[{i}] ({fn['name']}): arguments are not a JSON object "
                        f"({str(fn.get('arguments'))[:60]!r})")
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            return f"messages[{j}]: a tool turn needs the `tool_call_id` of the call it answers"
    elif "tool_call_id" in m:
        return f"messages[{j}]: a {role} turn has a tool_call_id (only tool turns answer calls)"
    if "name" in m and not isinstance(m["name"], str):
        return f"messages[{j}].name must be a string"
    return None


def agent_problem(messages: list[dict[str, Any]]) -> str | None:
    """Why the calls and results of valid messages do not pair up (module docstring), or None."""
    open_calls: dict[str, int] = {}  # call id -> the assistant turn that made it
    answered: set[str] = set()
    last_assistant = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for j, m in enumerate(messages):
        if m["role"] == "tool":
            cid = m["tool_call_id"]
            if cid in answered:
                return f"messages[{j}]: a second result for tool call {cid!r}"
            if cid not in open_calls:
                return f"messages[{j}]: a tool result for {cid!r}, which no earlier assistant turn called"
            open_calls.pop(cid)
            answered.add(cid)
            continue
        if open_calls and m["role"] in ("user", "assistant"):
            cid, at = next(iter(open_calls.items()))
            return f"messages[{at}]: tool call {cid!r} has no result before messages[{j}] ({m['role']})"
        for c in m.get("tool_calls") or []:
            if c["id"] in open_calls or c["id"] in answered:
                return f"messages[{j}]: tool call id {c['id']!r} is used twice"
            open_calls[c["id"]] = j
    if open_calls and min(open_calls.values()) != last_assistant:
        cid, at = next(iter(open_calls.items()))
        return f"messages[{at}]: tool call {cid!r} has no result"
    return None


def record_problem(messages: Any, tools: Any = None) -> str | None:
    """Why a record's `messages` (and `tools`) are not a conversation, or None: every message valid
    (`message_problem`), the tools a list of function tools (`tools_problem`), calls and results paired
    (`agent_problem`)."""
    if not isinstance(messages, list):
        return "`messages` must be a list"
    for j, m in enumerate(messages):
        if (problem := message_problem(m, j)) is not None:
            return problem
    return tools_problem(tools) or agent_problem(messages)


@dataclass
class Conversation:
    """One normalised conversation: roles in ROLES, string contents, a content-hash id."""

    id: str
    source: str
    messages: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None

    @classmethod
    def from_messages(cls, source: str, messages: list[dict[str, Any]], meta: dict[str, Any] | None = None,
                      tools: list[dict[str, Any]] | None = None) -> "Conversation":
        msgs = [message_of(m) for m in messages]
        tools = tools or None
        return cls(id=content_id(msgs, tools), source=source, messages=msgs, meta=dict(meta or {}), tools=tools)

    @classmethod
    def from_dict(cls, obj: dict[str, Any], where: str = "<record>") -> "Conversation":
        """Parse a record dict (as written by prepare/generate); UsageError names `where` and what is wrong."""
        msgs = obj.get("messages") if isinstance(obj, dict) else None
        tools = obj.get("tools") if isinstance(obj, dict) else None
        problem = record_problem(msgs, tools)
        if problem is not None:
            raise UsageError(f"{where}: not a conversation record: {problem}",
                             hint="records are {\"messages\": [{\"role\", \"content\", …}], \"tools\"?: [...]} "
                             "(docs/training-data.md, agent conversations)")
        assert isinstance(msgs, list)
        meta = obj.get("meta") or {}
        msgs = [message_of(m) for m in msgs]
        return cls(id=str(obj.get("id") or content_id(msgs, tools)), source=str(obj.get("source", "")),
                   messages=msgs, meta=meta if isinstance(meta, dict) else {}, tools=tools or None)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "source": self.source, "messages": self.messages}
        if self.tools:
            out["tools"] = self.tools
        if self.meta:
            out["meta"] = self.meta
        return out

    @property
    def user_chars(self) -> int:
        return sum(len(m["content"]) for m in self.messages if m["role"] == "user")


def open_text(path: str | Path) -> io.TextIOWrapper:
    """Open a UTF-8 text file, transparently gunzipping `*.gz`."""
    p = Path(path)
    if p.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8")
    return open(p, encoding="utf-8")


def read_jsonl(path: str | Path, *, on_malformed: str = "fail",
               bad: list[str] | None = None) -> Iterator[tuple[int, Any]]:
    """Yield (1-based line number, parsed object) for each non-blank line.

    Args:
        path: a `.jsonl` or `.jsonl.gz` file.
        on_malformed: "fail" raises UsageError naming `file:line`; "skip" drops the line.
        bad: when given, "file:line: reason" of each skipped line is appended.

    A line that is not UTF-8 or not JSON is malformed; a truncated `.gz` keeps the complete lines
    read before the cut (skip) or fails naming `file:line` (fail, or when nothing could be read).

    Raises:
        UsageError: a malformed line and on_malformed == "fail", or an unreadable file (exit 2).
    """

    def bad_line(msg: str) -> None:
        if on_malformed == "fail":
            raise UsageError(msg, hint="fix or remove the line, or set data.on_malformed=skip")
        if bad is not None:
            bad.append(msg)

    p = Path(path)
    line_no = 0
    fh = gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb")
    try:
        for line_no, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad_line(f"{path}:{line_no}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                bad_line(f"{path}:{line_no}: malformed JSON ({e.msg} at column {e.colno})")
    except (EOFError, OSError, zlib.error) as e:  # a truncated or corrupt .gz
        what = "truncated gzip stream" if isinstance(e, EOFError) else f"unreadable ({type(e).__name__}: {e})"
        msg = f"{path}:{line_no + 1}: {what}; {line_no} complete lines were read"
        if line_no == 0 or on_malformed == "fail":
            raise UsageError(msg, hint="re-create or re-download the file" + (
                "" if line_no == 0 else ", or set data.on_malformed=skip to keep the complete lines")) from None
        if bad is not None:
            bad.append(msg)
    finally:
        fh.close()


def dumps_record(obj: dict[str, Any]) -> str:
    """One JSONL line: compact, key order kept, UTF-8 (deterministic for identical input)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    """Write rows atomically (temp file + rename); returns the row count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(dumps_record(row) + "\n")
            n += 1
    return n


def iter_conversations(path: str | Path) -> Iterator[Conversation]:
    """Every record of a conversation file (prepare's or generate's), parsed; UsageError names file:line."""
    for line_no, obj in read_jsonl(path, on_malformed="fail"):
        yield Conversation.from_dict(obj, f"{path}:{line_no}")


# -- prepared conversations: prepare/train.jsonl, prepare/heldout.jsonl ----------------------------------
PREPARED_WHAT = {"train": "prepared conversations", "heldout": "held-out prompts"}


def write_prepared(rd: Any, train: Iterable[dict[str, Any]], heldout: Iterable[dict[str, Any]]) -> list[Path]:
    """Write `prepare/train.jsonl` and `prepare/heldout.jsonl` (each atomically); returns their paths."""
    write_jsonl(rd.prepared_train, train)
    write_jsonl(rd.prepared_heldout, heldout)
    return [rd.prepared_train, rd.prepared_heldout]


def prepared_file(rd: Any, split: str = "train") -> Path:
    """The path of prepare's `split` file ("train" | "heldout").

    Raises:
        MissingArtifactError: the file does not exist (exit 3; run `dflashkit prepare`)."""
    path = rd.prepared_train if split == "train" else rd.prepared_heldout
    if not path.is_file():
        raise MissingArtifactError(PREPARED_WHAT[split], path, run="dflashkit prepare -c run.yaml")
    return path


def prepared_lines(rd: Any) -> tuple[int, Path] | None:
    """(non-empty lines, path) of `prepare/train.jsonl`, or None when it does not exist."""
    path = rd.prepared_train
    if not path.is_file():
        return None
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip()), path


def heldout_user_prompts(rd: Any) -> list[str]:
    """The first user message of each held-out conversation ([] when there is no held-out file); lines that
    are not records are skipped."""
    path = rd.prepared_heldout
    out: list[str] = []
    if path.is_file():
        for _, obj in read_jsonl(path, on_malformed="skip"):
            try:
                out += [m["content"] for m in obj["messages"] if m["role"] == "user"][:1]
            except (KeyError, TypeError):
                continue
    return out


def read_prepared(path: Path) -> list[dict[str, Any]]:
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
            problem = record_problem(msgs, rec.get("tools"))
            if problem is not None:
                raise UsageError(f"{where}: {problem}", hint="re-run `dflashkit prepare -c run.yaml`")
            if rec["id"] in seen:
                raise UsageError(f"{where}: duplicate id {rec['id']!r}", hint="re-run `dflashkit prepare -c run.yaml`")
            seen.add(rec["id"])
            convs.append(rec)
    return convs
