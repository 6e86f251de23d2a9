"""`<run_dir>/learn/promoted.json`: which drafter `learn` promoted last (the pointer `serve` watches).

Usage:
    write_promoted(run_dir, drafter_dir=..., round_no=3, drafter_id="r003-1a2b3c4d")   # atomic (rename)
    p = read_promoted(path)          # {"drafter": dir, "id": ..., "round": n, "time": ...} or None (absent)

The pointer is replaced atomically, never edited in place, so a reader sees the old pointer or the new one
whole; the drafter dir it names is complete before the pointer is written (it is renamed into place first).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dflashkit.errors import UsageError
from dflashkit.rundir import RunDir, atomic_write_json

POINTER = "promoted.json"


def pointer_path(run_dir: str | Path) -> Path:
    return RunDir(run_dir).learn_dir / POINTER


def write_promoted(run_dir: str | Path, *, drafter_dir: str | Path, round_no: int, drafter_id: str,
                   warm_dir: str | Path | None = None) -> dict[str, Any]:
    """Point `serve` (and the next round's warm start, `warm_dir`, default the drafter dir) at a drafter."""
    rec = {"drafter": str(Path(drafter_dir).resolve()), "id": drafter_id, "round": int(round_no),
           "warm_start": str(Path(warm_dir or drafter_dir).resolve()),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_json(pointer_path(run_dir), rec)
    return rec


def read_promoted(path: str | Path) -> dict[str, Any] | None:
    """The pointer at `path`, or None when there is none yet; UsageError (exit 2) naming the file when it is
    not a pointer."""
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a promotion pointer ({e})",
                         hint="it is written by `dflashkit learn`; remove it to serve the configured drafter") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("drafter"), str) or not isinstance(rec.get("id"), str):
        raise UsageError(f"{path}: not a promotion pointer (needs string `drafter` and `id`)",
                         hint="it is written by `dflashkit learn`; remove it to serve the configured drafter")
    return rec
