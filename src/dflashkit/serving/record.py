"""Recorded traffic: the one writer (`Recorder`) and the readers (`read_recorded`; `segments` and `complete_lines`
for a reader that keeps its own cursor, `learn`'s) of a record dir.

Usage:
    rec = Recorder(root, fingerprint=target_fingerprint(model_dir), policy=RecordPolicy.from_config(cfg))
    rec.open()                                   # lock, repair what a kill left, start a new segment
    rid = rec.write(chat_record(body, reply, ...), features=None)   # on disk (fsync'd) when it returns
    rec.close()
    for rec in read_recorded(root, report=(r := RecordReport())): ...   # r.partial: torn lines skipped
    for seg in segments(root): lines = complete_lines(seg)   # write order; a torn or open last line left out
    feats = read_features(root, rec)             # [rows, len(layer_ids)·H] or None

Layout of a record dir (mode 0700; every file 0600):
    .lock                                   flock of the one writer (a second one is refused, exit 2)
    records-00000001.jsonl                  segments, written in order of their number; one record a line
    records-00000001.features.safetensors   the segment's features (serve.record_features), written when the
                                            segment closes: one tensor per record, named by its id
    records-00000002.features/<id>.safetensors   the open segment's features, one file per record

A record (one line, JSON) is a `prepare` source record (`data.sources`, the OpenAI "messages" shape,
or "prompt"/"completion" for /v1/completions) with these keys:
    id                    32 hex (uuid4): unique; a line's id is never written twice
    v                     1 (this layout)
    time                  the request's arrival, unix seconds (float)
    endpoint              "chat" | "completions"
    messages              chat: the request's messages + the target's reply as the last turn
                          {"role": "assistant", "content", "tool_calls"?, "reasoning_content"?}
    tools                 chat: the request's tools (absent without)
    chat_template_kwargs  chat: as sent (absent when not sent); thinking: its enable_thinking (null if unset)
    prompt, completion    completions: the prompt text (absent for token-id prompts) and the reply text
    prompt_token_ids      where the server returns them (ours always; vLLM with return_token_ids)
    completion_token_ids  likewise (the completion's ids as the target committed them, stop token included)
    finish_reason         as answered ("stop", "length", "tool_calls")
    sampling              {temperature, top_p, top_k, max_tokens, seed} as sent (absent keys: server default)
    model                 the served model name
    target                {"fingerprint": <str>, "how": "files" | "given" | "upstream"}: who served it
                          (`target_fingerprint`; `learn` refuses records whose fingerprint is not its target's)
    features              only with recorded features: {"file": <segment>.features.safetensors, "key": <id>,
                          "rows": n, "layer_ids": [...], "dtype": "float32"}: the target's outputs of decoder
                          layers `layer_ids`, concatenated (what `capture` stores as `features`), for the first
                          n = len(prompt_token_ids) + len(completion_token_ids) − 1 tokens (the last one was
                          never fed to the target)

Guarantees: `write` appends the line with one write, flushes and fsyncs before it returns, and the
servers call it before the reply's last bytes (the non-stream body, a stream's `data: [DONE]`) go out,
so an acknowledged request is on disk; a record that fails to write fails its request (503). A kill
can leave the last line of a segment torn: `open` truncates it away and every reader skips and counts
one (`RecordReport.partial`); a new segment starts at every `open`. Features go to their own file
before their record line; files whose record never made it are dropped when the segment is packed.
Disk: a segment closes past record.segment_bytes or record.segment_minutes; closed segments are
deleted oldest first while the dir exceeds record.max_bytes, and when older than record.max_age_days.
Secrets: only body fields are recorded, never headers or URLs; every recorded string goes through
`redact.redact_text` (URL credentials, and every credential this process registered: the proxy's
forwarded Authorization / key headers and record.api_key_env) and the record.redact regexes.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from dflashkit.errors import UsageError
from dflashkit.redact import MASK, redact_text

if TYPE_CHECKING:
    import torch

    from dflashkit.config import RunConfig

log = logging.getLogger("dflashkit.record")

RECORD_VERSION = 1
SEGMENT_RE = re.compile(r"^records-(\d{8})\.jsonl$")
FEATURES_SUFFIX = ".features.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json", "added_tokens.json")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "seed")


def target_fingerprint(model_dir: str | Path, tokenizer_dir: str | Path | None = None,
                       chat_template: str | Path | None = None) -> str:
    """sha256 (hex) over the target's config.json and its tokenizer files (name + bytes, in a fixed order), and
    a chat-template override (`target.chat_template`: its file's text): the same target and tokenizer give the
    same fingerprint on any machine. `learn` compares its target's with every record's."""
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    for d, names in ((model_dir, ("config.json",)), (Path(tokenizer_dir or model_dir), TOKENIZER_FILES)):
        for name in names:
            p = d / name
            if p.is_file():
                h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    if chat_template:
        p = Path(chat_template)
        h.update(b"chat_template\0" + (p.read_bytes() if p.is_file() else str(chat_template).encode()))
    return h.hexdigest()


def section_fingerprint(target: Any, given: str | None = None) -> tuple[str, str]:
    """(fingerprint, how) of a `TargetSection`: `given` (record.target_fingerprint) when set, else
    `target_fingerprint` of its files ("files")."""
    if given:
        return given, "given"
    from dflashkit.inspect.target import resolve_target_path

    model_dir, _ = resolve_target_path(target.path, target.gguf_file)
    return target_fingerprint(model_dir, target.tokenizer, target.chat_template), "files"


@dataclass
class RecordPolicy:
    """Rotation, retention and redaction of a record dir (the `record.*` keys)."""

    max_bytes: int = 4 << 30
    max_age_days: float = 30.0
    segment_bytes: int = 64 << 20
    segment_minutes: float = 60.0
    redact: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RecordPolicy:
        r = cfg.record
        return cls(r.max_bytes, r.max_age_days, r.segment_bytes, r.segment_minutes, list(r.redact))

    def check(self) -> list[re.Pattern]:
        """The compiled redaction rules; UsageError for bad values (naming the key)."""
        if self.max_bytes <= 0:
            raise UsageError(f"record.max_bytes must be > 0, got {self.max_bytes}")
        if self.max_age_days <= 0 or self.segment_minutes <= 0 or self.segment_bytes <= 0:
            raise UsageError("record.max_age_days, record.segment_minutes and record.segment_bytes must be > 0")
        out = []
        for i, rx in enumerate(self.redact):
            try:
                out.append(re.compile(rx))
            except (re.error, TypeError) as e:
                raise UsageError(f"record.redact[{i}]: {rx!r} is not a regex ({e})",
                                 hint="fix the pattern (Python `re` syntax) or remove it") from None
        return out


# -- records from requests and replies ----------------------------------------------------------------------


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}


def request_record(body: dict[str, Any], chat: bool, *, t0: float) -> dict[str, Any]:
    """The request's half of a record (module docstring): messages, tools, thinking mode, sampling, prompt."""
    rec: dict[str, Any] = {"time": round(t0, 6), "endpoint": "chat" if chat else "completions"}
    if chat:
        rec["messages"] = [dict(m) for m in body.get("messages") or [] if isinstance(m, dict)]
        if body.get("tools"):
            rec["tools"] = body["tools"]
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict):
            rec["chat_template_kwargs"] = kwargs
            rec["thinking"] = kwargs.get("enable_thinking")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            rec["prompt"] = prompt
        elif isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
            rec["prompt_token_ids"] = list(prompt)
    rec["sampling"] = _sampling(body)
    return rec


def add_reply(rec: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """Complete a `request_record` with the reply: `reply` is {content, tool_calls?, reasoning_content?,
    finish_reason?, token_ids?, prompt_token_ids?, model?} (what `Assembler.reply` / `reply_of` give)."""
    if rec["endpoint"] == "chat":
        turn: dict[str, Any] = {"role": "assistant", "content": reply.get("content") or ""}
        if reply.get("tool_calls"):
            turn["tool_calls"] = reply["tool_calls"]
        if reply.get("reasoning_content"):
            turn["reasoning_content"] = reply["reasoning_content"]
        rec["messages"] = list(rec["messages"]) + [turn]
    else:
        rec["completion"] = reply.get("content") or ""
        if "prompt" not in rec:  # a token-id prompt: prepare reads the text it renders to, or the ids
            rec["prompt"] = ""
    if reply.get("prompt_token_ids") is not None:
        rec["prompt_token_ids"] = list(reply["prompt_token_ids"])
    if reply.get("token_ids") is not None:
        rec["completion_token_ids"] = list(reply["token_ids"])
    rec["finish_reason"] = reply.get("finish_reason")
    if reply.get("model") is not None:
        rec["model"] = reply["model"]
    return rec


def reply_of(response: dict[str, Any]) -> dict[str, Any]:
    """The reply of a non-streamed OpenAI response (chat or completions; vLLM's `reasoning_content` or
    `reasoning`, its `token_ids` / `prompt_token_ids`, ours)."""
    choice = (response.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    out: dict[str, Any] = {"content": msg.get("content") if "message" in choice else choice.get("text"),
                           "tool_calls": msg.get("tool_calls") or None,
                           "reasoning_content": msg.get("reasoning_content") or msg.get("reasoning"),
                           "finish_reason": choice.get("finish_reason"), "token_ids": choice.get("token_ids"),
                           "prompt_token_ids": response.get("prompt_token_ids") or choice.get("prompt_token_ids"),
                           "model": response.get("model")}
    return out


class Assembler:
    """A streamed reply put back together from its Server-Sent Events: `feed(bytes)` as they arrive; `done` once
    `data: [DONE]` came; `reply()` the same dict `reply_of` gives for the whole response. Tool-call deltas merge
    by their `index` (id and name from the first, arguments concatenated); token ids concatenate (vLLM sends
    them per chunk, `dflashkit serve` all at once in the last)."""

    def __init__(self) -> None:
        self.buf = b""
        self.done = False
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.token_ids: list[int] | None = None
        self.prompt_ids: list[int] | None = None
        self.finish: str | None = None
        self.model: str | None = None

    def feed(self, data: bytes) -> None:
        self.buf += data
        while True:
            cut = min((i for i in (self.buf.find(b"\n\n"), self.buf.find(b"\r\n\r\n")) if i >= 0), default=-1)
            if cut < 0:
                return
            event, self.buf = self.buf[:cut], self.buf[cut:].lstrip(b"\r\n")
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            return
        self.model = obj.get("model", self.model)
        if obj.get("prompt_token_ids") is not None:
            self.prompt_ids = list(obj["prompt_token_ids"])
        for c in obj.get("choices") or []:
            if c.get("index", 0) != 0:
                continue
            d = c.get("delta") or {}
            text = d.get("content") if "delta" in c else c.get("text")
            if text:
                self.content.append(text)
            r = d.get("reasoning_content") or d.get("reasoning")
            if r:
                self.reasoning.append(r)
            for tc in d.get("tool_calls") or []:
                slot = self.calls.setdefault(int(tc.get("index", len(self.calls))),
                                             {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] = fn.get("name") or slot["function"]["name"]
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if c.get("token_ids"):
                self.token_ids = (self.token_ids or []) + list(c["token_ids"])
            if c.get("prompt_token_ids") is not None:
                self.prompt_ids = list(c["prompt_token_ids"])
            if c.get("finish_reason"):
                self.finish = c["finish_reason"]

    def reply(self) -> dict[str, Any]:
        calls = [self.calls[k] for k in sorted(self.calls)] or None
        return {"content": "".join(self.content), "tool_calls": calls,
                "reasoning_content": "".join(self.reasoning) or None, "finish_reason": self.finish,
                "token_ids": self.token_ids, "prompt_token_ids": self.prompt_ids, "model": self.model}


# -- the writer -------------------------------------------------------------------------------------------------


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def _segments(root: Path) -> list[tuple[int, Path]]:
    out = []
    for p in root.iterdir() if root.is_dir() else []:
        m = SEGMENT_RE.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def features_file(segment: Path) -> Path:
    return segment.with_name(segment.name[: -len(".jsonl")] + FEATURES_SUFFIX)


def features_spool(segment: Path) -> Path:
    return segment.with_name(segment.name[: -len(".jsonl")] + ".features")


def _truncate_torn(path: Path) -> int:
    """Cut a trailing line without its newline (a write a kill interrupted); returns the bytes removed."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as fh:
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return 0
        back, keep = min(size, 1 << 16), 0
        while True:
            fh.seek(size - back)
            chunk = fh.read(back)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = size - back + nl + 1
                break
            if back >= size:
                break
            back = min(size, back * 4)
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    return size - keep


def _record_ids(segment: Path) -> set[str]:
    ids = set()
    with open(segment, "rb") as fh:
        for line in fh:
            if line.endswith(b"\n"):
                try:
                    ids.add(json.loads(line)["id"])
                except (ValueError, KeyError, TypeError):
                    pass
    return ids


def pack_features(segment: Path) -> int:
    """Pack an (unopen) segment's per-record feature files into its one features file (tensor name = record id;
    files whose record line never made it are dropped), then remove them; returns how many were packed."""
    from safetensors.torch import load_file, save_file

    from dflashkit.rundir import atomic_path

    spool = features_spool(segment)
    if not spool.is_dir():
        return 0
    keep = _record_ids(segment)
    tensors: dict[str, Any] = {}
    meta: dict[str, str] = {}
    for p in sorted(spool.glob("*.safetensors")):
        if p.stem in keep:
            from safetensors import safe_open

            with safe_open(str(p), framework="pt") as fh:
                meta = dict(fh.metadata() or {}) or meta
            tensors[p.stem] = load_file(str(p))["features"]
    if tensors:
        out = features_file(segment)
        with atomic_path(out) as tmp:
            save_file(tensors, str(tmp), metadata={k: v for k, v in meta.items() if k != "record_id"})
        os.chmod(out, 0o600)
    for p in spool.iterdir():
        p.unlink()
    spool.rmdir()
    return len(tensors)


class Recorder:
    """The one writer of a record dir (module docstring). Thread-safe: `write` holds a lock."""

    def __init__(self, root: str | Path, *, fingerprint: str, how: str = "files",
                 policy: RecordPolicy | None = None, features_meta: dict[str, str] | None = None):
        self.root = Path(root)
        self.fingerprint, self.how = fingerprint, how
        self.policy = policy or RecordPolicy()
        self.rules = self.policy.check()
        self.features_meta = features_meta or {}
        self._lock = threading.Lock()
        self._lock_fh: Any = None
        self._fd: int | None = None
        self.segment: Path | None = None
        self._seg_started = 0.0
        self._seg_bytes = 0
        self.written = 0
        self.repaired = 0

    # the segment cap never exceeds a quarter of the dir's, so rotation can keep the dir under it
    @property
    def segment_cap(self) -> int:
        return max(1, min(self.policy.segment_bytes, self.policy.max_bytes // 4))

    def open(self) -> Recorder:
        """Take the dir's lock, repair what a kill left (torn last lines, unpacked features), start a segment.

        Raises:
            UsageError: another live process writes into this dir, or it cannot be created.
        """
        try:
            _private_dir(self.root)
        except OSError as e:
            raise UsageError(f"record dir {self.root}: cannot create it ({e.strerror or e})",
                             hint="pick another serve.record_dir / record.dir") from None
        fh = open(self.root / ".lock", "a+")  # noqa: SIM115 - held while recording
        os.chmod(self.root / ".lock", 0o600)
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            fh.close()
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise UsageError(f"record dir {self.root} is in use by another recording process",
                                 hint="stop it, or give this one its own serve.record_dir / record.dir") from None
            raise
        self._lock_fh = fh
        for _, seg in _segments(self.root):
            if seg.stat().st_size == 0 and not features_spool(seg).exists():
                seg.unlink()  # a segment a kill left before its first record
                continue
            cut = _truncate_torn(seg)
            if cut:
                self.repaired += 1
                log.warning("%s: removed a torn last record (%d bytes) a killed writer left", seg.name, cut)
            pack_features(seg)
        self._prune()
        self._new_segment()
        return self

    def _new_segment(self) -> None:
        segs = _segments(self.root)
        n = segs[-1][0] + 1 if segs else 1
        self.segment = self.root / f"records-{n:08d}.jsonl"
        self._fd = os.open(self.segment, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.chmod(self.segment, 0o600)
        self._seg_started, self._seg_bytes = time.time(), 0
        dfd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _close_segment(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.segment is not None:
            if self.segment.is_file() and self.segment.stat().st_size == 0 and not features_spool(self.segment).exists():
                self.segment.unlink()  # nothing was recorded into it
            elif self.segment.is_file():
                pack_features(self.segment)
            self.segment = None

    def close(self) -> None:
        with self._lock:
            self._close_segment()
            if self._lock_fh is not None:
                self._lock_fh.close()
                self._lock_fh = None

    def _scrub(self, value: Any) -> Any:
        if isinstance(value, str):
            text = redact_text(value)
            for rx in self.rules:
                text = rx.sub(MASK, text)
            return text
        if isinstance(value, list):
            return [self._scrub(v) for v in value]
        if isinstance(value, dict):
            return {k: self._scrub(v) for k, v in value.items()}
        return value

    def write(self, rec: dict[str, Any], features: torch.Tensor | None = None,
              layer_ids: list[int] | None = None) -> str:
        """Append one record (fsync'd when this returns); returns its id. `features` [rows, W]: stored beside it.

        Raises:
            OSError: the record could not be written (the caller fails the request: it is not acknowledged).
        """
        rid = uuid.uuid4().hex
        body = {k: self._scrub(v) if k in ("messages", "tools", "prompt", "completion", "chat_template_kwargs")
                else v for k, v in rec.items()}
        out: dict[str, Any] = {"id": rid, "v": RECORD_VERSION, **body,
                               "target": {"fingerprint": self.fingerprint, "how": self.how}}
        with self._lock:
            if self._fd is None or self.segment is None:
                raise OSError(errno.EBADF, f"record dir {self.root} is not open")
            line = (json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
            extra = 0 if features is None else features.numel() * features.element_size()
            if self._seg_bytes and (self._seg_bytes + len(line) + extra > self.segment_cap
                                    or time.time() - self._seg_started >= 60 * self.policy.segment_minutes):
                self._close_segment()  # rotate before the write: the open segment stays under its cap
                self._new_segment()
                self._prune()
            if features is not None:
                out["features"], spooled = self._spool_features(rid, features, layer_ids or [])
                line = (json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
                self._seg_bytes += spooled
            view = memoryview(line)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
            self._seg_bytes += len(line)
            self.written += 1
        return rid

    def _spool_features(self, rid: str, features: torch.Tensor, layer_ids: list[int]) -> tuple[dict[str, Any], int]:
        """Write one record's features (fsync'd, renamed into place) → (the record's `features` entry, bytes)."""
        from safetensors.torch import save_file

        assert self.segment is not None
        spool = features_spool(self.segment)
        _private_dir(spool)
        dtype = str(features.dtype).replace("torch.", "")
        meta = {**self.features_meta, "target_layer_ids": json.dumps(list(layer_ids)), "dtype": dtype,
                "fingerprint": self.fingerprint}
        final, tmp = spool / f"{rid}.safetensors", spool / f".{rid}.tmp"
        save_file({"features": features.contiguous().cpu()}, str(tmp), metadata=meta)
        os.chmod(tmp, 0o600)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        return ({"file": features_file(self.segment).name, "key": rid, "rows": int(features.shape[0]),
                 "layer_ids": list(layer_ids), "dtype": dtype}, final.stat().st_size)

    def _prune(self) -> None:
        """Delete closed segments (with their features) past record.max_age_days, then oldest first while the dir
        holds more than record.max_bytes less one open segment's cap (the room the open segment may fill)."""
        closed = [p for _, p in _segments(self.root) if p != self.segment]
        now = time.time()

        def size(p: Path) -> int:
            extra = features_file(p)
            return p.stat().st_size + (extra.stat().st_size if extra.is_file() else 0)

        def drop(p: Path) -> None:
            for q in (p, features_file(p)):
                q.unlink(missing_ok=True)
            log.info("record dir %s: deleted segment %s (retention)", self.root, p.name)

        for p in list(closed):
            if now - p.stat().st_mtime > 86400 * self.policy.max_age_days:
                drop(p)
                closed.remove(p)
        total = dir_bytes(self.root)
        while closed and total > self.policy.max_bytes - self.segment_cap:
            p = closed.pop(0)
            total -= size(p)
            drop(p)


def dir_bytes(root: Path) -> int:
    """Bytes of every file under a record dir."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


# -- the reader -------------------------------------------------------------------------------------------------


@dataclass
class RecordReport:
    """What `read_recorded` skipped: torn lines (a kill mid-write), lines that are not a record."""

    records: int = 0
    partial: int = 0
    bad: int = 0
    notes: list[str] = field(default_factory=list)


def segments(root: str | Path, *, named: str = "record dir") -> list[Path]:
    """A record dir's segment files in write order. UsageError (exit 2) when the dir does not exist, naming it as
    `named` (how the caller's user gave it, e.g. `--records`)."""
    d = Path(root)
    if not d.is_dir():
        raise UsageError(f"{named} {d}: not a directory", hint="pass the record dir `serve.record_dir` or "
                         "`dflashkit record` (record.dir) writes into")
    return [p for _, p in _segments(d) if p.is_file()]


def complete_lines(segment: Path) -> list[bytes]:
    """The lines of a segment that end in a newline (without it), in order: the bytes after the last newline, a
    line still being written or one a kill tore, are left out (a later read sees it once it is complete)."""
    return segment.read_bytes().split(b"\n")[:-1]


def read_recorded(root: str | Path, report: RecordReport | None = None) -> Iterator[dict[str, Any]]:
    """Every complete record of a record dir, segment by segment in write order. A last line without its
    newline (torn) is never yielded, nor is a line that is not a JSON record with an id; both are counted."""
    root = Path(root)
    report = report if report is not None else RecordReport()
    if not root.is_dir():
        raise UsageError(f"record dir {root} does not exist", hint="point at serve.record_dir / record.dir")
    for _, seg in _segments(root):
        with open(seg, "rb") as fh:
            for no, line in enumerate(fh, 1):
                if not line.endswith(b"\n"):
                    report.partial += 1
                    report.notes.append(f"{seg}:{no}: torn last line skipped")
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    obj = None
                if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                    report.bad += 1
                    report.notes.append(f"{seg}:{no}: not a record")
                    continue
                report.records += 1
                yield obj


def read_features(root: str | Path, rec: dict[str, Any]) -> torch.Tensor | None:
    """The recorded features of record `rec` ([rows, W]), from its segment's features file or, while that
    segment is open, its per-record file; None when it has none (or they are gone)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    info = rec.get("features")
    if not info:
        return None
    root = Path(root)
    packed = root / info["file"]
    if packed.is_file():
        with safe_open(str(packed), framework="pt") as fh:
            if info["key"] in fh.keys():
                return fh.get_tensor(info["key"])
    spool = root / (info["file"][: -len(FEATURES_SUFFIX)] + ".features") / f"{info['key']}.safetensors"
    return load_file(str(spool))["features"] if spool.is_file() else None


class ServeRecording:
    """`dflashkit serve`'s side of recording: a request and its result → one record, with the committed tokens'
    features when `features_dtype` is set and the engine's decoder keeps them (`serving.feature_tap`; read from
    `engine.decoder` at every request, so a decoder swapped in later is used as it is)."""

    def __init__(self, recorder: Recorder, model_name: str, engine: Any = None, features_dtype: str | None = None):
        self.recorder, self.model_name, self.engine = recorder, model_name, engine
        self.features_dtype = features_dtype

    @property
    def tap(self) -> Any:
        dec = getattr(self.engine, "decoder", None)
        return dec if self.features_dtype and hasattr(dec, "take") and getattr(dec, "layer_ids", None) else None

    def record(self, body: dict[str, Any], chat: bool, prompt_ids: list[int], out: Any, reply: dict[str, Any],
               t0: float, req: Any) -> bool:
        """Write the record of a finished request (`reply`: its message as answered); False when the write
        failed (logged; the caller fails the request instead of acknowledging it)."""
        rec = add_reply(request_record(body, chat, t0=t0),
                        {**reply, "token_ids": list(out.token_ids), "prompt_token_ids": list(prompt_ids),
                         "finish_reason": reply.get("finish_reason") or out.finish_reason, "model": self.model_name})
        feats, tap = None, self.tap
        if tap is not None:
            feats = tap.take(req.prompt_ids, len(prompt_ids) + len(out.token_ids) - 1)
            if feats is not None:
                import torch

                feats = feats.to(getattr(torch, str(self.features_dtype)))
        try:
            self.recorder.write(rec, feats, list(tap.layer_ids) if feats is not None else None)
        except OSError as e:
            log.error("recording failed (%s: %s); the request fails rather than go unrecorded",
                      type(e).__name__, e)
            return False
        return True
