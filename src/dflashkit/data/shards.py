"""Tokenized Parquet shards: the schema `tokenize` writes and `train`/`capture` read.

Usage:
    write_parquet_shard(tok_dir / "shard-00000.parquet", [{"id": "a", "input_ids": ids, "loss_mask": m}])
    for row in iter_tokenized(tok_dir):          # sorted shard order, row order within a shard
        row["id"], row["input_ids"], row["loss_mask"]      # str, np.int32 [T], np.int8 [T]

Schema (readers may use pyarrow directly): `id` string, `input_ids` list<int32>,
`loss_mask` list<int8> (1 exactly on supervised assistant tokens), equal lengths per row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.rundir import atomic_path

SHARD_GLOB = "shard-*.parquet"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def schema():
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                      ("loss_mask", pa.list_(pa.int8())), ("source", pa.string())])


def write_parquet_shard(path: str | Path, rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Write rows (id, input_ids, loss_mask) atomically; returns {samples, tokens, supervised}.

    Raises:
        ValueError: a row's input_ids and loss_mask lengths differ.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids: list[str] = []
    sources: list[str] = []
    toks: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for row in rows:
        t = np.asarray(row["input_ids"], dtype=np.int32)
        m = np.asarray(row["loss_mask"], dtype=np.int8)
        if t.shape != m.shape or t.ndim != 1:
            raise ValueError(f"row {row['id']}: input_ids {t.shape} and loss_mask {m.shape} differ")
        ids.append(str(row["id"]))
        sources.append(str(row.get("source") or ""))
        toks.append(t)
        masks.append(m)
    offsets = np.zeros(len(toks) + 1, dtype=np.int32)
    np.cumsum([len(t) for t in toks], out=offsets[1:])
    flat_t = np.concatenate(toks) if toks else np.zeros(0, np.int32)
    flat_m = np.concatenate(masks) if masks else np.zeros(0, np.int8)
    table = pa.Table.from_arrays([
        pa.array(ids, pa.string()),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_t, pa.int32())),
        pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_m, pa.int8())),
        pa.array(sources, pa.string()),
    ], schema=schema())
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return {"samples": len(ids), "tokens": int(len(flat_t)), "supervised": int(flat_m.sum(dtype=np.int64))}


def shard_paths(tokenize_dir: str | Path) -> list[Path]:
    """The shards of a tokenize dir, sorted; MissingArtifactError when there are none."""
    d = Path(tokenize_dir)
    paths = sorted(d.glob(SHARD_GLOB))
    if not paths:
        raise MissingArtifactError("tokenized shards", d / SHARD_GLOB, run="dflashkit tokenize -c run.yaml")
    return paths


def iter_tokenized(tokenize_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Yield {id, input_ids: np.int32[T], loss_mask: np.int8[T]} in sorted shard order."""
    import pyarrow.parquet as pq

    for path in shard_paths(tokenize_dir):
        table = pq.read_table(path)
        if table.schema.names[:3] != ["id", "input_ids", "loss_mask"]:
            raise UsageError(f"{path}: unexpected columns {table.schema.names}",
                             hint="re-run `dflashkit tokenize -c run.yaml`")
        ids = table.column("id").to_pylist()
        tok_col = table.column("input_ids").combine_chunks()
        mask_col = table.column("loss_mask").combine_chunks()
        offsets = tok_col.offsets.to_numpy()
        flat_t = tok_col.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
        flat_m = mask_col.values.to_numpy(zero_copy_only=False).astype(np.int8, copy=False)
        for i, sid in enumerate(ids):
            a, b = offsets[i], offsets[i + 1]
            yield {"id": sid, "input_ids": flat_t[a:b], "loss_mask": flat_m[a:b]}
