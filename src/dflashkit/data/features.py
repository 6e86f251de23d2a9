"""Feature shards (`capture/shard-XXXXX.safetensors`): the one writer, the one reader, their checks.

Usage:
    path = shard_path(rd.capture_dir, token_shard)              # one feature shard per tokenized shard
    if not shard_matches(path, layer_ids=ids, digest=d, dtype="bfloat16", last_hidden=False, autocast="none"):
        write_shard(path, lens, local_batches(target, rows, ids, batch_size=8, pad_id=0, last_hidden=False),
                    dtype="bfloat16", metadata=meta, width=W, hidden=H)
    store = FeatureStore(rd.capture_dir, data.shards, ids)     # training's reader
    store.get(data.where[i], n, "features")                     # [n, W] rows of sample i

A shard holds `offsets` [samples+1] (int64 row offsets, in tokenized-shard order), `features`
[tokens, n_feat·H] (capture.dtype), `next_ids` [tokens] (int32, the target's greedy next token),
optionally `last_hidden` [tokens, H] (capture.dtype), optionally `path_ids` [tokens, D] (int32, the
target's greedy continuation of depth D after each raw prefix, `model/path_labels.py`; level 0 at every
token of a sample in `path_rows`, levels ≥ 1 where block labels read them, −1 elsewhere), and string metadata:
`target_layer_ids` (JSON), `source`, `source_digest`, `dtype`, `hidden_size`, `samples`,
`target_autocast`, `next_ids: "1"`, `last_hidden: "1"|"0"`, and with path_ids `path_depth` (D) and
`path_rows` ("all", or a JSON list of the samples, by row in the shard, that have theirs: capture
computes them for the held-out samples always, for all with `train.on_path=rollout`). The file is
written by the `safetensors` library
(`save_file`) through a temp file + rename; rows arrive in any order (batches of similar length)
and are spooled into memory-mapped scratch files beside the shard first, so a shard is never held in
memory whole (the scratch files — one shard's worth of disk at a time — are removed after).
"""

from __future__ import annotations

import json
import mmap
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from safetensors.torch import save_file

from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.model.path_labels import greedy_path_ids, label_need, path_cache, with_cache
from dflashkit.rundir import atomic_path

# capture.dtype → (safetensors dtype name, bytes per value)
ST_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}
# (row index, features, next_ids, last_hidden[, path_ids [n, D] or None])
Row = tuple[Any, ...]
PathRows = Any  # the samples (by row) that need path_ids: a list of rows, "all", or None = none


def shard_path(capture_dir: Path, token_shard: Path) -> Path:
    """The feature shard of tokenized shard `token_shard` (same stem)."""
    return Path(capture_dir) / f"{Path(token_shard).stem}.safetensors"


def shard_metadata(path: Path) -> dict[str, str] | None:
    """The shard's metadata, or None when it is missing or unreadable (a torn file is recomputed)."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            return dict(fh.metadata() or {})
    except Exception:  # noqa: BLE001 - safetensors raises several types for bad files
        return None


def shard_metadata_for(*, layer_ids: list[int], source: str, digest: str, dtype: str, hidden: int, samples: int,
                       autocast: str) -> dict[str, str]:
    """The metadata a shard is written with (`write_shard` adds `next_ids` / `last_hidden`)."""
    return {"target_layer_ids": json.dumps(list(layer_ids)), "source": source, "source_digest": digest,
            "dtype": dtype, "hidden_size": str(hidden), "samples": str(samples), "target_autocast": autocast}


def shard_matches(path: Path, *, layer_ids: list[int], digest: str, dtype: str, last_hidden: bool,
                  autocast: str, engine: str = "local") -> bool:
    """Whether a complete shard at `path` holds the features this capture would write (then they are kept;
    `missing_path_rows` says whether its path_ids still need rows)."""
    meta = shard_metadata(path)
    if meta is None:
        return False
    have = json.loads(meta.get("target_layer_ids", "null")) or []
    return (set(layer_ids) <= set(have)  # a shard with more layers holds these too (FeatureStore selects them)
            and meta.get("source_digest") == digest and meta.get("dtype") == dtype
            and meta.get("next_ids") == "1" and (meta.get("last_hidden") == "1" or not last_hidden)
            and meta.get("target_autocast", "none") == autocast and meta.get("engine", "local") == engine)


def path_coverage(meta: dict[str, str] | None, samples: int) -> tuple[int, set[int]]:
    """(depth, the rows that have path_ids) of a shard's metadata (0, {} without path_ids)."""
    if not meta or "path_depth" not in meta:
        return 0, set()
    rows = meta.get("path_rows", "[]")
    return int(meta["path_depth"]), set(range(samples)) if rows == "all" else set(json.loads(rows))


def missing_path_rows(path: Path, want: PathRows, samples: int, depth: int) -> list[int]:
    """The rows of `want` whose path_ids (of depth ≥ `depth`) the shard at `path` lacks (all of them when it
    has a smaller depth)."""
    rows = list(range(samples)) if want == "all" else sorted(want or [])
    if not rows or depth <= 0:
        return []
    have_depth, have = path_coverage(shard_metadata(path), samples)
    return rows if have_depth < depth else [r for r in rows if r not in have]


@dataclass
class PathCost:
    """What computing greedy paths cost: target tokens fed beyond the prefill (`GreedyPath.rolled`), the
    rows that needed them (raw next token ≠ the target's argmax), and the tokens / supervised tokens of the
    samples that got paths."""

    rolled: int = 0
    rollout_rows: int = 0
    tokens: int = 0
    supervised: int = 0

    def add(self, other: "PathCost") -> None:
        for k in ("rolled", "rollout_rows", "tokens", "supervised"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def as_dict(self) -> dict[str, Any]:
        per = (lambda x, n: round(x / n, 4) if n else None)
        return {"rolled_tokens": self.rolled, "rollout_rows": self.rollout_rows, "tokens": self.tokens,
                "supervised_tokens": self.supervised, "extra_per_token": per(self.rolled, self.tokens),
                "extra_per_supervised_token": per(self.rolled, self.supervised),
                "rollout_rows_per_supervised_token": per(self.rollout_rows, self.supervised)}


@dataclass
class PathSpec:
    """Which rows of a shard get the greedy path of depth `depth` (`rows`: PathRows), with their loss masks
    (the rows block labels read: `label_need`); `cost` adds up what it took."""

    depth: int = 0
    rows: Any = None                     # PathRows
    loss_masks: list[Any] | None = None  # per row of the shard (numpy / tensor 0/1)
    cost: PathCost = field(default_factory=PathCost)

    def wants(self, row: int) -> bool:
        return self.depth > 0 and (self.rows == "all" or (self.rows is not None and row in self.rows))


def local_batches(target: Any, rows: list[torch.Tensor], layer_ids: list[int], *, batch_size: int, pad_id: int,
                  last_hidden: bool, autocast: torch.dtype | None = None,
                  paths: PathSpec | None = None) -> Iterator[list[Row]]:
    """The target in this process: samples in batches of similar length (sorted, so padding costs
    little); yields [(row index, features [n, W], next_ids [n], last_hidden [n, H] | None, path_ids [n, D] |
    None)] per batch. `paths`: the greedy path of its rows, from the same forward (its KV cache)."""
    lens = [len(r) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: lens[i])
    for k in range(0, len(order), batch_size):
        part = order[k:k + batch_size]
        s = max(lens[i] for i in part)
        ids = torch.full((len(part), s), pad_id, dtype=torch.long)
        att = torch.zeros((len(part), s), dtype=torch.long)
        for j, i in enumerate(part):
            ids[j, :lens[i]], att[j, :lens[i]] = rows[i], 1
        want = [paths is not None and paths.wants(i) for i in part]
        path = None
        with torch.no_grad(), torch.autocast(target.device.type, dtype=autocast, enabled=autocast is not None):
            cache = path_cache() if any(want) else None
            feats, last = target.features(ids.to(target.device), layer_ids=layer_ids, need_last_hidden=True,
                                          attention_mask=att.to(target.device),
                                          **(with_cache(target, cache) if cache is not None else {}))
            nxt = target.next_token_ids(last)
            if paths is not None and cache is not None:
                path = _batch_paths(target, ids, att, nxt, cache, part, want, paths)
        yield [(i, feats[j, :lens[i]], nxt[j, :lens[i]], last[j, :lens[i]] if last_hidden else None,
                path[j, :lens[i]] if path is not None and want[j] else None)
               for j, i in enumerate(part)]


def _batch_paths(target: Any, ids: torch.Tensor, att: torch.Tensor, nxt: torch.Tensor, cache: Any,
                 part: list[int], want: list[bool], paths: PathSpec) -> torch.Tensor:
    """The greedy path of the wanted rows of one batch (the rows block labels read), its cost added to `paths`."""
    dev = target.device
    lens = att.sum(1)
    lm = torch.zeros_like(att)
    for j, i in enumerate(part):
        if want[j]:
            m = paths.loss_masks[i] if paths.loss_masks is not None else None
            lm[j, :int(lens[j])] = 1 if m is None else torch.as_tensor(m[:int(lens[j])]).long()
    need = label_need(lm.to(dev), lens.to(dev), paths.depth)
    got = greedy_path_ids(target, ids.to(dev), lens.to(dev), paths.depth, next_ids=nxt, cache=cache, need=need)
    wanted = torch.tensor(want)
    paths.cost.add(PathCost(got.rolled, got.rollout_rows, int(lens[wanted].sum()), int(lm[wanted].sum())))
    return got.path_ids


def _spool(directory: Path, shape: tuple[int, ...], dtype: torch.dtype, keep: list) -> torch.Tensor:
    """A zeroed tensor backed by an unlinked scratch file in `directory` (paged by the OS, not resident)."""
    fh = tempfile.TemporaryFile(dir=directory)
    keep.append(fh)
    n = int(np.prod(shape)) if shape else 1
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    fh.truncate(max(nbytes, 1))

    buf = mmap.mmap(fh.fileno(), max(nbytes, 1))
    keep.append(buf)
    return torch.frombuffer(buf, dtype=dtype, count=n).view(shape) if n else torch.zeros(shape, dtype=dtype)


def write_shard(path: Path, lens: list[int], batches: Iterable[list[Row]], *, dtype: str, metadata: dict[str, str],
                width: int, hidden: int, last_hidden: bool = False, path_depth: int = 0) -> int:
    """Write one feature shard (the format in the module doc) from `batches` of rows in any order
    (`local_batches`, `stored_rows`, or a serving engine's rows); returns its token count. Nothing is renamed
    into `path` unless every row arrived. `path_depth` D > 0: a `path_ids` [tokens, D] tensor holds the
    rows that come with one (the others stay −1; `path_rows` records which)."""
    tdtype = getattr(torch, dtype)
    offsets = torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0)
    total = int(offsets[-1])
    path.parent.mkdir(parents=True, exist_ok=True)
    keep: list = []
    feats = last = None
    tensors: dict[str, torch.Tensor] = {}
    try:
        feats = _spool(path.parent, (total, width), tdtype, keep)
        last = _spool(path.parent, (total, hidden), tdtype, keep) if last_hidden else None
        paths = torch.full((total, path_depth), -1, dtype=torch.int32) if path_depth > 0 else None
        with_path: list[int] = []
        next_ids = torch.zeros(total, dtype=torch.int32)
        seen = 0
        for batch in batches:
            for row in batch:
                i, f, nxt, lh = row[:4]
                pth = row[4] if len(row) > 4 else None
                a, n = int(offsets[i]), lens[i]
                if tuple(f.shape) != (n, width):
                    raise ValueError(f"{path}: row {i} has features {tuple(f.shape)}, expected {(n, width)}")
                feats[a:a + n] = f.to(tdtype).cpu()
                next_ids[a:a + n] = nxt.to(torch.int32).cpu()
                if last is not None and lh is not None:
                    last[a:a + n] = lh.to(tdtype).cpu()
                if paths is not None and pth is not None:
                    paths[a:a + n] = pth[:, :path_depth].to(torch.int32).cpu()
                    with_path.append(int(i))
                seen += 1
        if seen != len(lens):
            raise RuntimeError(f"{path}: {seen} of {len(lens)} rows were produced")  # nothing is renamed
        tensors = {"offsets": offsets, "features": feats, "next_ids": next_ids}
        if last is not None:
            tensors["last_hidden"] = last
        meta = {**metadata, "next_ids": "1", "last_hidden": "1" if last_hidden else "0"}
        if paths is not None and with_path:
            tensors["path_ids"] = paths
            meta.update(path_depth=str(path_depth),
                        path_rows="all" if len(set(with_path)) == len(lens) else json.dumps(sorted(set(with_path))))
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
    finally:
        feats = last = None  # release the views of the scratch maps before closing them
        tensors.clear()
        for h in reversed(keep):
            try:
                h.close()
            except (BufferError, OSError):  # a view still alive: the unlinked file goes with the process
                pass
    return total


def stored_rows(path: Path, lens: list[int], new_paths: dict[int, torch.Tensor], *, depth: int,
                batch: int = 16) -> Iterator[list[Row]]:
    """The rows of the complete shard at `path` as `write_shard` takes them, read slice by slice (never the
    whole shard in memory), with the path_ids of `new_paths` (row → [n, D]) beside the stored ones (of depth ≥ D):
    capture adds path rows to a shard whose features still match without running the target over it again."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        names = set(fh.keys())
        offsets = fh.get_tensor("offsets")
        had_depth, had = path_coverage(fh.metadata() or {}, len(lens))
        had = had if had_depth >= depth else set()  # shallower stored paths are dropped (the new depth replaces)
        out: list[Row] = []
        for i, n in enumerate(lens):
            a, b = int(offsets[i]), int(offsets[i + 1])
            if b - a != n:
                raise UsageError(f"{path}: row {i} holds {b - a} tokens but the tokenized sample has {n}",
                                 hint="delete the shard and re-run `dflashkit capture -c run.yaml`")
            pth = new_paths.get(i)
            if pth is None and i in had:
                pth = fh.get_slice("path_ids")[a:b]
            out.append((i, fh.get_slice("features")[a:b], fh.get_slice("next_ids")[a:b],
                        fh.get_slice("last_hidden")[a:b] if "last_hidden" in names else None, pth))
            if len(out) == batch:
                yield out
                out = []
        if out:
            yield out


def stored_width(path: Path) -> int:
    """The feature width of the shard at `path` (it may hold more layers than a capture asks for)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return int(fh.get_slice("features").get_shape()[1])


class FeatureStore:
    """Read-only access to `capture/shard-*.safetensors` (one per tokenized shard).

    `layer_ids` may be any subset of the layers a shard holds (`capture.extra_layer_ids`): `get` then
    returns those layers' columns in `layer_ids`' order."""

    def __init__(self, capture_dir: Path, token_shards: list[Path], layer_ids: list[int]):
        from safetensors import safe_open

        self.files: list[tuple[Any, torch.Tensor]] = []
        self.paths: list[Path] = []
        # per shard: None when it holds exactly `layer_ids`, else (its layer count, the positions of ours)
        self.layers: list[tuple[int, list[int]] | None] = []
        for shard in token_shards:
            path = shard_path(capture_dir, shard)
            if not path.is_file():
                raise MissingArtifactError("captured features", path, run="dflashkit capture -c run.yaml")
            try:
                fh = safe_open(str(path), framework="pt")
                meta = fh.metadata() or {}
                offsets = fh.get_tensor("offsets")
            except Exception as e:  # noqa: BLE001 - safetensors raises several types for bad files
                raise UsageError(f"{path}: unreadable feature shard ({e})",
                                 hint="delete it and re-run `dflashkit capture -c run.yaml`") from None
            got = json.loads(meta.get("target_layer_ids", "null")) or []
            if not set(layer_ids) <= set(got):
                raise UsageError(f"{path}: features were captured at target_layer_ids {got}, but the drafter "
                                 f"contract uses {list(layer_ids)}",
                                 hint="re-run `dflashkit capture -c run.yaml` (delete capture/ first; "
                                 "capture.extra_layer_ids captures more layers than the contract's, for drafters "
                                 "that use other ones) or set train.features=online")
            self.files.append((fh, offsets))
            self.paths.append(path)
            self.layers.append(None if got == list(layer_ids) else (len(got), [got.index(i) for i in layer_ids]))

    def has(self, name: str) -> bool:
        """Whether every shard holds tensor `name` (`next_ids`, `last_hidden`: see `dflashkit capture`)."""
        return all(name in fh.keys() for fh, _ in self.files)

    def path_rows(self, where: tuple[int, int], depth: int) -> bool:
        """Whether sample `where` (shard, row) has its greedy path of depth ≥ `depth` (`path_ids`)."""
        fh, offsets = self.files[where[0]]
        have_depth, rows = path_coverage(fh.metadata() or {}, len(offsets) - 1)
        return have_depth >= depth and where[1] in rows

    def require_paths(self, depth: int, why: str) -> None:
        """Every sample's greedy path of depth ≥ `depth`, or exit 2 naming the first shard without."""
        for p, (fh, offsets) in zip(self.paths, self.files):
            have_depth, rows = path_coverage(fh.metadata() or {}, len(offsets) - 1)
            if have_depth < depth or len(rows) < len(offsets) - 1:
                got = f"depth {have_depth} for {len(rows)} of {len(offsets) - 1} samples" if have_depth else "none"
                raise UsageError(f"{p}: the feature shard lacks the target's greedy path (`path_ids` of depth "
                                 f"{depth} for every sample; it has {got}) ({why})",
                                 hint="re-run `dflashkit capture -c run.yaml` with this config (it adds the paths "
                                 "to shards whose features still match), or set train.features=online")

    def require(self, name: str, why: str) -> None:
        missing = [str(p) for p, (fh, _) in zip(self.paths, self.files) if name not in fh.keys()]
        if missing:
            raise UsageError(f"{missing[0]}: the feature shard has no `{name}` ({why}; "
                             f"{len(missing)} of {len(self.files)} shards lack it)",
                             hint="re-run `dflashkit capture -c run.yaml` with this config (delete capture/ first), "
                             "or set train.features=online")

    def get(self, where: tuple[int, int], length: int, name: str = "features") -> torch.Tensor:
        fh, offsets = self.files[where[0]]
        a, b = int(offsets[where[1]]), int(offsets[where[1] + 1])
        if b - a != length:
            raise UsageError(f"feature shard {where[0]} row {where[1]} holds {b - a} tokens but the tokenized "
                             f"sample has {length}", hint="re-run `dflashkit capture -c run.yaml` after tokenize")
        rows = fh.get_slice(name)[a:b]
        pick = self.layers[where[0]]
        if name != "features" or pick is None:
            return rows
        count, idx = pick
        return rows.view(length, count, -1)[:, idx].reshape(length, -1)  # the contract's layers, in its order
