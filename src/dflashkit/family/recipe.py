"""`Recipe`: the facts of a run's training objective, resolved once from `train.*` and the drafter's family.

Usage:
    recipe = resolve_recipe(cfg.train, contract)    # at setup (train/loop.py, capture), before any consumer runs
    recipe = config_recipe(cfg)                     # before probe (the budget planner): drafter.type's family
    recipe.target_labels, recipe.rollout, recipe.mask_on_path   # what the labels are
    recipe.cached, recipe.engine_fed, recipe.from_store         # where the target's features come from
    recipe.needs_target_logits                      # the loss reads the target's law (`family.reads_target_law`)
    recipe.store_serves(store)                      # the store holds every label / law input the recipe reads

Every consumer (the trainer, the target side, the draft-vocab choice, the engine feed, capture, the
budget planners) reads these fields instead of re-deriving them from `train.labels`, `train.on_path`,
`train.features` and the family. `Recipe` is frozen and holds plain values only; the config checks
(`config/validate.py`) and the stage fingerprints (`stage_table.py`) still read the raw keys. This module
imports neither dflashkit.config nor torch at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from dflashkit.family import get, reads_target_law
from dflashkit.family.base import DrafterKeys, TrainKeys

if TYPE_CHECKING:
    from dflashkit.family.base import Family
    from dflashkit.family.contract import DrafterContract

Labels = Literal["data", "target"]
OnPath = Literal["off", "mask", "rollout"]
Features = Literal["online", "cached", "engine"]


class RecipeKeys(TrainKeys, Protocol):
    """The `train.*` keys a recipe is resolved from (the config's `TrainSection` is one)."""

    @property
    def labels(self) -> Labels: ...

    @property
    def on_path(self) -> OnPath: ...

    @property
    def features(self) -> Features: ...


class RecipeRun(Protocol):
    """A run config as `config_recipe` reads it (`RunConfig` is one)."""

    @property
    def drafter(self) -> DrafterKeys: ...

    @property
    def train(self) -> RecipeKeys: ...


@dataclass(frozen=True)
class Recipe:
    """What a run trains on and what it needs from the target (see the module doc)."""

    labels: Labels                # train.labels: the text's tokens, or the target's argmax
    on_path: OnPath               # train.on_path: off, weight only on-path positions (mask), or learn the path
    features: Features            # train.features: where the target's features come from
    needs_target_logits: bool     # the loss reads the target's next-token law (KL, a family's term)
    block_size: int               # the drafter's block size B (the greedy path's depth is B − 1)

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
    def online(self) -> bool:
        """The target runs in the training process (`train.features=online`)."""
        return self.features == "online"

    @property
    def cached(self) -> bool:
        """The features are capture's shards (`train.features=cached`): `capture` runs before `train`."""
        return self.features == "cached"

    @property
    def engine_fed(self) -> bool:
        """A vLLM serves the features while training runs (`train.features=engine`)."""
        return self.features == "engine"

    @property
    def from_store(self) -> bool:
        """The batches carry the feature rows: cached shards or the engine's rows (`train.features`)."""
        return self.cached or self.engine_fed

    def store_serves(self, store: Any) -> bool:
        """Whether the feature rows of `store` hold the features and every label / law input the recipe reads
        (`next_ids` for target labels, `last_hidden` for the target's law); greedy paths are not asked."""
        return (self.from_store and store is not None and (not self.target_labels or store.has("next_ids"))
                and (not self.needs_target_logits or store.has("last_hidden")))

    def store_covers(self, store: Any) -> bool:
        """`store_serves`, and the greedy paths too when the recipe learns them (rollout): the target's layers
        need not run at all."""
        return self.store_serves(store) and (not self.rollout or store.has("path_ids"))


def resolve_recipe(train: RecipeKeys, contract: DrafterContract | None = None, *, family: Family | None = None,
                   block_size: int | None = None) -> Recipe:
    """The recipe of `train.*` for the drafter of `contract` (its family decides whether the loss reads the
    target's law; its block size the greedy path's depth), or, with no contract yet, for `family` and
    `block_size` (both then required). Reads no file and imports no torch."""
    if contract is not None:
        family, block_size = contract.family, int(contract.block_size)
    if family is None or block_size is None:
        raise TypeError("resolve_recipe: give a contract, or both family= and block_size=")
    return Recipe(labels=train.labels, on_path=train.on_path, features=train.features,
                  needs_target_logits=reads_target_law(train, family), block_size=int(block_size))


def config_recipe(cfg: RecipeRun) -> Recipe:
    """The recipe a config asks for before any contract exists: `drafter.type`'s family and
    `drafter.block_size` (what probe writes into the contract unless the target's drafter overrides them)."""
    return resolve_recipe(cfg.train, family=get(cfg.drafter.type), block_size=cfg.drafter.block_size)
