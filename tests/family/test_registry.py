"""The family registry: what users read (the schema) agrees with what the families declare, the contract
stays flat on disk, and the family-owned config checks run when a command's config loads."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflashkit import family
from dflashkit.cli import main
from dflashkit.config import DrafterSection, config_to_dict
from dflashkit.errors import UsageError
from dflashkit.family.contract import DrafterContract
from dflashkit.train.stats import StepStats
from tests.helpers import tiny_contract, with_fields


def test_each_familys_knobs_are_drafter_keys_with_the_schemas_defaults():
    schema = config_to_dict(DrafterSection())  # the flat drafter.* keys, every family's knobs among them
    for fam in family.FAMILIES.values():
        defaults = fam.knobs()
        for name in fam.knob_names:
            assert name in schema, f"{fam.name}: knob {name} is not a drafter.* key (config/schema.py)"
            assert getattr(defaults, name) == schema[name], (fam.name, name)
    # one owner per knob: a knob two families have is declared once, by a knobs class the other's extends
    for name in family.knob_keys():
        owners = {next(k for k in fam.knobs.__mro__ if name in getattr(k, "__annotations__", {}))
                  for fam in family.FAMILIES.values() if name in fam.knob_names}
        assert len(owners) == 1, (name, owners)
    assert "causal" in family.get("dflash2").knob_names and family.get("dflash2").knobs.__mro__[1] is family.DEFAULT.knobs
    assert len({f.architecture for f in family.FAMILIES.values()}) == len(family.FAMILIES)
    assert family.DEFAULT.name in family.FAMILIES and DrafterSection().type == family.DEFAULT.name


def test_contract_json_stays_flat_and_round_trips_each_family():
    d2 = with_fields(tiny_contract(), drafter_type="dflash2", conv_group_size=8, selector_top_k=5, output_multiplier=2.0)
    data = d2.to_dict()
    assert data["selector_top_k"] == 5 and data["output_multiplier"] == 2.0 and "knobs" not in data
    assert DrafterContract.from_dict(json.loads(json.dumps(data))) == d2
    plain = tiny_contract().to_dict()
    mla = {"attention_type", "mla_q_lora_rank", "mla_kv_lora_rank", "mla_qk_nope_head_dim", "mla_qk_rope_head_dim",
           "mla_v_head_dim"}
    assert set(plain) & set(family.knob_keys()) == {"causal", *mla} and plain["causal"] is False  # DFlash's knobs
    assert plain["attention_type"] == "gqa"
    assert DrafterContract.from_dict(plain) == tiny_contract()
    old = {k: v for k, v in plain.items() if k != "causal" and k not in mla}  # written before the knobs existed
    assert DrafterContract.from_dict(old) == tiny_contract()
    causal = with_fields(tiny_contract(), causal=True)
    assert causal.to_dict()["causal"] is True and DrafterContract.from_dict(causal.to_dict()) == causal
    with pytest.raises(AttributeError):  # a misspelt (or another family's) field is never silently ignored
        d2.selector_top_k = 3  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match="drafter_type 'dflash3' is not one of"):
        DrafterContract.from_dict({**plain, "drafter_type": "dflash3"}).check()
    with pytest.raises(UsageError, match="knobs DFlashKnobs are not the DFlash2 family's"):
        dataclasses.replace(tiny_contract(), drafter_type="dflash2").check()
    with pytest.raises(UsageError, match="knobs DFlash2Knobs are not the DFlash family's"):  # a subclass is not enough
        dataclasses.replace(d2, drafter_type="dflash").check()
    with pytest.raises(UsageError, match="causal must be true or false, got 'yes'"):  # a hand-edited contract.json
        DrafterContract.from_dict({**plain, "causal": "yes"}).check()


def test_family_checks_run_when_a_commands_config_loads(tmp_path, capsys):
    def err(*args: str) -> str:
        assert main(["train", "--dry-run", f"run.run_dir={tmp_path}", *args]) == 2
        return capsys.readouterr().err

    e = err("drafter.type=dflash3")
    assert "drafter.type: 'dflash3' is not a drafter family, one of ['dflash', 'dflash2', 'lilicorr', 'dspark'] (did you mean" in e
    e = err("drafter.type=dflash2", "drafter.selector_top_k=0", "drafter.draft_vocab_size=24", "train.lr=0")
    assert "drafter.selector_top_k: must be >= 1, got 0" in e and "train.lr: must be > 0" in e  # listed together
    assert "drafter.draft_vocab_size: 24 with drafter.type=dflash2" in e and "full target vocabulary" in e
    assert family.config_problems(DrafterSection(draft_vocab_size=24)) == []  # DFlash takes a draft vocab


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "lilicorr", "dspark"])
def test_step_stats_go_through_one_flat_tensor_and_back(kind):
    fam = family.get(kind)
    st = StepStats.zeros(4, fam)
    st.loss, st.tau_sum, st.blocks, st.tokens = 1.5, 20.0, 9.0, 77.0
    st.covered, st.complemented = 4.0, 2.0  # train.suffix_complement's count and its micro-batches
    st.correct += torch.tensor([0.0, 3, 2, 1], dtype=torch.float64)
    st.total += torch.tensor([0.0, 5, 5, 4], dtype=torch.float64)
    for i, f in enumerate(fam.objective.stats):
        st.extra[f.name] = st.extra[f.name] + (torch.arange(4.0).double() if f.size == "B" else 0.0) + i + 1
    t = st.to_tensor()
    assert t.dtype == torch.float64 and t.numel() == 6 + 2 * 4 + sum(4 if f.size == "B" else 1 for f in fam.objective.stats)
    back = StepStats.from_tensor(t, 4, fam)
    assert torch.equal(back.to_tensor(), t) and back.metrics(3) == st.metrics(3)
    assert set(back.metrics(3)) >= {"tau", "acc", "loss", "suffix_covered", *fam.metric_names}
    assert back.metrics(3)["suffix_covered"] == 4.0 / 14  # of the supervised positions 1 … B−1
    with pytest.raises(ValueError, match="statistics of"):
        StepStats.from_tensor(t[:-1], 4, fam)


def test_tensors_of_another_family_are_named(tmp_path):
    d1, d2 = family.DEFAULT, family.get("dflash2")
    w, c = tmp_path / "model.safetensors", tmp_path / "config.json"
    have = {"fc.weight", "layers.0.mlp_conv.base_kernel"}
    with pytest.raises(UsageError, match="holds DFlash2 tensors .*declares a DFlash drafter"):
        family.check_tensors(d1, have, {"fc.weight"}, weights=w, config=c)
    with pytest.raises(UsageError, match="lack its DFlash2 tensors: candidate_selector.successor_codebook"):
        family.check_tensors(d2, {"fc.weight"}, {"fc.weight", "candidate_selector.successor_codebook"},
                             weights=w, config=c)
    family.check_tensors(d2, have, have, weights=w, config=c)  # its own: fine


# family keys named before the rule that a family's keys carry its name (users' configs keep them)
GRANDFATHERED = {"causal", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                 "input_embedding_scale", "output_multiplier", "final_logit_softcapping", "selector_loss_weight"}
# the draft attention's keys: DFlash's knobs that every family built on DFlash's attention layers inherits (#50)
ATTENTION = {"attention_type", "mla_q_lora_rank", "mla_kv_lora_rank", "mla_qk_nope_head_dim", "mla_qk_rope_head_dim",
             "mla_v_head_dim"}


def test_family_keys_carry_the_familys_name_or_are_grandfathered():
    for fam in family.FAMILIES.values():
        for key in (*fam.knob_names, *fam.weight_names):
            assert key.startswith(f"{fam.name}_") or key in GRANDFATHERED or key in ATTENTION, (fam.name, key)


def test_the_schema_is_built_from_the_declarations():
    from dflashkit.config import TrainSection, iter_fields
    from dflashkit.train.guards import objective_keys

    schema = {key: (default, text) for key, _, default, text in iter_fields()}
    for section, part in (("drafter", "knobs"), ("train", "weights")):
        for fam in family.FAMILIES.values():
            for f in dataclasses.fields(getattr(fam, part)):
                assert schema[f"{section}.{f.name}"] == (f.default, f.metadata["help"]), (section, f.name)
    assert set(family.weight_keys()) <= set(objective_keys())  # a resume under other weights is refused
    assert type(DrafterSection().knobs) is family.DEFAULT.knobs and type(TrainSection().weights) is family.DEFAULT.weights
    assert "selector_loss_weight" not in family.DEFAULT.weight_names


def test_declared_ranges_are_checked_for_the_config_and_the_contract():
    from dflashkit.config import config_problems
    from dflashkit.config import RunConfig
    from dflashkit.family.knobs import range_problems

    knobs = family.get("lilicorr").knobs(lilicorr_vector_eps=0.5, lilicorr_num_heads=0)
    assert range_problems(knobs) == ["lilicorr_num_heads: must be >= 1, got 0",
                                     "lilicorr_vector_eps: must be in (0, 0.5), got 0.5"]
    d2 = family.get("dflash2").knobs(output_multiplier=-1.0)
    assert range_problems(d2, prefix="drafter.") == ["drafter.output_multiplier: must be > 0 (or null), got -1.0"]
    from dflashkit.config import TrainSection
    from dflashkit.family.lilicorr import LiLiCorrWeights

    cfg = RunConfig(drafter=DrafterSection(type="lilicorr"), train=TrainSection(weights=LiLiCorrWeights(lilicorr_margin=0.0)))
    assert "train.lilicorr_margin: must be > 0, got 0.0" in config_problems(cfg)
    with pytest.raises(UsageError, match="selector_rank: must be >= 1, got 0"):
        with_fields(tiny_contract(), drafter_type="dflash2", conv_group_size=8, selector_rank=0).check()
