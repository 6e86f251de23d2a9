"""Training data: tokenized Parquet shards (and cached feature shards), deterministic batches.

Usage:
    data = load_tokenized(rd)                                  # all samples of tokenize/shard-*.parquet
    train_idx, heldout_idx = split_heldout(len(data), 16, seed=0)
    plan = BatchPlan(train_idx, batch_size=4, grad_accum=2, world=2, seed=0)
    for micro in plan.micro_batches(step, rank):               # this rank's micro-batches of `step`
        batch = collate(data, micro, epoch_seed)               # padded tensors + per-sample seeds

Determinism: the order of step s is a function of (run.seed, s) only. The global batch of a step
(batch_size × grad_accum × world samples) is consecutive in a per-epoch seeded permutation;
micro-batch m of rank r takes slice (m·world + r). So 1 rank × batch 2b and 2 ranks × batch b see
the same global batch, and the data cursor is just the step number.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from dflashkit.data.features import FeatureStore  # noqa: F401  (re-exported: the reader lives with the writer)
from dflashkit.data.shards import TokenData, load_tokenized, tokenized_shards  # noqa: F401  (re-exported)
from dflashkit.errors import UsageError


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

    def to(self, device: torch.device) -> "Batch":
        def mv(t):
            return None if t is None else t.to(device)

        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.attention_mask.to(device),
                     self.seq_lens.to(device), self.seeds, mv(self.features), mv(self.next_ids),
                     mv(self.last_hidden), mv(self.path_ids))


def sample_seed(run_seed: int, index: int, epoch: int) -> int:
    """Anchor seed of a sample in an epoch: independent of batch composition and world size."""
    return zlib.crc32(f"{run_seed}:{epoch}:{index}".encode())


def collate(data: TokenData, items: list[tuple[int, int]], *, run_seed: int, pad_id: int = 0,
            with_features: bool = False, with_next_ids: bool = False, with_last_hidden: bool = False,
            with_path_ids: bool = False, paths: dict[int, torch.Tensor] | None = None) -> Batch:
    """Pad the samples `items` ((index, epoch) pairs) into a Batch (cached tensors from `data.features`;
    `paths`: greedy paths [n, D] by sample index, computed elsewhere; samples without one get −1)."""
    lens = [len(data.input_ids[i]) for i, _ in items]
    s = max(lens)
    ids = torch.full((len(items), s), pad_id, dtype=torch.long)
    lm = torch.zeros((len(items), s), dtype=torch.long)
    att = torch.zeros((len(items), s), dtype=torch.long)
    for r, ((i, _), n) in enumerate(zip(items, lens)):
        ids[r, :n] = torch.from_numpy(data.input_ids[i])
        lm[r, :n] = torch.from_numpy(data.loss_mask[i])
        att[r, :n] = 1
    def stack(name: str, dtype: torch.dtype) -> torch.Tensor:
        assert data.features is not None  # with_features / with_* need the capture shards
        rows = [data.features.get(data.where[i], n, name) for (i, _), n in zip(items, lens)]
        if name == "path_ids":  # shards captured for a larger block hold deeper paths; each holds the depth asked
            depth = min(f.shape[1] for f in rows)
            rows = [f[:, :depth] for f in rows]
        out = torch.zeros(len(items), s, *rows[0].shape[1:], dtype=dtype)
        for r, f in enumerate(rows):
            out[r, :f.shape[0]] = f.to(dtype)
        return out

    feats = stack("features", torch.float32) if with_features else None
    next_ids = stack("next_ids", torch.long) if with_next_ids else None
    last_hidden = stack("last_hidden", torch.float32) if with_last_hidden else None
    path_ids = stack("path_ids", torch.long) if with_path_ids else None
    if paths:
        depth = next(iter(paths.values())).shape[1]
        path_ids = torch.full((len(items), s, depth), -1, dtype=torch.long)
        for r, ((i, _), n) in enumerate(zip(items, lens)):
            if i in paths:
                path_ids[r, :n] = paths[i]
    return Batch(ids, lm, att, torch.tensor(lens), [sample_seed(run_seed, i, e) for i, e in items], feats,
                 next_ids, last_hidden, path_ids)
