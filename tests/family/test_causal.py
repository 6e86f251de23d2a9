"""The `causal` knob (JetSpec) as the engines read it: our reader ≡ a per-layer oracle written from vLLM 0.32's
`_dflash_layer_causal` over every combination of the keys, for both formats; config keys and contract checks."""

from __future__ import annotations

import itertools
import json

import pytest

from dflashkit import family
from dflashkit.cli import main
from dflashkit.errors import UsageError
from dflashkit.export.speculators import read_speculators_contract, speculators_config
from dflashkit.family.contract import DrafterContract
from tests.helpers import tiny_contract, with_fields

MISSING = object()
LAYERS = {"none": None, "full": ["full_attention"] * 2, "sliding": ["sliding_attention"] * 2,
          "mixed": ["sliding_attention", "full_attention"]}


def _vllm_layer_causal(cfg: dict, i: int) -> bool:
    """vLLM 0.32 `qwen3_dflash._dflash_layer_causal`, restated: is_causal, then dflash_config.causal, then the
    layer's type."""
    if cfg.get("is_causal") is not None:
        return bool(cfg["is_causal"])
    if (cfg.get("dflash_config") or {}).get("causal") is not None:
        return bool(cfg["dflash_config"]["causal"])
    types = cfg.get("layer_types")
    return bool(types) and types[i] == "sliding_attention"


def _zlab(top, inner, layers) -> dict:
    cfg = tiny_contract().to_hf_config()
    cfg.pop("is_causal", None)
    cfg["dflash_config"].pop("causal", None)
    if top is not MISSING:
        cfg["is_causal"] = top
    if inner is not MISSING:
        cfg["dflash_config"]["causal"] = inner
    if LAYERS[layers] is None:
        cfg.pop("layer_types")
    else:
        cfg["layer_types"] = LAYERS[layers]
        if "sliding_attention" in LAYERS[layers]:
            cfg["sliding_window"] = 4  # vLLM needs a window for a sliding layer (a ValueError without one)
    return cfg


@pytest.mark.parametrize("top,inner,layers", list(itertools.product([MISSING, None, True, False],
                                                                    [MISSING, None, True, False], list(LAYERS))))
def test_zlab_reader_resolves_causality_as_vllm_does(top, inner, layers):
    cfg = _zlab(top, inner, layers)
    per_layer = [_vllm_layer_causal(cfg, i) for i in range(cfg["num_hidden_layers"])]
    contract = DrafterContract.from_hf_config(cfg, source="x/config.json")
    assert contract.layer_causal == per_layer  # causal in some layers only: the sliding ones (`causal_layers`)
    if len(set(per_layer)) == 1:
        assert contract.knobs.causal is per_layer[0] and contract.causal_layers is None


@pytest.mark.parametrize("key,value", [("is_causal", "true"), ("is_causal", 1), ("dflash_config.causal", "yes")])
def test_a_non_boolean_causality_key_is_named(key, value):
    cfg = tiny_contract().to_hf_config()
    if key == "is_causal":
        cfg["is_causal"] = value
    else:
        cfg["dflash_config"]["causal"] = value
    with pytest.raises(UsageError, match=f"x/config.json: {key} must be true or false, got {value!r}"):
        DrafterContract.from_hf_config(cfg, source="x/config.json")


def _spec(causal: bool) -> dict:
    return speculators_config(with_fields(tiny_contract(), causal=causal), verifier="t", verifier_architectures=["X"])


@pytest.mark.parametrize("non_causal,top", list(itertools.product([MISSING, True, False], [MISSING, True, False])))
def test_speculators_reader_resolves_causality_as_vllm_does(non_causal, top):
    """vLLM's `update_dflash`: dflash_config.causal = not sliding_window_non_causal (missing: true), and the
    transformer_layer_config's keys become the model config's top level (its is_causal first)."""
    cfg = _spec(False)
    cfg.pop("sliding_window_non_causal")
    if non_causal is not MISSING:
        cfg["sliding_window_non_causal"] = non_causal
    if top is not MISSING:
        cfg["transformer_layer_config"]["is_causal"] = top
    model_cfg = {**cfg["transformer_layer_config"],
                 "dflash_config": {"causal": not cfg.get("sliding_window_non_causal", True)}}
    want = _vllm_layer_causal(model_cfg, 0)
    contract, _ = read_speculators_contract(cfg, source="s/config.json")
    assert contract.knobs.causal is want


def test_speculators_writer_and_bad_value():
    assert _spec(False)["sliding_window_non_causal"] is True and _spec(True)["sliding_window_non_causal"] is False
    cfg = _spec(True)
    cfg["sliding_window_non_causal"] = "no"
    with pytest.raises(UsageError, match="s/config.json: key `sliding_window_non_causal` is 'no'"):
        read_speculators_contract(cfg, source="s/config.json")


def test_every_family_takes_the_knob_and_writes_it(tmp_path, capsys):
    for fam in family.FAMILIES.values():
        c = with_fields(tiny_contract(), drafter_type=fam.name, causal=True,
                        **({"conv_group_size": 8} if fam.name == "dflash2" else {}))
        c.check()
        hf = c.to_hf_config()
        assert hf["is_causal"] is True and hf["dflash_config"]["causal"] is True, fam.name
        back = DrafterContract.from_hf_config(json.loads(json.dumps(hf)))
        assert back.drafter_type == fam.name and back.knobs == c.knobs, fam.name
    # drafter.causal is a config key: a non-boolean is exit 2 naming it, at load time (the schema's type)
    assert main(["train", "--dry-run", f"run.run_dir={tmp_path}", "drafter.causal=maybe"]) == 2
    assert "drafter.causal" in capsys.readouterr().err
