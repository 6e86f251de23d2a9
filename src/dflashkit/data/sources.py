"""Read prompt sources of any common shape and convert each record to chat messages.

Usage:
    report = SourceReport(name="sharegpt", path="...")
    for where, obj in iter_source(SourceSection(path="sharegpt"), report, on_malformed="skip"):
        messages = to_messages(obj, "auto")      # RecordError(reason) when it cannot be converted

Files: `.jsonl`, `.json` (an array, streamed record by record so a truncated file still yields
every complete record; or JSON Lines under a .json name), `*.gz` of either, `.parquet`, a local
HF `datasets` dir (`save_to_disk`), or a plain dir of such files. Asset names (`sharegpt`,
`humaneval`) resolve through `dflashkit.assets.asset_path`.

Formats (auto-detected per record): ShareGPT `conversations: [{from, value}]` (human/gpt/system),
OpenAI `messages: [{role, content}]`, Alpaca `instruction`/`input`/`output`, plain `prompt`
(optionally with `response`/`completion`), HumanEval `task_id` + `prompt`.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from dflashkit.data.records import open_text, read_jsonl
from dflashkit.errors import UsageError

if TYPE_CHECKING:
    from dflashkit.config import SourceSection

log = logging.getLogger("dflashkit.data")

CHUNK_CHARS = 1 << 22
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
            "assistant": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
            "system": "system"}
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
DATA_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


class RecordError(ValueError):
    """A record that cannot become a conversation; `reason` is the counted drop reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass
class SourceReport:
    """What reading one source found: counts, the first problems, a truncated-tail report."""

    name: str
    path: str
    read: int = 0
    malformed_lines: int = 0
    examples: list[str] = field(default_factory=list)
    truncated_tail: dict[str, Any] | None = None

    def note(self, msg: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(msg)


def resolve_source_path(path: str) -> Path:
    """A file/dir path, or an asset name such as `sharegpt` or `humaneval`."""
    p = Path(path).expanduser()
    if p.exists():
        return p
    from dflashkit.assets import ASSETS, asset_path

    if path in ASSETS:
        return asset_path(path)
    raise UsageError(f"data source {path!r} does not exist",
                     hint="give a .json/.jsonl(.gz)/.parquet file, a HF datasets dir, or an asset "
                     "name (sharegpt, humaneval) in data.sources[].path")


def iter_json_array(path: Path, report: SourceReport) -> Iterator[tuple[str, Any]]:
    """Stream the elements of a top-level JSON array, surviving a truncated file.

    Decodes record by record with `JSONDecoder.raw_decode` over a buffer refilled in chunks, so a
    125 MB file is never held as one string. When the file ends inside a record (or without the
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
        for msg in bad:
            report.note(msg)
        report.malformed_lines += len(bad)
        bad.clear()
        yield f"{path}:{line_no}", obj
    for msg in bad:
        report.note(msg)
    report.malformed_lines += len(bad)


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
        return False
    return True


def iter_source(src: SourceSection, report: SourceReport, *, on_malformed: str = "skip") -> Iterator[tuple[str, Any]]:
    """Yield (location, raw record) for one `data.sources[]` entry, at most `src.max_records`.

    Raises:
        UsageError: missing path, unsupported file type, or a malformed line with on_malformed=fail.
    """
    path = resolve_source_path(src.path)
    if path.is_dir():
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


def _turns(turns: Any, role_key: str, content_key: str, fallback_content: str | None = None) -> list[dict]:
    if not isinstance(turns, list):
        raise RecordError("malformed", "turns are not a list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RecordError("malformed", f"turn {i} is not an object")
        role = ROLE_MAP.get(str(t.get(role_key, "")).lower())
        if role is None:
            raise RecordError("malformed", f"turn {i}: unsupported role {t.get(role_key)!r}")
        key = content_key if content_key in t or fallback_content is None else fallback_content
        out.append({"role": role, "content": _text(t.get(key), f"turn {i} content")})
    return out


def to_messages(obj: Any, fmt: str = "auto") -> list[dict[str, str]]:
    """Convert one raw record into [{role, content}] (roles: system/user/assistant).

    Raises:
        RecordError: with reason "malformed" when the record does not fit the format.
    """
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
