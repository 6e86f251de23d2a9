"""Training data: tokenized Parquet shards (and cached feature shards), deterministic batches.

Usage:
    data = load_tokenized(rd)                                  # all samples of tokenize/shard-*.parquet
    data.features = cached_store(rd.capture_dir, data.shards, layer_ids, recipe)   # train.features=cached
    train_idx, heldout_idx = split_heldout(len(data), 16, seed=0)
    plan = BatchPlan(train_idx, batch_size=4, grad_accum=2, world=2, seed=0)
    for micro in plan.micro_batches(step, rank):               # this rank's micro-batches of `step`
        batch = collate(data, micro, epoch_seed)               # padded tensors + per-sample seeds
        batch = collate(data, micro, epoch_seed, pack=4096)    # train.pack: samples concatenated into rows

Determinism: the order of step s is a function of (run.seed, s) only. The global batch of a step
(batch_size × grad_accum × world samples) is consecutive in a per-epoch seeded permutation;
micro-batch m of rank r takes slice (m·world + r). So 1 rank × batch 2b and 2 ranks × batch b see
the same global batch, and the data cursor is just the step number.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from dflashkit.data.features import FeatureStore  # noqa: F401  (re-exported: the reader lives with the writer)
from dflashkit.data.shards import TokenData, load_tokenized, tokenized_shards  # noqa: F401  (re-exported)
from dflashkit.errors import UsageError

if TYPE_CHECKING:
    from dflashkit.family.recipe import Recipe


def cached_store(capture_dir: Path, shards: list[Path], layer_ids: list[int], recipe: Recipe) -> FeatureStore:
    """`train.features=cached`: the feature shards as training reads them, checked to hold what `recipe` reads
    (`next_ids` for target labels, every sample's greedy path for rollout; exit 3 / exit 2 naming the shard)."""
    store = FeatureStore(capture_dir, shards, layer_ids)
    if recipe.target_labels:
        store.require("next_ids", "train.labels=target reads the target's argmax from the shards")
    if recipe.rollout:
        store.require_paths(recipe.path_depth, "train.on_path=rollout learns it")
    return store


def split_heldout(n: int, heldout: int, *, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic split: the last `heldout` of a seeded permutation (at most n // 4) are held out."""
    perm = np.random.default_rng([seed, 7]).permutation(n).tolist()
    k = min(heldout, n // 4)
    return (sorted(perm[:n - k]), sorted(perm[n - k:])) if k else (list(range(n)), [])


def first_of(train_idx: list[int], n: int | None, *, seed: int) -> list[int]:
    """`train.train_samples`: n of `train_idx` by a seeded permutation (sorted); the first n of the same
    permutation, so a smaller n always picks a subset of a larger one. None (or n ≥ all) = all."""
    if n is None or n >= len(train_idx):
        return list(train_idx)
    order = np.random.default_rng([seed, 13]).permutation(len(train_idx))[:n]
    return sorted(train_idx[i] for i in order.tolist())


def hold_out_sources(train_idx: list[int], heldout: list[int], sources: list[str], names: list[str], *,
                     per_source: int, seed: int) -> tuple[list[int], list[int]]:
    """`train.heldout_sources`: samples of the sources `names` never train; up to `per_source` of each
    (a seeded choice) join the held-out set, so held-out τ is also measured on data of another kind."""
    unseen = set(names)
    train = [i for i in train_idx if sources[i] not in unseen]
    held = [i for i in heldout if sources[i] not in unseen]
    rng = np.random.default_rng([seed, 11])
    for name in sorted(unseen):
        idx = [i for i, s in enumerate(sources) if s == name]
        held += sorted(rng.permutation(idx)[:per_source].tolist()) if idx else []
    return train, sorted(held)


@dataclass
class BatchPlan:
    """Which samples each rank's micro-batches hold at each step (see the module docstring)."""

    train_idx: list[int]
    batch_size: int
    grad_accum: int
    world: int
    seed: int
    _perms: dict[int, list[int]] = field(default_factory=dict, repr=False)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.world

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            order = np.random.default_rng([self.seed, epoch, 11]).permutation(len(self.train_idx))
            self._perms = {epoch: [self.train_idx[i] for i in order]}
        return self._perms[epoch]

    def global_indices(self, step: int) -> list[tuple[int, int]]:
        """(sample index, epoch) for the `global_batch` samples of `step` (wraps into the next epoch)."""
        g, n = self.global_batch, len(self.train_idx)
        if n == 0:
            raise UsageError("no training samples left after the held-out split",
                             hint="lower train.heldout_samples or add data")
        out = []
        for flat in range(step * g, step * g + g):
            epoch, off = divmod(flat, n)
            out.append((self._perm(epoch)[off], epoch))
        return out

    def micro_batches(self, step: int, rank: int) -> list[list[tuple[int, int]]]:
        idx = self.global_indices(step)
        b = self.batch_size
        return [idx[(m * self.world + rank) * b:(m * self.world + rank + 1) * b] for m in range(self.grad_accum)]


@dataclass
class Batch:
    """Right-padded tensors for one micro-batch."""

    input_ids: torch.Tensor      # [b, S]
    loss_mask: torch.Tensor      # [b, S]
    attention_mask: torch.Tensor  # [b, S]
    seq_lens: torch.Tensor       # [b]
    seeds: list[int]             # per-sample anchor seeds
    features: torch.Tensor | None = None  # [b, S, n_feat·H] (cached mode)
    next_ids: torch.Tensor | None = None  # [b, S] the target's argmax at each position (cached mode)
    last_hidden: torch.Tensor | None = None  # [b, S, H] the target's final-norm output (cached, for KL)
    path_ids: torch.Tensor | None = None  # [b, S, D] the target's greedy path after each prefix (−1: none)
    docs: list[list[tuple[int, int]]] | None = None  # packed rows: per row its documents' (length, anchor seed)

    def to(self, device: torch.device) -> "Batch":
        def mv(t):
            return None if t is None else t.to(device)

        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.attention_mask.to(device),
                     self.seq_lens.to(device), self.seeds, mv(self.features), mv(self.next_ids),
                     mv(self.last_hidden), mv(self.path_ids), self.docs)


def sample_seed(run_seed: int, index: int, epoch: int) -> int:
    """Anchor seed of a sample in an epoch: independent of batch composition and world size."""
    return zlib.crc32(f"{run_seed}:{epoch}:{index}".encode())


def pack_rows(lens: list[int], pack: int) -> list[list[int]]:
    """`train.pack`: the items (by their lengths `lens`, in order) grouped into rows of at most `pack` tokens,
    each item joining the first row it fits in (first fit, deterministic); an item longer than `pack` gets a
    row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for k, n in enumerate(lens):
        r = next((r for r, left in enumerate(room) if n <= left), None)
        if r is None:
            rows.append([k])
            room.append(pack - n)
        else:
            rows[r].append(k)
            room[r] -= n
    return rows


def collate(data: TokenData, items: list[tuple[int, int]], *, run_seed: int, pad_id: int = 0,
            with_features: bool = False, with_next_ids: bool = False, with_last_hidden: bool = False,
            with_path_ids: bool = False, paths: dict[int, torch.Tensor] | None = None,
            pack: int | None = None) -> Batch:
    """Pad the samples `items` ((index, epoch) pairs) into a Batch (cached tensors from `data.features`;
    `paths`: greedy paths [n, D] by sample index, computed elsewhere; samples without one get −1).

    `pack` (`train.pack`: tokens per row): the samples are concatenated into rows (`pack_rows`), every
    per-token tensor (cached features too, each sample's from its own capture) placed at the sample's offset;
    `Batch.docs` then lists each row's documents, `seeds` holds a row's first document's seed."""
    lens = [len(data.input_ids[i]) for i, _ in items]
    seeds = [sample_seed(run_seed, i, e) for i, e in items]
    groups = pack_rows(lens, pack) if pack else [[k] for k in range(len(items))]
    place: list[tuple[int, int]] = [(0, 0)] * len(items)   # item k → (row, offset)
    for r, g in enumerate(groups):
        off = 0
        for k in g:
            place[k] = (r, off)
            off += lens[k]
    row_lens = [sum(lens[k] for k in g) for g in groups]
    s = max(row_lens)
    nrow = len(groups)
    ids = torch.full((nrow, s), pad_id, dtype=torch.long)
    lm = torch.zeros((nrow, s), dtype=torch.long)
    att = torch.zeros((nrow, s), dtype=torch.long)
    for (i, _), n, (r, o) in zip(items, lens, place):
        ids[r, o:o + n] = torch.from_numpy(data.input_ids[i])
        lm[r, o:o + n] = torch.from_numpy(data.loss_mask[i])
        att[r, o:o + n] = 1

    def stack(name: str, dtype: torch.dtype) -> torch.Tensor:
        assert data.features is not None  # with_features / with_* need the capture shards
        rows = [data.features.get(data.where[i], n, name) for (i, _), n in zip(items, lens)]
        if name == "path_ids":  # shards captured for a larger block hold deeper paths; each holds the depth asked
            depth = min(f.shape[1] for f in rows)
            rows = [f[:, :depth] for f in rows]
        out = torch.zeros(nrow, s, *rows[0].shape[1:], dtype=dtype)
        for f, (r, o) in zip(rows, place):
            out[r, o:o + f.shape[0]] = f.to(dtype)
        return out

    feats = stack("features", torch.float32) if with_features else None
    next_ids = stack("next_ids", torch.long) if with_next_ids else None
    last_hidden = stack("last_hidden", torch.float32) if with_last_hidden else None
    path_ids = stack("path_ids", torch.long) if with_path_ids else None
    if paths:
        depth = next(iter(paths.values())).shape[1]
        path_ids = torch.full((nrow, s, depth), -1, dtype=torch.long)
        for (i, _), n, (r, o) in zip(items, lens, place):
            if i in paths:
                path_ids[r, o:o + n] = paths[i]
    docs = [[(lens[k], seeds[k]) for k in g] for g in groups] if pack else None
    return Batch(ids, lm, att, torch.tensor(row_lens), [seeds[g[0]] for g in groups], feats,
                 next_ids, last_hidden, path_ids, docs)


def _doc_spans(b: Batch) -> list[tuple[int, int, int]]:
    """(row, offset, length) of every document of the packed batch `b`, rows in order, documents in order."""
    assert b.docs is not None
    out = []
    for r, docs in enumerate(b.docs):
        off = 0
        for n, _ in docs:
            out.append((r, off, n))
            off += n
    return out


def unpacked(b: Batch, *, pad_id: int = 0) -> Batch:
    """The documents of the packed batch `b` (`collate(pack=...)`) as an unpacked batch, one right-padded
    document per row (`_doc_spans` order): what a target forward runs on, so it never sees across a document
    boundary (`repacked` puts its outputs back)."""
    spans = _doc_spans(b)
    assert b.docs is not None
    s = max(n for _, _, n in spans)
    seeds = [seed for docs in b.docs for _, seed in docs]

    def cut(t: torch.Tensor | None, fill: int = 0) -> torch.Tensor | None:
        if t is None:
            return None
        out = torch.full((len(spans), s, *t.shape[2:]), fill, dtype=t.dtype, device=t.device)
        for d, (r, o, n) in enumerate(spans):
            out[d, :n] = t[r, o:o + n]
        return out

    ids, lm, att = cut(b.input_ids, pad_id), cut(b.loss_mask), cut(b.attention_mask)
    assert ids is not None and lm is not None and att is not None
    lens = torch.tensor([n for _, _, n in spans], device=b.seq_lens.device)
    return Batch(ids, lm, att, lens, seeds, cut(b.features), cut(b.next_ids), cut(b.last_hidden),
                 cut(b.path_ids, -1))


def repacked(t: torch.Tensor | None, b: Batch) -> torch.Tensor | None:
    """Per-document rows [docs, L, ...] of `unpacked(b)` placed back at their offsets in `b`'s rows [rows, S, ...]
    (padding 0)."""
    if t is None:
        return None
    out = t.new_zeros(b.input_ids.shape[0], b.input_ids.shape[1], *t.shape[2:])
    for d, (r, o, n) in enumerate(_doc_spans(b)):
        out[r, o:o + n] = t[d, :n]
    return out
