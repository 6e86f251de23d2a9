"""Cheap integrity check of a `.safetensors` file: header and sizes, without reading the tensors.

Usage:
    check_safetensors("model_dir/model.safetensors")     # UsageError naming the file, else None

A truncated download or a corrupt file otherwise fails deep inside transformers/safetensors with a
message that names no file; this names it and says what to do (exit 2).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from dflashkit.errors import UsageError


def check_safetensors(path: str | Path) -> None:
    """Raise UsageError if `path` is not a complete safetensors file (header parse + every tensor's bytes present)."""
    p = Path(path)
    hint = f"re-download or re-create {p.name} (the file is truncated or corrupt)"
    size = p.stat().st_size
    with open(p, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UsageError(f"{p}: not a safetensors file ({size} bytes)", hint=hint)
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise UsageError(f"{p}: corrupt safetensors header (declares {n} header bytes in a {size}-byte file)",
                             hint=hint)
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, ValueError) as e:
            raise UsageError(f"{p}: corrupt safetensors header ({e})", hint=hint) from None
    if not isinstance(header, dict):
        raise UsageError(f"{p}: corrupt safetensors header (not a JSON object)", hint=hint)
    data = size - 8 - n
    end = max((int(v["data_offsets"][1]) for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if end > data:
        raise UsageError(f"{p}: truncated: the header needs {end} data bytes, the file has {data}", hint=hint)
