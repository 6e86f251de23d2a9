"""Tokenized Parquet shards: the schema `tokenize` writes and `train`/`capture` read.

Usage:
    write_parquet_shard(rd.tokenize_dir / shard_name(0), [{"id": "a", "input_ids": ids, "loss_mask": m}])
    data = load_tokenized(rd)                    # TokenData: every sample, sorted shard order, row order
    data.ids[i], data.input_ids[i], data.loss_mask[i], data.where[i]   # str, np.int64 [T] ×2, (shard, row)

Schema: `id` string, `input_ids` list<int32>, `loss_mask` list<int8> (1 exactly on supervised
assistant tokens), equal lengths per row, `source` string. The one writer and the one reader of the
format (`train.data` re-exports the reader).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.rundir import RunDir, atomic_path

if TYPE_CHECKING:
    from dflashkit.data.features import FeatureStore

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


@dataclass
class TokenData:
    """All tokenized samples in memory (token ids are small); `where[i]` = (shard index, row)."""

    ids: list[str]
    input_ids: list[np.ndarray]
    loss_mask: list[np.ndarray]
    shards: list[Path]
    where: list[tuple[int, int]]
    features: "FeatureStore | None" = None
    source: list[str] = field(default_factory=list)   # each sample's data source ("" if unknown)

    def __len__(self) -> int:
        return len(self.ids)


def tokenized_shards(rd: RunDir) -> list[Path]:
    """The run's tokenized shards, sorted (empty when there are none)."""
    return sorted(rd.tokenize_dir.glob(SHARD_GLOB))


def require_tokenized_shards(rd: RunDir) -> list[Path]:
    """The run's tokenized shards; MissingArtifactError (exit 3, run `dflashkit tokenize`) when there are none."""
    shards = tokenized_shards(rd)
    if not shards:
        raise MissingArtifactError("tokenized shards", rd.tokenize_dir / SHARD_GLOB,
                                   run="dflashkit tokenize -c run.yaml")
    return shards


def load_tokenized(rd: RunDir) -> TokenData:
    """Read every `tokenize/shard-*.parquet` (columns id, input_ids, loss_mask).

    Raises:
        MissingArtifactError: no shards (run `dflashkit tokenize`).
        UsageError: a shard lacks a column or has mismatched lengths (names the file and row).
    """
    import pyarrow.parquet as pq

    shards = require_tokenized_shards(rd)
    data = TokenData([], [], [], shards, [])
    for si, path in enumerate(shards):
        try:
            shard = pq.ParquetFile(path)  # one open: the schema, then the columns
            names = shard.schema_arrow.names
            table = shard.read(columns=["id", "input_ids", "loss_mask"] + (["source"] if "source" in names else []))
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for bad files
            raise UsageError(f"{path}: cannot read tokenized shard ({e})",
                             hint="re-run `dflashkit tokenize -c run.yaml`") from None
        cols = table.to_pydict()
        sources = cols.get("source") or [""] * len(cols["id"])
        for row, (sid, ids, mask, src) in enumerate(zip(cols["id"], cols["input_ids"], cols["loss_mask"], sources)):
            if len(ids) != len(mask):
                raise UsageError(f"{path} row {row} (id {sid}): input_ids has {len(ids)} tokens but "
                                 f"loss_mask has {len(mask)}", hint="re-run `dflashkit tokenize -c run.yaml`")
            data.ids.append(str(sid))
            data.input_ids.append(np.asarray(ids, dtype=np.int64))
            data.loss_mask.append(np.asarray(mask, dtype=np.int64))
            data.where.append((si, row))
            data.source.append(str(src or ""))
    if not data.ids:
        raise UsageError(f"{rd.tokenize_dir}: the tokenized shards hold no samples",
                         hint="check `tokenize/stats.json`; lower tokenize.min_supervised or add data")
    return data
