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
`read_prepared(path)` reads the train split for `generate` (strict: ids, roles, no duplicates), and
`prepared_file(rd, split)` hands the file to the record readers above (tokenize: `iter_conversations`;
eval's held-out prompts: `read_jsonl`), exit 3 naming it when it is missing. `prepared_lines` (the
data-size estimate) and `heldout_user_prompts` (`bench serve`'s prompts) are built on them.

Record layout (`prepare/train.jsonl`, `prepare/heldout.jsonl`, `generate/conversations.jsonl`):
    {"id": "<16 hex>", "source": "<name>", "messages": [{"role": ..., "content": ...}], "meta": {...}}
`meta` is optional (generate adds finish reasons, flags, server token ids and reasoning).
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

ROLES = ("system", "user", "assistant")


def content_id(messages: list[dict[str, str]]) -> str:
    """Stable id of a conversation: sha256 over its (role, content) pairs, first 16 hex chars."""
    blob = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


@dataclass
class Conversation:
    """One normalised conversation: roles in ROLES, string contents, a content-hash id."""

    id: str
    source: str
    messages: list[dict[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_messages(cls, source: str, messages: list[dict[str, str]],
                      meta: dict[str, Any] | None = None) -> "Conversation":
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        return cls(id=content_id(msgs), source=source, messages=msgs, meta=dict(meta or {}))

    @classmethod
    def from_dict(cls, obj: dict[str, Any], where: str = "<record>") -> "Conversation":
        """Parse a record dict (as written by prepare/generate); UsageError names `where`."""
        msgs = obj.get("messages") if isinstance(obj, dict) else None
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                for m in msgs):
            raise UsageError(f"{where}: not a conversation record (need `messages`: a list of "
                             f"{{role: {'|'.join(ROLES)}, content: str}})")
        meta = obj.get("meta") or {}
        return cls(id=str(obj.get("id") or content_id(msgs)), source=str(obj.get("source", "")),
                   messages=[{"role": m["role"], "content": m["content"]} for m in msgs],
                   meta=meta if isinstance(meta, dict) else {})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "source": self.source, "messages": self.messages}
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
            for j, m in enumerate(msgs):
                if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                    raise UsageError(f"{where}: messages[{j}] needs a role in {ROLES} and string content",
                                     hint="re-run `dflashkit prepare -c run.yaml`")
            if rec["id"] in seen:
                raise UsageError(f"{where}: duplicate id {rec['id']!r}", hint="re-run `dflashkit prepare -c run.yaml`")
            seen.add(rec["id"])
            convs.append(rec)
    return convs
