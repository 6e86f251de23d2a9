"""The run's recipe (train/recipe.py): resolved once from `train.*` and the contract, read by every consumer."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from dflashkit.config import TrainSection
from dflashkit.train.recipe import Recipe, resolve_recipe
from tests.helpers import tiny_contract

ROW_NAMES = ("next_ids", "last_hidden", "path_ids")


class Store:
    """A feature store holding the optional rows `names` (FeatureStore's `has`)."""

    def __init__(self, names):
        self.names = set(names)

    def has(self, name: str) -> bool:
        return name in self.names


def test_resolve_reads_the_train_keys_and_the_contract():
    c = tiny_contract(block_size=5)
    r = resolve_recipe(TrainSection(labels="target", on_path="rollout", features="cached"), c)
    assert (r.labels, r.on_path, r.features) == ("target", "rollout", "cached")
    assert r.target_labels and r.rollout and not r.mask_on_path and r.from_store
    assert r.path_depth == 4 and not r.needs_target_logits  # D = B − 1; plain CE reads no target law
    m = resolve_recipe(TrainSection(on_path="mask", features="online", loss="ce+kl"), c)
    assert m.mask_on_path and not m.rollout and not m.target_labels and not m.from_store and m.needs_target_logits
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.labels = "data"  # type: ignore[misc]


@pytest.mark.parametrize("labels,on_path,features,law", list(itertools.product(
    ("data", "target"), ("off", "mask", "rollout"), ("online", "cached", "engine"), (False, True))))
def test_the_store_serves_exactly_what_the_recipe_reads(labels, on_path, features, law):
    """Every subset of optional rows: the store serves the recipe iff its batches carry rows (cached, engine)
    and it holds next_ids for target labels and last_hidden for the target's law; it covers it iff it also
    holds the greedy paths a rollout learns."""
    r = Recipe(labels=labels, on_path=on_path, features=features, needs_target_logits=law, block_size=4)
    needs = ({"next_ids"} if labels == "target" else set()) | ({"last_hidden"} if law else set())
    for k in range(len(ROW_NAMES) + 1):
        for have in itertools.combinations(ROW_NAMES, k):
            serves = features in ("cached", "engine") and needs <= set(have)
            assert r.store_serves(Store(have)) == serves, have
            assert r.store_covers(Store(have)) == (serves and (on_path != "rollout" or "path_ids" in have)), have
    assert not r.store_serves(None) and not r.store_covers(None)
