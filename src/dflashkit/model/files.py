"""A target's files: where they are (THE target-path resolver) and whether its safetensors are whole.

Usage:
    model_dir, gguf_file = resolve_target_path("smollm2-135m-instruct")  # dir, .gguf, config.json or asset
    check_safetensors("model_dir/model.safetensors")     # UsageError naming the file, else None
    shapes = tensor_shapes(model_dir)                     # name → shape, from the headers only
    raw = config_json(model_dir)                          # config.json as written; UsageError at file:line:col

`resolve_target_path` is shared by probe, plan, load_target, serve, export, import and chat
templates (`inspect.target` re-exports it); it lives in model/ so `model/target.py` imports no
room above it. `check_safetensors` reads the header and sizes, without reading the tensors:

A truncated download or a corrupt file otherwise fails deep inside transformers/safetensors with a
message that names no file; this names it and says what to do (exit 2).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from dflashkit.assets import ASSETS, asset_path
from dflashkit.errors import UsageError
from dflashkit.model.tiny import make_tiny_target


def config_json(model_dir: Path) -> dict[str, Any]:
    """The model dir's config.json as written (wrappers not resolved); UsageError naming file:line:col."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f"{path}:{e.lineno}:{e.colno}" if isinstance(e, json.JSONDecodeError) else str(path)
        raise UsageError(f"{where}: not a valid JSON config ({e})", hint="restore the model's config.json") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: not a JSON object", hint="restore the model's config.json")
    return raw


def tensor_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Every tensor's shape in the target's safetensors files, from their headers only (no tensor is read)."""
    out: dict[str, list[int]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        header, _, _ = _header(f)
        out.update({k: list(v.get("shape") or []) for k, v in header.items()
                    if k != "__metadata__" and isinstance(v, dict)})
    return out


def check_safetensors(path: str | Path) -> None:
    """Raise UsageError if `path` is not a complete safetensors file (header parse + every tensor's bytes present)."""
    p = Path(path)
    header, n, size = _header(p)
    hint = f"re-download or re-create {p.name} (the file is truncated or corrupt)"
    data = size - 8 - n
    end = max((int(v["data_offsets"][1]) for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if end > data:
        raise UsageError(f"{p}: truncated: the header needs {end} data bytes, the file has {data}", hint=hint)


def _header(p: Path) -> tuple[dict, int, int]:
    """(the parsed header, its length, the file's size) of the safetensors file `p`; UsageError naming it."""
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
    return header, n, size


def resolve_target_path(path: str, gguf_file: str | None = None) -> tuple[Path, str | None]:
    """THE target-path resolver (probe, plan, load_target, serve, export, import, chat templates).

    Returns (model dir, gguf file name or None) for a model dir, its `config.json`, a `.gguf` file,
    a dir holding one `.gguf` and no config.json, or an asset name (downloaded when missing).
    `gguf_file` (target.gguf_file) picks the .gguf inside a dir."""
    if not path:
        raise UsageError("target.path is empty", hint="set target.path to a HF model dir, a .gguf file "
                         "or `smollm2-135m-instruct`")
    p = Path(path).expanduser()
    if not p.exists():
        if path in ASSETS:
            return asset_path(path, build=make_tiny_target), None
        raise UsageError(f"{path}: no such file or directory",
                         hint="give a HF model dir (config.json), a .gguf file, or an asset name such as "
                         "smollm2-135m-instruct")
    if p.is_file():
        if p.suffix == ".gguf":
            return p.parent, p.name
        if p.name == "config.json":
            return p.parent, None
        raise UsageError(f"{p}: a file that is neither a .gguf nor a config.json",
                         hint="give the model directory")
    if gguf_file:
        return p, gguf_file
    ggufs = sorted(p.glob("*.gguf"))
    if not (p / "config.json").exists() and len(ggufs) == 1:
        return p, ggufs[0].name
    return p, None
