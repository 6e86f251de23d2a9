"""The target's side of a micro-batch: one builder per feature source.

Usage:
    side = target_side(cfg.train, contract, target, parts, device=dist.device, amp=amp, store=data.features)
    out = side(batch)            # TargetOut: features, and the labels / KL target the recipe asks for

`CachedSide`: every output the recipe needs is in the feature shards (`train.features=cached` and,
for `train.labels=target`, their `next_ids`; for KL, their `last_hidden`) or in the engine's rows
(`train.features=engine`, `engines/feed.py`: the same rows, staged per batch): the target's layers
never run. `OnlineSide`: the target runs on the batch — a sharded target (`train.parallel.target=shard`)
gives logits, a whole one its final-norm hidden state; cached features or `next_ids`, where the
shards have them, replace the target's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from dflashkit.model.target import target_autocast
from dflashkit.train.data import Batch, FeatureStore
from dflashkit.train.objective import target_label_ids

if TYPE_CHECKING:
    from dflashkit.config import TrainSection


@dataclass
class TargetOut:
    """The target's side of one micro-batch (see `Trainer.target_outputs`)."""

    features: torch.Tensor                  # [b, S, n_feat·H]
    logits: torch.Tensor | None = None      # [b, S, V] (sharded targets; for KL or a family's term)
    last_hidden: torch.Tensor | None = None  # [b, S, H] final-norm output (for KL or a family's term)
    label_ids: torch.Tensor | None = None   # [b, S] labels from the target (train.labels=target)


def cached_covers(train: TrainSection, store: FeatureStore | None, law: bool) -> bool:
    """Whether the feature shards hold everything the recipe needs from the target (`law`: the loss reads the
    target's logits, `family.reads_target_law`)."""
    if train.features not in ("cached", "engine") or store is None:
        return False
    return (train.labels != "target" or store.has("next_ids")) and (not law or store.has("last_hidden"))


@dataclass
class CachedSide:
    """Features, labels and the target's law (KL, a family's term) from the shards (the batch carries them)."""

    train: Any
    law: bool = False

    def __call__(self, b: Batch) -> TargetOut:
        t = self.train
        assert b.features is not None
        labels = target_label_ids(b.input_ids, b.next_ids) if t.labels == "target" else None
        return TargetOut(b.features, None, b.last_hidden if self.law else None, labels)


@dataclass
class OnlineSide:
    """The target's forward on the batch (sharded: logits; whole: the final-norm hidden state)."""

    train: Any
    layer_ids: list[int]
    target: Any
    sharded: bool
    device: torch.device
    amp: torch.dtype | None
    law: bool = False          # the loss reads the target's logits (`family.reads_target_law`)

    def __call__(self, b: Batch) -> TargetOut:
        t = self.train
        need_kl, need_labels = self.law, t.labels == "target"
        logits = hidden = None
        tamp = target_autocast(t.target_dtype, self.device, self.target.dtype)
        with torch.no_grad(), torch.autocast(self.device.type, dtype=tamp, enabled=tamp is not None):
            if self.sharded:  # a sharded target gives logits, not its final-norm hidden state
                feats, out = self.target.features(b.input_ids, layer_ids=self.layer_ids, need_logits=True,
                                                  attention_mask=b.attention_mask)
                logits = out.logits
                nxt = logits.argmax(-1) if need_labels else None
            elif need_labels or need_kl:
                feats, hidden = self.target.features(b.input_ids, layer_ids=self.layer_ids, need_last_hidden=True,
                                                     attention_mask=b.attention_mask)
                nxt = self.target.next_token_ids(hidden) if need_labels else None
            else:
                feats, nxt = self.target.features(b.input_ids, layer_ids=self.layer_ids,
                                                  attention_mask=b.attention_mask), None
        if b.next_ids is not None and need_labels:
            nxt = b.next_ids
        feats = b.features if b.features is not None else feats
        feats = feats.float() if self.amp is None else feats
        labels = target_label_ids(b.input_ids, nxt) if need_labels else None
        return TargetOut(feats, logits if need_kl else None, hidden if need_kl and logits is None else None, labels)


def target_side(train: Any, contract: Any, target: Any, parts: Any, *, device: torch.device,
                amp: torch.dtype | None, store: FeatureStore | None) -> Callable[[Batch], TargetOut]:
    """The builder of this run's feature source (see the module doc)."""
    from dflashkit.family import reads_target_law

    law = reads_target_law(train, contract.family)
    if cached_covers(train, store, law):
        return CachedSide(train, law)
    return OnlineSide(train, list(contract.target_layer_ids), target, bool(parts.sharded), device, amp, law)
