"""Read prompt sources of any common shape and convert each record to chat messages.

Usage:
    report = SourceReport(name="sharegpt", path="...")
    for where, obj in iter_source(SourceSection(path="sharegpt"), report, on_malformed="skip"):
        messages, tools = to_record(obj, "auto")   # RecordError(reason, kind) when it cannot be converted
        messages = to_messages(obj)                # the messages alone

Files: `.jsonl`, `.json` (an array, streamed so a truncated file still yields every complete record;
or JSON Lines), `*.gz` of either, `.parquet`, a local HF `datasets` dir, a plain dir of such files, or
an unpacked BFCL data dir (`dflashkit.data.bfcl`). Asset names (`sharegpt`, `humaneval`, `bfcl`)
resolve through `dflashkit.assets.asset_path`.

Formats (auto-detected per record): ShareGPT `conversations: [{from, value}]`, OpenAI `messages:
[{role, content}]`, Alpaca `instruction`/`input`/`output`, plain `prompt` (optionally with
`response`/`completion`), HumanEval `task_id` + `prompt`.

Agent records: OpenAI `tools` / legacy `functions`, assistant `tool_calls` / legacy `function_call`,
`tool` turns answering `tool_call_id` (or the oldest open call of their name); ShareGPT-style
`function_call` / `observation` turns (glaive, xLAM, ToolACE as LLaMA-Factory writes them) become the
same calls and results. Arguments become compact JSON strings, missing call ids `call_<n>`,
`reasoning_content` goes inline as a `<think>` block, and a null content is "". Calls written as text
inside content are not parsed. Every record is checked with `records.record_problem`; a problem is a
RecordError("malformed", kind=`problem_kind(problem)`). Rules: docs/training-data.md.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from dflashkit.assets import ASSETS, asset_path
from dflashkit.data import bfcl
from dflashkit.data.records import inline_reasoning, open_text, read_jsonl, record_problem
from dflashkit.errors import UsageError

if TYPE_CHECKING:
    from dflashkit.config import SourceSection

log = logging.getLogger("dflashkit.data")

CHUNK_CHARS = 1 << 22
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
            "assistant": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
            "system": "system"}
RESULT_ROLES = ("tool", "function", "observation")  # a tool's result (OpenAI, OpenAI legacy, ShareGPT)
CALL_ROLE = "function_call"  # ShareGPT: the assistant calls tools
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
DATA_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


class RecordError(ValueError):
    """A record that cannot become a conversation; `reason` is the counted drop reason, `kind` what was
    wrong with a malformed one (`malformed_by` in prepare's stats)."""

    def __init__(self, reason: str, detail: str, kind: str = "bad_record"):
        super().__init__(detail)
        self.reason, self.kind = reason, kind


# What `records.record_problem` found, by a phrase of its message → the kind counted.
PROBLEM_KINDS = (("has no result", "call_without_result"), ("no earlier assistant turn called", "result_without_call"),
                 ("needs the `tool_call_id`", "result_without_call"), ("a second result", "result_twice"),
                 ("arguments are not a JSON object", "arguments_not_json"), ("is used twice", "call_id_twice"),
                 ("`tools`", "tools_not_a_list"), ("tools[", "bad_tool"), ("tool_calls", "bad_tool_call"))


def problem_kind(problem: str) -> str:
    """The counted kind of a `records.record_problem` message (`bad_record` when none fits)."""
    return next((kind for phrase, kind in PROBLEM_KINDS if phrase in problem), "bad_record")


@dataclass
class SourceReport:
    """What reading one source found: counts, the first problems, a truncated-tail report."""

    name: str
    path: str
    read: int = 0
    malformed_lines: int = 0
    examples: list[str] = field(default_factory=list)
    truncated_tail: dict[str, Any] | None = None
    malformed_by: Counter[str] = field(default_factory=Counter)  # kind → malformed lines/records
    skipped: Counter[str] = field(default_factory=Counter)  # reason → records left out on purpose, unread

    def note(self, msg: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(msg)

    def bad(self, msg: str, kind: str, on_malformed: str) -> None:
        """A malformed line or record the reader drops: UsageError (fail), else named and counted."""
        if on_malformed == "fail":
            raise UsageError(msg, hint="fix or remove the record, or set data.on_malformed=skip")
        self.note(msg)
        self.malformed_lines += 1
        self.malformed_by[kind] += 1


def resolve_source_path(path: str) -> Path:
    """A file/dir path, or an asset name such as `sharegpt` or `humaneval`."""
    p = Path(path).expanduser()
    if p.exists():
        return p

    if path in ASSETS:
        return asset_path(path)
    raise UsageError(f"data source {path!r} does not exist",
                     hint="give a .json/.jsonl(.gz)/.parquet file, a HF datasets dir, or an asset "
                     "name (sharegpt, humaneval, bfcl) in data.sources[].path")


def iter_json_array(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    """Stream the elements of a top-level JSON array, surviving a truncated file.

    Decodes record by record with `JSONDecoder.raw_decode` over a buffer refilled in chunks, so a
    large file is never held as one string. When the file ends inside a record (or without the
    closing `]`), every complete record is still yielded and `report.truncated_tail` records the
    byte offset where the incomplete tail starts and how many bytes were dropped.
    """
    dec = json.JSONDecoder()
    with open_text(path) as fh:
        fh.reconfigure(errors="surrogateescape")  # a file cut mid-character must not raise
        buf, pos, eof, chunk = fh.read(CHUNK_CHARS), 0, False, CHUNK_CHARS
        consumed_bytes = 0  # bytes of text dropped from the buffer's front so far

        def refill() -> None:
            nonlocal buf, pos, eof, consumed_bytes, chunk
            consumed_bytes += len(buf[:pos].encode("utf-8", "surrogateescape"))
            more = fh.read(chunk)
            chunk = min(chunk * 2, 1 << 28) if len(buf) - pos > chunk // 2 else CHUNK_CHARS
            eof = not more
            buf, pos = buf[pos:] + more, 0

        while pos < len(buf) and buf[pos].isspace():
            pos += 1
        if pos >= len(buf) or buf[pos] != "[":
            raise UsageError(f"{path}: expected a JSON array")
        pos += 1
        index, closed, error = 0, False, "missing closing ]"
        while True:
            while pos < len(buf) and (buf[pos].isspace() or buf[pos] == ","):
                pos += 1
            if pos >= len(buf):
                if eof:
                    break
                refill()
                continue
            if buf[pos] == "]":
                closed = True
                break
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if not eof:
                    refill()
                    continue
                error = e.msg
                break
            yield f"{path}[{index}]", obj
            index += 1
            pos = end
            if pos > CHUNK_CHARS:
                refill()
        if not closed:
            tail = buf[pos:]
            dropped = len(tail.encode("utf-8", "surrogateescape"))
            offset = consumed_bytes + len(buf[:pos].encode("utf-8", "surrogateescape"))
            report.truncated_tail = {"byte_offset": offset, "bytes_dropped": dropped,
                                     "complete_records": index,
                                     "error": error}
            log.warning("%s: truncated JSON array: kept %d complete records, dropped %d bytes from "
                        "byte %d", path, index, dropped, offset)


def _first_char(path: Path) -> str:
    with open_text(path) as fh:
        fh.reconfigure(errors="surrogateescape")
        while True:
            c = fh.read(1)
            if not c or not c.isspace():
                return c


def _iter_file(path: Path, report: SourceReport, on_malformed: str) -> Iterator[tuple[str, Any]]:
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        row = 0
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                for obj in batch.to_pylist():
                    yield f"{path}#row{row}", obj
                    row += 1
        except (pa.ArrowException, OSError) as e:
            raise UsageError(f"{path}: not a readable Parquet file after {row} rows "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                             hint="re-create or re-download the file, or remove it from data.sources") from None
        return
    if name.endswith((".json", ".json.gz")):
        try:
            first = _first_char(path)
            if first == "[":
                for where, obj in iter_json_array(path, report):
                    if _utf8_ok(obj, where, report, on_malformed):
                        yield where, obj
                return
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise UsageError(f"{path}: truncated or corrupt gzip ({type(e).__name__}: {e})",
                             hint="re-create or re-download the file") from None
    bad: list[str] = []
    for line_no, obj in read_jsonl(path, on_malformed=on_malformed, bad=bad):
        _count_bad(report, bad)
        yield f"{path}:{line_no}", obj
    _count_bad(report, bad)


def _count_bad(report: SourceReport, bad: list[str]) -> None:
    for msg in bad:
        report.note(msg)
        report.malformed_lines += 1
        report.malformed_by["bad_line"] += 1
    bad.clear()


def _utf8_ok(obj: Any, where: str, report: SourceReport, on_malformed: str) -> bool:
    """A JSON-array record decoded from non-UTF-8 bytes (kept as surrogates) is malformed: named, then
    skipped and counted (False) or failed, per `on_malformed`."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        msg = f"{where}: not UTF-8 (a byte that is not valid UTF-8 near {text[max(0, e.start - 20):e.start]!r})"
        if on_malformed == "fail":
            raise UsageError(msg, hint="fix the file's encoding, or set data.on_malformed=skip") from None
        report.note(msg)
        report.malformed_lines += 1
        report.malformed_by["bad_line"] += 1
        return False
    return True


def iter_source(src: SourceSection, report: SourceReport, *, on_malformed: str = "skip") -> Iterator[tuple[str, Any]]:
    """Yield (location, raw record) for one `data.sources[]` entry, at most `src.max_records`.

    Raises:
        UsageError: missing path, unsupported file type, or a malformed line with on_malformed=fail.
    """
    path = resolve_source_path(src.path)
    if bfcl.is_bfcl_dir(path):
        it = _iter_bfcl(path, src, report, on_malformed)
    elif path.is_dir():
        it = _iter_dir(path, report, on_malformed)
    elif path.name.lower().endswith(DATA_SUFFIXES):
        it = _iter_file(path, report, on_malformed)
    else:
        raise UsageError(f"{path}: unsupported source file type",
                         hint="use .json, .jsonl, .json.gz, .jsonl.gz, .parquet or a HF datasets dir")
    for where, obj in it:
        if src.max_records is not None and report.read >= src.max_records:
            break
        report.read += 1
        yield where, obj


def _iter_bfcl(root: Path, src: SourceSection, report: SourceReport, on_malformed: str) -> Iterator[tuple[str, Any]]:
    """The records of a BFCL data dir in the OpenAI shape (`data.bfcl`), category by category. A prompt-only
    category's records are skipped (counted as `no_ground_truth`) under `answers: original`: there is no
    answer to train on."""
    for category in bfcl.categories(src.bfcl_categories):
        questions, truth_file = bfcl.files(root, category)
        truths: dict[str, Any] | None = None if truth_file is None else {
            str(obj.get("id")): obj.get("ground_truth") for _, obj in _iter_file(truth_file, report, on_malformed)
            if isinstance(obj, dict)}
        for where, obj in _iter_file(questions, report, on_malformed):
            if truths is None and src.answers == "original":
                report.skipped[f"no_ground_truth:{category}"] += 1
                continue
            try:
                yield where, bfcl.to_openai(obj, truths)
            except ValueError as e:
                report.bad(f"{where}: not a BFCL record: {e}", "bad_bfcl_record", on_malformed)


def _iter_dir(path: Path, report: SourceReport, on_malformed: str) -> Iterator[tuple[str, Any]]:
    if any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        import datasets  # lazy: only for HF datasets dirs

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else sorted(ds)[0]
            ds = ds[split]
        for i, row in enumerate(ds):
            yield f"{path}#row{i}", row
        return
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().endswith(DATA_SUFFIXES))
    if not files:
        raise UsageError(f"{path}: no data files (.json/.jsonl/.parquet) and not a HF datasets dir")
    for p in files:
        yield from _iter_file(p, report, on_malformed)


# --------------------------------------------------------------------------------------------
# Record formats → messages
# --------------------------------------------------------------------------------------------


def detect_format(obj: Any) -> str:
    if not isinstance(obj, dict):
        raise RecordError("malformed", f"record is a {type(obj).__name__}, not an object")
    if "messages" in obj:
        return "messages"
    for key in ("conversations", "conversation"):
        turns = obj.get(key)
        if isinstance(turns, list):
            return "sharegpt" if turns and isinstance(turns[0], dict) and "from" in turns[0] else "messages"
    if "instruction" in obj:
        return "alpaca"
    if "task_id" in obj and "prompt" in obj:
        return "humaneval"
    if "prompt" in obj:
        return "prompt"
    raise RecordError("malformed", f"unrecognised record keys {sorted(obj)[:6]}")


def _text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):  # OpenAI content parts
        parts = [p.get("text") for p in value if p.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in parts):
            return "\n".join(parts)
    raise RecordError("malformed", f"{what} is not text ({type(value).__name__})")


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class _Calls:
    """The tool calls of one record being read: ids for calls without one, results paired with open calls."""

    def __init__(self, turns: list[Any]):
        self.used = {c["id"] for t in turns if isinstance(t, dict) and isinstance(t.get("tool_calls"), list)
                     for c in t["tool_calls"] if isinstance(c, dict) and isinstance(c.get("id"), str)}
        self.open: list[tuple[str, str]] = []  # (id, name) of the calls not answered yet, oldest first

    def call(self, c: Any, where: str) -> dict[str, Any]:
        """One call, `{id?, type?, function: {name, arguments}}` or `{name, arguments}`, in the record shape."""
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RecordError("malformed", f"{where} is not a call {{\"name\", \"arguments\"}}", kind="bad_tool_call")
        cid = c["id"] if isinstance(c.get("id"), str) and c["id"] else self._new_id()
        args = fn.get("arguments")
        args = "{}" if args is None or args == "" else args if isinstance(args, str) else _compact(args)
        self.open.append((cid, fn["name"]))
        return {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}

    def _new_id(self) -> str:
        k = 0
        while f"call_{k}" in self.used:
            k += 1
        self.used.add(f"call_{k}")
        return f"call_{k}"

    def answer(self, cid: Any = None, name: Any = None) -> dict[str, str]:
        """The `tool_call_id` and `name` of a result: `cid` when given, else the oldest open call named `name`
        (no name: the oldest open call); {} when none fits (record_problem then names the result)."""
        named = isinstance(name, str) and bool(name)
        hit: tuple[str, str | None] | None
        if isinstance(cid, str) and cid:
            hit = next((o for o in self.open if o[0] == cid), (cid, name if named else None))
        else:
            hit = next((o for o in self.open if not named or o[1] == name), None)
        if hit is None:
            return {"name": name} if named else {}
        self.open = [o for o in self.open if o[0] != hit[0]]
        return {"tool_call_id": hit[0], **({"name": hit[1]} if hit[1] else {})}


def _result(value: Any, i: int) -> str:
    """A tool result's text: a string, text parts, or any JSON value dumped compactly; null is ""."""
    if value is None:
        return ""
    if isinstance(value, (dict, int, float, bool)) or (isinstance(value, list) and not all(
            isinstance(p, dict) and p.get("type", "text") == "text" for p in value)):
        return _compact(value)
    return _text(value, f"turn {i} content")


def _observations(value: Any, n_open: int, i: int) -> list[str]:
    """A ShareGPT observation's results: one, or one per item of a JSON list answering `n_open` > 1 calls."""
    items = value
    if isinstance(value, str) and n_open > 1:
        try:
            items = json.loads(value)
        except ValueError:
            items = value
    if n_open > 1 and isinstance(items, list) and len(items) == n_open:
        return [x if isinstance(x, str) else _compact(x) for x in items]
    return [_result(value, i)]


def _call_list(value: Any, i: int) -> list[Any]:
    """The calls of a ShareGPT function_call turn: a JSON object or list of them (or their text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RecordError("malformed", f"turn {i}: a function_call value is not JSON ({value[:60]!r})",
                              kind="arguments_not_json") from None
    return value if isinstance(value, list) else [value]


def _turns(turns: Any, role_key: str, content_key: str, fallback_content: str | None = None) -> list[dict]:
    """The messages of a turn list (module docstring: chat turns, and the agent ones of both shapes)."""
    if not isinstance(turns, list):
        raise RecordError("malformed", "turns are not a list")
    calls, sharegpt = _Calls(turns), role_key == "from"
    out: list[dict[str, Any]] = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RecordError("malformed", f"turn {i} is not an object")
        raw = str(t.get(role_key, "")).lower()
        value = t.get(content_key if content_key in t or fallback_content is None else fallback_content)
        if raw == CALL_ROLE:
            new = [calls.call(c, f"turn {i} call {k}") for k, c in enumerate(_call_list(value, i))]
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = out[-1].get("tool_calls", []) + new
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": new})
            continue
        if raw in RESULT_ROLES:
            if sharegpt:
                out += [{"role": "tool", "content": r, **calls.answer()}
                        for r in _observations(value, len(calls.open), i)]
            else:
                out.append({"role": "tool", "content": _result(value, i),
                            **calls.answer(t.get("tool_call_id"), t.get("name"))})
            continue
        role = ROLE_MAP.get(raw)
        if role is None:
            raise RecordError("malformed", f"turn {i}: unsupported role {t.get(role_key)!r}")
        raw_calls = t.get("tool_calls") or ([t["function_call"]] if t.get("function_call") else [])
        if role == "assistant" and raw_calls:
            if not isinstance(raw_calls, list):
                raise RecordError("malformed", f"turn {i}: tool_calls is not a list", kind="bad_tool_call")
            msg: dict[str, Any] = {"role": role, "content": "" if value is None else _text(value, f"turn {i} content"),
                                   "tool_calls": [calls.call(c, f"turn {i} tool_calls[{k}]")
                                                  for k, c in enumerate(raw_calls)]}
        else:
            msg = {"role": role, "content": _text(value, f"turn {i} content")}
            if t.get("tool_calls"):  # on a turn that is not the assistant's: record_problem names it
                msg["tool_calls"] = t["tool_calls"]
        reasoning = t.get("reasoning_content") or t.get("reasoning")
        if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            msg["content"] = inline_reasoning(msg["content"], reasoning)
        out.append(msg)
    return out


def _tools(obj: dict[str, Any]) -> Any:
    """A record's `tools` (or legacy `functions`) as OpenAI function tools: a JSON string is parsed, bare
    schemas {name, description, parameters} are wrapped; None when there are none."""
    raw = obj.get("tools", obj.get("functions"))
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = json.loads(raw)
        except ValueError:
            raise RecordError("malformed", "`tools` is a string that is not JSON", kind="tools_not_a_list") from None
    if isinstance(raw, list):
        raw = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
               if isinstance(t, dict) and "function" not in t and "name" in t else t for t in raw]
    return raw or None


def to_messages(obj: Any, fmt: str = "auto") -> list[dict[str, Any]]:
    """The messages of one raw record (`to_record`, without its tools)."""
    return to_record(obj, fmt)[0]


def to_record(obj: Any, fmt: str = "auto") -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Convert one raw record into (messages, tools): [{role, content, …agent keys}] in the record shape of
    `data.records` (roles: system/user/assistant/tool), tools None when it has none.

    Raises:
        RecordError: with reason "malformed" when the record does not fit the format or is not a valid
            conversation (`records.record_problem`; `kind` says what is wrong).
    """
    messages = _messages(obj, fmt)
    tools = _tools(obj) if isinstance(obj, dict) else None
    problem = record_problem(messages, tools)
    if problem is not None:
        raise RecordError("malformed", problem, kind=problem_kind(problem))
    return messages, tools


def _messages(obj: Any, fmt: str) -> list[dict[str, Any]]:
    fmt = detect_format(obj) if fmt == "auto" else fmt
    if not isinstance(obj, dict):
        raise RecordError("malformed", f"record is a {type(obj).__name__}, not an object")
    if fmt == "sharegpt":
        turns = obj.get("conversations", obj.get("conversation"))
        msgs = _turns(turns, "from", "value", fallback_content="content")
        if isinstance(obj.get("system"), str) and obj["system"].strip():
            msgs.insert(0, {"role": "system", "content": obj["system"]})
        return msgs
    if fmt == "messages":
        turns = obj.get("messages", obj.get("conversations", obj.get("conversation")))
        return _turns(turns, "role", "content", fallback_content="value")
    if fmt == "alpaca":
        user = _text(obj.get("instruction"), "instruction")
        extra = obj.get("input") or ""
        if extra:
            user = user.rstrip() + "\n\n" + _text(extra, "input")
        msgs = [{"role": "user", "content": user}]
        if obj.get("output"):
            msgs.append({"role": "assistant", "content": _text(obj["output"], "output")})
        return msgs
    if fmt == "humaneval":
        prompt = _text(obj.get("prompt"), "prompt")
        msgs = [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=prompt)}]
        if isinstance(obj.get("canonical_solution"), str) and obj["canonical_solution"].strip():
            # the reference solution as the answer (what `answers: original` trains on)
            msgs.append({"role": "assistant",
                         "content": f"```python\n{prompt}{obj['canonical_solution'].rstrip()}\n```"})
        return msgs
    if fmt == "prompt":
        msgs = []
        if isinstance(obj.get("system"), str) and obj["system"].strip():
            msgs.append({"role": "system", "content": obj["system"]})
        msgs.append({"role": "user", "content": _text(obj.get("prompt"), "prompt")})
        for key in ("response", "completion"):
            if obj.get(key):
                msgs.append({"role": "assistant", "content": _text(obj[key], key)})
                break
        return msgs
    raise RecordError("malformed", f"unknown format {fmt!r}")
