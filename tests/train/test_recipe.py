"""The run's recipe (family/recipe.py): resolved once from `train.*` and the contract, read by every consumer."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import pytest

from dflashkit import family
from dflashkit.config import TrainSection, load_config
from dflashkit.family.recipe import Recipe, config_recipe, resolve_recipe
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
    assert r.cached and not r.online and not r.engine_fed
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


@pytest.mark.parametrize("features", ["online", "cached", "engine"])
def test_exactly_one_feature_source_and_store_means_cached_or_engine(features):
    r = resolve_recipe(TrainSection(features=features), tiny_contract())
    assert [r.online, r.cached, r.engine_fed] == [features == f for f in ("online", "cached", "engine")]
    assert r.from_store == (r.cached or r.engine_fed)


@pytest.mark.parametrize("drafter_type,loss,block", [("dflash", "ce", 4), ("dflash", "kl", 6), ("lilicorr", "ce", 5),
                                                     ("dflash2", "ce+kl", 8)])
def test_the_config_recipe_is_the_contracts_for_the_same_family_and_block_size(drafter_type, loss, block):
    """Before probe (`config_recipe`: drafter.type's family, drafter.block_size) the recipe is the one the
    contract of that family and block size resolves, and `resolve_recipe(family=, block_size=)` agrees."""
    cfg = load_config(None, [f"drafter.type={drafter_type}", f"drafter.block_size={block}", f"train.loss={loss}",
                             "train.on_path=mask", "train.labels=target", "train.features=cached"])
    c = dataclasses.replace(tiny_contract(block_size=block), drafter_type=drafter_type, knobs=None)
    want = resolve_recipe(cfg.train, c)
    assert config_recipe(cfg) == want == resolve_recipe(cfg.train, family=family.get(drafter_type), block_size=block)
    assert want.needs_target_logits == family.reads_target_law(cfg.train, family.get(drafter_type))
    assert want.block_size == block and want.mask_on_path and want.target_labels and want.cached


def test_resolve_without_a_contract_needs_a_family_and_a_block_size():
    with pytest.raises(TypeError):
        resolve_recipe(TrainSection(), family=family.DEFAULT)
    with pytest.raises(TypeError):
        resolve_recipe(TrainSection(), block_size=4)


def test_the_recipe_module_imports_neither_torch_nor_the_config():
    """The light commands (`plan`, `run`'s stage choice) resolve a recipe: it must not pull torch in."""
    code = ("import sys; import dflashkit.family.recipe; "
            "print(sorted(m for m in ('torch', 'dflashkit.config') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
