"""`DrafterContract.check`: the one contract-vs-target check (train, capture, eval, import, the decoder)."""

from __future__ import annotations

import logging

import pytest

from dflashkit.errors import UsageError
from dflashkit.family.contract import DrafterContract

FACTS = {"num_layers": 8, "hidden_size": 64, "vocab_size": 320}


def _contract(**change) -> DrafterContract:
    fields = dict(block_size=4, num_draft_layers=1, target_layer_ids=[1, 5], mask_token_id=300,
                  num_target_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=320)
    return DrafterContract(**{**fields, **change})


def test_a_fitting_contract_passes_with_and_without_a_target():
    _contract().check()
    _contract().check(FACTS)


@pytest.mark.parametrize("target,expect", [
    ({**FACTS, "hidden_size": 96}, ["hidden_size 64 != the target's 96"]),
    ({**FACTS, "num_layers": 4}, ["target_layer_ids [5] are outside the target's layers [0, 4)"]),
    ({**FACTS, "vocab_size": 256}, ["mask_token_id 300 is outside the target vocab [0, 256)",
                                    "vocab_size 320 != the target's 256"]),
])
def test_every_mismatch_is_named_at_once(target, expect):
    with pytest.raises(UsageError) as e:
        _contract().check(target, where="drafter runs/x", hint="do this")
    assert str(e.value).startswith("drafter runs/x does not fit the target: ")
    assert all(x in str(e.value) for x in expect), str(e.value)
    assert e.value.hint == "do this" and e.value.exit_code == 2


def test_without_a_target_the_contract_is_checked_against_its_own_facts():
    with pytest.raises(UsageError, match=r"invalid drafter contract: .*target_layer_ids \[9\].*block_size"):
        _contract(target_layer_ids=[1, 9], block_size=0).check()


def test_a_different_layer_count_alone_only_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="dflashkit.contract"):
        _contract().check({**FACTS, "num_layers": 12})
    assert "built for a 8-layer target; this target has 12 layers" in caplog.text
