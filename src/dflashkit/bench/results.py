"""`bench/<subject>.json`: what one `dflashkit bench SUBJECT` measured (`RunDir.bench_result(subject)`).

Usage:
    path = write_bench_result(rd, "decode", result)   # atomic; the bench stage is the only writer
    serve = read_bench_result(rd, "serve")            # the dict, or None (absent or not JSON); report reads it

This module is the file's owner: its only writer and reader.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dflashkit.rundir import RunDir, atomic_write_json, read_json_or_none

log = logging.getLogger("dflashkit.bench")


def write_bench_result(rd: RunDir, subject: str, result: dict[str, Any]) -> Path:
    """Write `bench/<subject>.json` atomically (the bench dir is created); returns its path."""
    path = rd.bench_result(subject)
    rd.bench_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, result)
    return path


def read_bench_result(rd: RunDir, subject: str) -> dict[str, Any] | None:
    """`bench/<subject>.json`, or None when it is absent or not valid JSON (logged, then skipped)."""
    return read_json_or_none(rd.bench_result(subject), log)
