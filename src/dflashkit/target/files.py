"""A target's files: where they are (THE target-path resolver) and whether its safetensors are whole.

Usage:
    model_dir, gguf_file = resolve_target_path("smollm2-135m-instruct")  # dir, .gguf, config.json or asset
    check_safetensors("model_dir/model.safetensors")     # UsageError naming the file and tensor, else None
    shapes = tensor_shapes(model_dir)                     # name → shape, from the headers only
    entries = tensor_entries(model_dir)                   # name → TensorEntry(file, dtype, shape, offsets)
    raw = config_json(model_dir)                          # config.json as written; UsageError at file:line:col

`resolve_target_path` is shared by probe, plan, load_target, serve, export, import and chat
templates (`inspect.target` re-exports it); it lives in target/ so `target/load.py` imports no
room above it. `check_safetensors` reads the header and sizes, without reading the tensors (whether
the tensors are what config.json says is `target.quantized.check_checkpoint`, which reads these headers):

A truncated download or a corrupt file otherwise fails deep inside transformers/safetensors with a
message that names no file; this names it and says what to do (exit 2).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashkit.assets import ASSETS, asset_path
from dflashkit.errors import UsageError
from dflashkit.target.tiny import make_tiny_target


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


# bits per element of every safetensors dtype (F4 / F6: MX formats, packed; C64: complex64)
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6,
              "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # what an unquantized checkpoint's weights are stored in
LOW_FLOAT_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2")  # only with their scales


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: its file, dtype (safetensors' spelling), shape and byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """The bytes its dtype and shape need (`end - begin` in a consistent file)."""
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8


def tensor_entries(model_dir: Path) -> dict[str, TensorEntry]:
    """Every tensor's header entry in the target's safetensors files (no tensor is read); UsageError naming
    the file and the tensor for an entry that is not a safetensors entry (unknown dtype, bad shape or offsets)."""
    out: dict[str, TensorEntry] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(_entries(f, _header(f)[0]))
    return out


def tensor_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Every tensor's shape in the target's safetensors files, from their headers only (no tensor is read)."""
    return {k: list(e.shape) for k, e in tensor_entries(model_dir).items()}


def check_safetensors(path: str | Path) -> None:
    """Raise UsageError if `path` is not a complete, self-consistent safetensors file: every header entry
    well formed, each tensor's byte range exactly its shape × dtype, the ranges tiling the data with no gap,
    overlap or trailing byte, and every byte present. Reads the header and the file size only."""
    p = Path(path)
    header, n, size = _header(p)
    hint = f"re-download or re-create {p.name} (the file is truncated or corrupt)"
    data = size - 8 - n
    entries = _entries(p, header)
    end, last = max(((e.end, k) for k, e in entries.items()), default=(0, ""))
    if end > data:
        raise UsageError(f"{p}: truncated: tensor {last} ends at data byte {end}, the file has {data}", hint=hint)
    pos = 0
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.end - e.begin != e.nbytes:
            raise UsageError(f"{p}: tensor {name}: its header says {e.dtype} {list(e.shape)} ({e.nbytes} bytes) "
                             f"over data_offsets [{e.begin}, {e.end}] ({e.end - e.begin} bytes)", hint=hint)
        if e.begin != pos:
            raise UsageError(f"{p}: tensor {name}: data_offsets [{e.begin}, {e.end}] "
                             + ("overlap the previous tensor's" if e.begin < pos else f"leave a gap after byte {pos}"),
                             hint=hint)
        pos = e.end
    if pos != data:
        raise UsageError(f"{p}: {data - pos} bytes after the last tensor's data (the header covers {pos} of "
                         f"{data})", hint=hint)


def _entries(p: Path, header: dict) -> dict[str, TensorEntry]:
    """The header's tensors as TensorEntry; UsageError naming `p` and the tensor for a malformed entry."""
    hint = f"re-download or re-create {p.name} (its safetensors header is corrupt)"
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(v, dict):
            raise UsageError(f"{p}: tensor {name}: header entry is not an object", hint=hint)
        dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise UsageError(f"{p}: tensor {name}: unknown dtype {dtype!r} (safetensors knows "
                             f"{', '.join(DTYPE_BITS)})", hint=hint)
        if not isinstance(shape, list) or not all(_count(x) for x in shape):
            raise UsageError(f"{p}: tensor {name}: shape {shape!r} is not a list of sizes", hint=hint)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(x) for x in offsets)
                and offsets[0] <= offsets[1]):
            raise UsageError(f"{p}: tensor {name}: data_offsets {offsets!r} are not [begin, end] byte offsets",
                             hint=hint)
        if math.prod(shape) * DTYPE_BITS[dtype] % 8:
            raise UsageError(f"{p}: tensor {name}: {dtype} {shape} is not a whole number of bytes", hint=hint)
        out[name] = TensorEntry(p, dtype, tuple(shape), offsets[0], offsets[1])
    return out


def _count(x: Any) -> bool:
    """A JSON integer >= 0 (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


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
