"""`Recipe`: the facts of a training run's recipe, resolved once from `train.*` and the drafter contract.

Usage:
    recipe = resolve_recipe(cfg.train, contract)    # at setup (train/loop.py), before any consumer runs
    recipe.target_labels, recipe.rollout, recipe.mask_on_path   # what the labels are
    recipe.from_store                               # the batches carry feature rows (cached shards or engine)
    recipe.needs_target_logits                      # the loss reads the target's law (`family.reads_target_law`)
    recipe.store_serves(store)                      # the store holds every label / law input the recipe reads

Every consumer (the trainer, the target side, the draft-vocab choice, the engine feed, capture) reads
these fields instead of re-deriving them from `train.labels`, `train.on_path`, `train.features` and the
contract's family. `Recipe` is frozen and holds plain values only; the config checks
(`config/validate.py`) still check the raw keys, before any contract exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from dflashkit.family import reads_target_law

if TYPE_CHECKING:
    from dflashkit.config import TrainSection
    from dflashkit.family.contract import DrafterContract

Labels = Literal["data", "target"]
OnPath = Literal["off", "mask", "rollout"]
Features = Literal["online", "cached", "engine"]


@dataclass(frozen=True)
class Recipe:
    """What a run trains on and what it needs from the target (see the module doc)."""

    labels: Labels                # train.labels: the text's tokens, or the target's argmax
    on_path: OnPath               # train.on_path: off, weight only on-path positions (mask), or learn the path
    features: Features            # train.features: where the target's features come from
    needs_target_logits: bool     # the loss reads the target's next-token law (KL, a family's term)
    block_size: int               # the contract's block size B (the greedy path's depth is B − 1)

    @property
    def path_depth(self) -> int:
        """D of the target's greedy path that the labels of a block read (`model/path_labels.path_depth`)."""
        from dflashkit.model.path_labels import path_depth  # torch: not for the light commands that resolve a recipe

        return path_depth(self.block_size)

    @property
    def target_labels(self) -> bool:
        """The labels are the target's own argmax (`train.labels=target`)."""
        return self.labels == "target"

    @property
    def rollout(self) -> bool:
        """The labels are the target's greedy path (`train.on_path=rollout`)."""
        return self.on_path == "rollout"

    @property
    def mask_on_path(self) -> bool:
        """Positions off the target's path get weight 0 (`train.on_path=mask`)."""
        return self.on_path == "mask"

    @property
    def from_store(self) -> bool:
        """The batches carry the feature rows: cached shards or the engine's rows (`train.features`)."""
        return self.features in ("cached", "engine")

    def store_serves(self, store: Any) -> bool:
        """Whether the feature rows of `store` hold the features and every label / law input the recipe reads
        (`next_ids` for target labels, `last_hidden` for the target's law); greedy paths are not asked."""
        return (self.from_store and store is not None and (not self.target_labels or store.has("next_ids"))
                and (not self.needs_target_logits or store.has("last_hidden")))

    def store_covers(self, store: Any) -> bool:
        """`store_serves`, and the greedy paths too when the recipe learns them (rollout): the target's layers
        need not run at all."""
        return self.store_serves(store) and (not self.rollout or store.has("path_ids"))


def resolve_recipe(train: TrainSection, contract: DrafterContract) -> Recipe:
    """The recipe of `train.*` for the drafter of `contract` (its family decides whether the loss reads the
    target's law; its block size the greedy path's depth). Reads no file and imports no torch."""
    return Recipe(labels=train.labels, on_path=train.on_path, features=train.features,
                  needs_target_logits=reads_target_law(train, contract.family), block_size=int(contract.block_size))
