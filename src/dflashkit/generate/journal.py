"""Append-only, crash-safe journal of generated turns: exactly-once resume for `generate`.

Usage:
    journal = Journal(stage_dir / "shards", shard_size=1000)
    done = journal.open()                       # scans shards, truncates a torn tail, returns records
    journal.append({"id": "ab12…", "turn": 0, "content": "…", ...})   # one os.write, then fsync
    journal.close()

Layout: `<dir>/part-00000.jsonl`, `part-00001.jsonl`, … Each line is one finished turn keyed by
(`id`, `turn`); the whole line is written with a single `os.write` on an O_APPEND descriptor, so a
SIGKILL can only lose lines that were never written. A line cut by a power loss (no trailing
newline, or not valid JSON) can only be the last one of the last shard: `open()` truncates it away.
fsync runs every `fsync_every` lines or `fsync_s` seconds and at `close()`; a crash loses at most
those unsynced whole lines, which are simply generated again. A key already present is never
written twice (`append` refuses it), so the shards never hold a duplicate.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

from dflashkit.errors import UsageError

log = logging.getLogger("dflashkit.generate")

Key = tuple[str, int]


def shard_name(index: int) -> str:
    return f"part-{index:05d}.jsonl"


def _shard_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("part-*.jsonl"))


def _scan_shard(path: Path, *, last: bool) -> tuple[list[dict[str, Any]], int, int]:
    """Parse a shard. Returns (records, valid byte length, torn lines dropped).

    A bad line that is not the tail of the last shard is an error: it cannot come from a crash.
    """
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    pos = 0
    torn = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        line = data[pos:] if nl < 0 else data[pos:nl]
        end = len(data) if nl < 0 else nl + 1
        try:
            rec = json.loads(line) if nl >= 0 else None
            ok = isinstance(rec, dict) and "id" in rec and "turn" in rec
        except (json.JSONDecodeError, UnicodeDecodeError):
            ok = False
        if not ok:
            if last and end == len(data):
                torn += 1
                break

            lineno = data.count(b"\n", 0, pos) + 1
            raise UsageError(f"{path}:{lineno}: corrupt journal line in the middle of a shard",
                             hint=f"delete {path.parent} to regenerate, or remove that line by hand")
        records.append(rec)  # type: ignore[arg-type]  # a dict: checked above
        pos = end
    return records, pos, torn


class Journal:
    """The shards of one `generate` run; single writer (one asyncio loop), many readers."""

    def __init__(self, directory: str | Path, *, shard_size: int = 1000, fsync_every: int = 64,
                 fsync_s: float = 0.5):
        self.dir = Path(directory)
        self.shard_size = max(1, shard_size)
        self.fsync_every = fsync_every
        self.fsync_s = fsync_s
        self.keys: set[Key] = set()
        self.torn_dropped = 0
        self._fd: int | None = None
        self._shard_index = 0
        self._lines_in_shard = 0
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def open(self) -> list[dict[str, Any]]:
        """Scan existing shards (truncating a torn tail) and open the last one for appending."""
        self.dir.mkdir(parents=True, exist_ok=True)
        paths = _shard_paths(self.dir)
        records: list[dict[str, Any]] = []
        duplicates = 0
        for i, path in enumerate(paths):
            recs, valid, torn = _scan_shard(path, last=i == len(paths) - 1)
            if torn:
                log.warning("%s: dropping a torn last line (%d bytes); it will be generated again",
                            path, path.stat().st_size - valid)
                with open(path, "r+b") as fh:
                    fh.truncate(valid)
                    os.fsync(fh.fileno())
                self.torn_dropped += torn
            for rec in recs:
                key = (str(rec["id"]), int(rec["turn"]))
                if key in self.keys:  # cannot happen through append(); tolerate hand-merged shards
                    duplicates += 1
                    continue
                self.keys.add(key)
                records.append(rec)
            if i == len(paths) - 1:
                self._shard_index, self._lines_in_shard = i, len(recs)
        if duplicates:
            log.warning("%s: ignored %d duplicate (id, turn) lines", self.dir, duplicates)
        if paths:
            self._shard_index = int(paths[-1].stem.split("-")[1])
        self._open_fd()
        return records

    def _open_fd(self) -> None:
        if self._fd is not None:
            self._sync()
            os.close(self._fd)
            self._fd = None
        if self._lines_in_shard >= self.shard_size:
            self._shard_index += 1
            self._lines_in_shard = 0
        path = self.dir / shard_name(self._shard_index)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, record: dict[str, Any]) -> None:
        """Write one finished turn as a single line (never twice for the same key)."""
        key = (str(record["id"]), int(record["turn"]))
        if key in self.keys:
            raise ValueError(f"journal already holds {key}")
        if self._fd is None:
            raise RuntimeError("Journal.open() first")
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        written = os.write(self._fd, line)
        if written != len(line):  # regular files write fully unless the disk is full
            raise OSError(f"short write to {self.dir} ({written}/{len(line)} bytes); is the disk full?")
        self.keys.add(key)
        self._lines_in_shard += 1
        self._unsynced += 1
        now = time.monotonic()
        if self._unsynced >= self.fsync_every or now - self._last_sync >= self.fsync_s:
            self._sync()
        if self._lines_in_shard >= self.shard_size:
            self._open_fd()

    def _sync(self) -> None:
        if self._fd is not None and self._unsynced:
            os.fsync(self._fd)
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd is not None:
            self._sync()
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_records(directory: str | Path) -> Iterator[dict[str, Any]]:
    """Every complete record in the shards (read-only; a torn tail is skipped, not truncated)."""
    paths = _shard_paths(Path(directory))
    for i, path in enumerate(paths):
        recs, _, _ = _scan_shard(path, last=i == len(paths) - 1)
        yield from recs
