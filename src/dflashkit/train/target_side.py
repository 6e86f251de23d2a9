"""The target's side of a micro-batch: one builder per feature source.

Usage:
    side = target_side(recipe, cfg.train, contract, target, parts, device=dist.device, amp=amp, store=data.features)
    out = side(batch, anchors)   # TargetOut: features, and the labels / KL target the recipe asks for
    how, paths = heldout_labels(recipe, cfg.train, data.features, target, data, heldout)  # the yardstick's
    out = scored(out, batch, how)  # the labels a held-out block is scored with (paths: online, computed once)

`CachedSide`: every output the run's recipe (`family/recipe.Recipe`) needs is in the feature rows,
cached shards or the engine's (`Recipe.store_covers`): the target's layers never run. `OnlineSide`:
the target runs on the batch — a sharded target (`train.parallel.target=shard`) gives logits, a whole
one its final-norm hidden state; cached features or `next_ids`, where the shards have them, replace
the target's. With `train.on_path=rollout` the labels are the target's greedy
path (`path_ids`: from the shards, or rolled out here from the same forward's KV cache for the batch's
anchors only); with `train.on_path=mask` the positions off that path get weight 0 (`on_path_only`).

The held-out yardstick scores blocks on the target's own path whatever `train.on_path` says
(`heldout_scoring`): "target_path" (labels = path_ids: from the shards, which `capture` writes for the
held-out samples, or computed here once at setup when the target is loaded), else "on_path_positions"
(the target's argmax labels on the positions the mask keeps: engine features, shards without paths, a
target whose sliding window the samples outgrow — `model/path_labels.attention_limit`), else "raw" (the
training labels, as before).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dflashkit.family.recipe import Recipe
from dflashkit.model.path_labels import (attention_limit, greedy_path_ids, label_need, path_cache,
                                        with_cache)
from dflashkit.target.load import Target, target_autocast
from dflashkit.train.data import Batch, FeatureStore, collate, repacked, unpacked
from dflashkit.train.objective import Anchors, target_label_ids

log = logging.getLogger("dflashkit.train")


@dataclass
class TargetOut:
    """The target's side of one micro-batch (see `Trainer.target_outputs`)."""

    features: torch.Tensor                  # [b, S, n_feat·H]
    logits: torch.Tensor | None = None      # [b, S, V] (sharded targets; for KL or a family's term)
    last_hidden: torch.Tensor | None = None  # [b, S, H] final-norm output (for KL or a family's term)
    label_ids: torch.Tensor | None = None   # [b, S] labels from the target (train.labels=target)
    path_ids: torch.Tensor | None = None    # [b, S, D] on-path labels (train.on_path=rollout; held-out)
    on_path_only: bool = False              # train.on_path=mask: weight only the positions on the path


@dataclass
class CachedSide:
    """Features, labels and the target's law (KL, a family's term) from the shards (the batch carries them)."""

    recipe: Recipe

    def __call__(self, b: Batch, a: Anchors | None = None) -> TargetOut:
        r = self.recipe
        assert b.features is not None
        labels = target_label_ids(b.input_ids, b.next_ids) if r.target_labels else None
        return TargetOut(b.features, None, b.last_hidden if r.needs_target_logits else None, labels,
                         b.path_ids if r.rollout else None, r.mask_on_path)


@dataclass
class OnlineSide:
    """The target's forward on the batch (sharded: logits; whole: the final-norm hidden state)."""

    recipe: Recipe
    target_dtype: str                       # train.target_dtype: the forward's autocast
    layer_ids: list[int]
    target: Any
    sharded: bool
    device: torch.device
    amp: torch.dtype | None

    def __call__(self, b: Batch, a: Anchors | None = None) -> TargetOut:
        if b.docs is not None:  # packed rows (train.pack): the target runs per document, never across a boundary
            out = self(unpacked(b), None)
            back: dict[str, Any] = {k: repacked(getattr(out, k), b)
                                    for k in ("features", "logits", "last_hidden", "label_ids", "path_ids")}
            return dataclasses.replace(out, **back)
        r = self.recipe
        need_kl, need_labels = r.needs_target_logits, r.target_labels
        rollout = r.rollout and b.path_ids is None   # cached paths (shards, held-out) win
        logits = hidden = path = None
        cache = path_cache() if rollout else None
        kw = with_cache(self.target, cache) if rollout else {}
        tamp = target_autocast(self.target_dtype, self.device, self.target.dtype)
        with torch.no_grad(), torch.autocast(self.device.type, dtype=tamp, enabled=tamp is not None):
            if self.sharded:  # a sharded target gives logits, not its final-norm hidden state
                feats, out = self.target.features(b.input_ids, layer_ids=self.layer_ids, need_logits=True,
                                                  attention_mask=b.attention_mask)
                logits = out.logits
                nxt = logits.argmax(-1) if need_labels else None
            elif need_labels or need_kl:
                feats, hidden = self.target.features(b.input_ids, layer_ids=self.layer_ids, need_last_hidden=True,
                                                     attention_mask=b.attention_mask, **kw)
                nxt = self.target.next_token_ids(hidden) if need_labels else None
            else:
                feats, nxt = self.target.features(b.input_ids, layer_ids=self.layer_ids,
                                                  attention_mask=b.attention_mask), None
            if rollout:  # the batch's anchors only (all candidates without them), from this forward's cache
                need = label_need(b.loss_mask, b.seq_lens, r.path_depth, a.anchors if a else None,
                                  a.keep if a else None)
                path = greedy_path_ids(self.target, b.input_ids, b.seq_lens, r.path_depth, next_ids=nxt, cache=cache,
                                       need=need).path_ids
        if b.next_ids is not None and need_labels:
            nxt = b.next_ids
        feats = b.features if b.features is not None else feats
        feats = feats.float() if self.amp is None else feats
        labels = target_label_ids(b.input_ids, nxt) if need_labels else None
        if r.rollout and path is None:
            path = b.path_ids
        return TargetOut(feats, logits if need_kl else None, hidden if need_kl and logits is None else None, labels,
                         path, r.mask_on_path)


def target_side(recipe: Recipe, train: Any, contract: Any, target: Any, parts: Any, *, device: torch.device,
                amp: torch.dtype | None, store: FeatureStore | None) -> Callable[..., TargetOut]:
    """The builder of this run's feature source (see the module doc): the shards' rows when they hold
    everything the recipe reads (`Recipe.store_covers`), else the target's forward (`train.target_dtype`)."""
    if recipe.store_covers(store):
        return CachedSide(recipe)
    return OnlineSide(recipe, train.target_dtype, list(contract.target_layer_ids), target, bool(parts.sharded),
                      device, amp)


def scored(out: TargetOut, b: Batch, scoring: str) -> TargetOut:
    """`out` with the labels of a held-out scoring (see the module doc): "target_path" (b.path_ids),
    "on_path_positions" (the target's argmax labels, positions off its path unweighted) or "raw" (the
    training labels, no path, no mask)."""
    if scoring == "target_path":
        return dataclasses.replace(out, path_ids=b.path_ids, on_path_only=False)
    if scoring == "on_path_positions":
        labels = out.label_ids if out.label_ids is not None else target_label_ids(b.input_ids, b.next_ids)
        return dataclasses.replace(out, label_ids=labels, path_ids=None, on_path_only=True)
    return dataclasses.replace(out, path_ids=None, on_path_only=False)


def paths_stored(store: Any, data: Any, heldout: list[int], depth: int) -> bool:
    """Whether the feature shards hold the greedy path (depth ≥ D) of every held-out sample."""
    return isinstance(store, FeatureStore) and all(store.path_rows(data.where[j], depth) for j in heldout)


def heldout_scoring(store: Any, target: Any, data: Any, heldout: list[int], depth: int) -> str:
    """How held-out blocks are scored: "target_path" when the shards hold every held-out sample's greedy
    path or the target is loaded here (`heldout_paths`), "on_path_positions" when only next_ids are had
    (engine features; shards without paths), else "raw"."""
    if paths_stored(store, data, heldout, depth):
        return "target_path"
    if isinstance(target, Target):  # the rollout computes the paths here, where its mask is the target's attention
        longest = max(len(data.input_ids[j]) for j in heldout)
        return "target_path" if depth <= 1 or attention_limit(target.config, longest + depth - 1) is None \
            else "on_path_positions"
    return "on_path_positions" if store is not None and store.has("next_ids") else "raw"


def heldout_labels(recipe: Recipe, train: Any, store: Any, target: Any, data: Any,
                   heldout: list[int]) -> tuple[str, dict[int, torch.Tensor] | None]:
    """The held-out scoring (`heldout_scoring`) and, when the target loaded here gives the paths, the
    held-out samples' paths (`heldout_paths`; None when the shards hold them)."""
    if not heldout:
        return "raw", None
    depth = recipe.path_depth
    how = heldout_scoring(store, target, data, heldout, depth)
    if how == "on_path_positions" and not recipe.target_labels and not (store is not None and store.has("next_ids")):
        how = "raw"  # no target argmax labels in this run (online features with train.labels=raw)
    log.info("held-out τ scored on %s labels", how)
    if how != "target_path" or paths_stored(store, data, heldout, depth):
        return how, None
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None else 0
    return how, heldout_paths(train, target, data, heldout, depth, pad_id=pad or 0)


def heldout_paths(train: Any, target: Target, data: Any, heldout: list[int], depth: int, *,
                  pad_id: int) -> dict[int, torch.Tensor]:
    """The greedy paths [n, D] of the held-out samples (every anchor candidate), computed once with the
    target loaded here, under the online forward's autocast (`train.target_dtype`)."""
    out: dict[int, torch.Tensor] = {}
    dev = target.device
    tamp = target_autocast(train.target_dtype, dev, target.dtype)
    bs = max(1, train.batch_size)
    with torch.no_grad(), torch.autocast(dev.type, dtype=tamp, enabled=tamp is not None):
        for k in range(0, len(heldout), bs):
            idx = heldout[k:k + bs]
            b = collate(data, [(j, -1) for j in idx], run_seed=0, pad_id=pad_id).to(dev)
            need = label_need(b.loss_mask, b.seq_lens, depth)
            got = greedy_path_ids(target, b.input_ids, b.seq_lens, depth, attention_mask=b.attention_mask, need=need)
            out.update((j, got.path_ids[r, :int(b.seq_lens[r])].cpu()) for r, j in enumerate(idx))
    return out
