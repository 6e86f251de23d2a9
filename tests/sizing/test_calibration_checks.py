"""A saved calibration is used only when valid for this machine and config, else named and measured again; no rates
make a plan with a number that cannot be (`sizing/calibration.py`, `sizing/plan.py`, `sizing/session.py`)."""

from __future__ import annotations

import json
import logging
import math

import pytest

from dflashkit.config import load_config
from dflashkit.errors import UsageError
from dflashkit.rundir import RunDir
from dflashkit.sizing import calibration as calib
from dflashkit.sizing import plan as sp
from dflashkit.sizing.plan import PlanError, Rates, check_plan, plan_run
from dflashkit.sizing.session import BudgetSession

ACTIVE = ["probe", "prepare", "tokenize", "capture", "train", "eval", "export", "report"]
BASE = ["train.features=cached", "data.heldout=24", "train.batch_size=8", "train.heldout_samples=36",
        "train.num_anchors=16", "drafter.block_size=4", "eval.block_sizes=[2,4]", "tokenize.max_length=512",
        "eval.warmup=1", "run.budget_minutes=5"]
RATES = {"capture_tok_s": 665.0, "train_step_s": 0.35, "decode_s": {"1": 0.06, "2": 0.08, "4": 0.1}, "load_s": 3.0,
         "calibrate_s": 25.0}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def config(*overrides: str):
    return load_config(None, [*BASE, *overrides])


def valid(cfg) -> dict:
    m = calib.machine(cfg.target.device)
    return {"version": calib.VERSION, "machine": m, "machine_key": calib.machine_key(m), "shape": calib.shape_key(cfg),
            "device": "cpu", "capture_dtype": "float32", "verify_dtype": "float32", "sample_tokens": 64,
            **json.loads(json.dumps(RATES))}


def edited(**change) -> callable:
    def edit(cal: dict) -> str:
        for k, v in change.items():
            if v is KeyError:
                cal.pop(k)
            else:
                cal[k] = v
        return json.dumps(cal)  # inf / nan written as JSON's Infinity / NaN, as a hand edit or another tool might
    return edit


BAD = {  # what a file holds → a phrase of the reason the warning gives
    "corrupt bytes": (lambda cal: b"\xff\xfe\x00garbage", "not UTF-8"),
    "cut short": (lambda cal: json.dumps(cal)[: len(json.dumps(cal)) // 2], "not valid JSON"),
    "a list": (lambda cal: json.dumps([cal]), "not an object"),
    "another machine": (edited(machine_key="cuda-h100-0123456789"), "another machine"),
    "another config": (edited(shape="0123456789ab"), "another config"),
    "old version": (edited(version=0), "version"),
    "negative capture": (edited(capture_tok_s=-665.0), "capture_tok_s"),
    "zero train step": (edited(train_step_s=0), "train_step_s"),
    "nan train step": (edited(train_step_s=math.nan), "train_step_s"),
    "rate as text": (edited(capture_tok_s="665"), "capture_tok_s"),
    "rate as bool": (edited(train_step_s=True), "train_step_s"),
    "no capture rate": (edited(capture_tok_s=KeyError), "capture_tok_s is missing"),
    "infinite decode": (edited(decode_s={"1": math.inf, "4": 0.1}), "t(1)"),
    "negative decode": (edited(decode_s={"1": 0.06, "4": -0.1}), "t(4)"),
    "no t(1)": (edited(decode_s={"4": 0.1}), "no t(1)"),
    "decode key 0": (edited(decode_s={"0": 0.1, "1": 0.1}), "'0'"),
    "decode a list": (edited(decode_s=[0.06, 0.1]), "decode_s"),
    "negative load": (edited(load_s=-3.0), "load_s"),
}


def write(path, body) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(body, bytes):
        path.write_bytes(body)
    else:
        path.write_text(body)


@pytest.mark.parametrize("where", ["run dir", "cache"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_calibration_file_is_named_with_why_and_not_used(tmp_path, cache, caplog, where, case):
    cfg, rd = config(), RunDir(tmp_path / "run")
    cal = valid(cfg)
    path = rd.root / "calibration.json" if where == "run dir" else calib.cache_path(cal["machine_key"], cal["shape"])
    make, why = BAD[case]
    write(path, make(dict(cal)))
    with caplog.at_level(logging.WARNING, logger="dflashkit.sizing"):
        assert calib.saved_calibration(cfg, rd) is None
    warned = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert warned and why in warned[0], (warned, caplog.text)
    found, ignored = calib.find_calibration(cfg, rd)
    assert found is None and len(ignored) == 1 and ignored[0].startswith(f"{path}: ")


def test_a_bad_run_dir_file_falls_back_to_a_valid_cache_entry(tmp_path, cache, caplog):
    cfg, rd = config(), RunDir(tmp_path / "run")
    calib.save_calibration(valid(cfg), None)  # the cache only
    write(rd.root / "calibration.json", json.dumps({**valid(cfg), "train_step_s": -1}))
    with caplog.at_level(logging.WARNING, logger="dflashkit.sizing"):
        found = calib.saved_calibration(cfg, rd)
    assert found is not None and found["path"].startswith(str(cache)) and found["train_step_s"] == 0.35
    assert str(rd.root / "calibration.json") in caplog.text and "train_step_s" in caplog.text


@pytest.mark.parametrize("case", ["corrupt bytes", "cut short", "another machine", "negative capture",
                                  "infinite decode"])
def test_a_budgeted_run_measures_again_over_a_bad_cache_entry(tmp_path, cache, caplog, monkeypatch, case):
    """One bad cache entry never breaks a run: it is named, measured again (a stub here) and overwritten."""
    cfg, rd = config(), RunDir(tmp_path / "run")
    entry = calib.cache_path(valid(cfg)["machine_key"], valid(cfg)["shape"])
    write(entry, BAD[case][0](valid(cfg)))
    measured: list = []

    def measure(c, r, *, save=True):
        measured.append(r)
        cal = valid(c)
        calib.save_calibration(cal, r)
        return cal

    monkeypatch.setattr(calib, "calibrate", measure)
    state: dict = {}
    with caplog.at_level(logging.WARNING, logger="dflashkit.sizing"):
        session = BudgetSession.open(cfg, rd, state, active=ACTIVE, dry_run=False)
    assert len(measured) == 1 and str(entry) in caplog.text
    assert session.record is not None and state["budget"]["plan"]["sizes"]["data.num_prompts"] >= 1
    assert json.loads(entry.read_text())["capture_tok_s"] == RATES["capture_tok_s"]  # the entry is good again
    assert calib.saved_calibration(cfg, RunDir(tmp_path / "elsewhere")) is not None


def test_a_saved_record_whose_plan_cannot_be_is_planned_again(tmp_path, cache, caplog, monkeypatch):
    cfg, rd = config(), RunDir(tmp_path / "run")
    calib.save_calibration(valid(cfg), rd)
    state: dict = {}
    BudgetSession.open(cfg, rd, state, active=ACTIVE, dry_run=False)
    good = json.loads(json.dumps(state["budget"]))
    state["budget"]["plan"]["stages"]["capture"] = -4185591.3  # a record written from negative rates
    with caplog.at_level(logging.WARNING, logger="dflashkit.run"):
        session = BudgetSession.open(cfg, rd, state, active=ACTIVE, dry_run=False)
    assert not session.reused and "capture" in caplog.text
    assert state["budget"]["plan"]["stages"] == good["plan"]["stages"]


@pytest.mark.parametrize("field, value", [("capture_tok_s", -665.0), ("capture_tok_s", 0.0), ("train_step_s", -0.35),
                                          ("train_step_s", math.inf), ("capture_tok_s", math.nan), ("load_s", -3.0),
                                          ("decode_s", {1: -0.06, 4: 0.1}), ("decode_s", {1: 0.06, 4: math.nan})])
def test_rates_that_cannot_be_never_make_a_plan(field, value):
    with pytest.raises(PlanError, match=field.split("_")[0]):
        Rates(**{**{k: v for k, v in RATES.items() if k != "decode_s"}, "decode_s": {1: 0.06, 4: 0.1}, field: value})
    with pytest.raises(UsageError, match=field):
        calib.rates({**RATES, field: {str(k): v for k, v in value.items()} if isinstance(value, dict) else value})


def assert_consistent(cfg, p, rates, fixed=frozenset()):
    """The plan's sizes cost what its stages say, and those add up to its total within the budget."""
    s, st = p["sizes"], p["stages"]
    assert all(isinstance(v, int) and v >= 1 for v in s.values()), s
    assert all(math.isfinite(v) and v >= 0 for v in st.values()), st
    assert abs(sum(st.values()) - p["planned_s"]) < 1.0 and 0 < p["planned_s"] <= p["usable_s"] + 0.1
    per_prompt = sp.PER_PROMPT_S["prepare"] + sp.PER_PROMPT_S["tokenize"]
    assert st["prepare"] + st["tokenize"] >= s["data.num_prompts"] * per_prompt - 0.1
    assert st["train"] >= s["train.max_steps"] * sp.step_s(cfg, rates, fixed) - 0.1
    assert s["data.num_prompts"] * per_prompt <= p["usable_s"]


@pytest.mark.parametrize("features", ["cached", "online"])
@pytest.mark.parametrize("rates", [Rates(capture_tok_s=665, train_step_s=0.35, decode_s={1: 0.06, 4: 0.1}),
                                   Rates(capture_tok_s=1e9, train_step_s=1e-6, decode_s={1: 1e-6}, load_s=0),
                                   Rates(capture_tok_s=1e-3, train_step_s=1e4, decode_s={1: 50.0}, load_s=1e3)])
def test_a_five_minute_free_plan_costs_what_it_says(features, rates):
    cfg = config(f"train.features={features}")
    p = plan_run(cfg, rates, budget_minutes=5, fixed=(), active=ACTIVE)
    if p["warnings"]:  # the smallest run does not fit: it says so, and its numbers are still numbers
        assert any("does not fit" in w for w in p["warnings"])
        assert all(isinstance(v, int) and v >= 1 for v in p["sizes"].values())
    else:
        assert_consistent(cfg, p, rates)


def test_the_plan_never_asks_for_more_prompts_than_the_sources_hold():
    cfg = config()
    rates = Rates(capture_tok_s=40_000, train_step_s=0.05, decode_s={1: 0.01, 4: 0.012}, load_s=8)
    free = plan_run(cfg, rates, budget_minutes=60, active=ACTIVE)["sizes"]["data.num_prompts"]
    assert free > 500
    p = plan_run(cfg, rates, budget_minutes=60, active=ACTIVE, available_prompts=500)
    assert p["sizes"]["data.num_prompts"] == 500 and not p["warnings"]
    small = plan_run(cfg, rates, budget_minutes=60, active=ACTIVE, available_prompts=30)  # below the smallest run
    assert small["sizes"]["data.num_prompts"] == 30 and any("30 prompts" in w for w in small["warnings"])


def test_available_prompts_come_from_prepare_stats_of_the_same_sources(tmp_path):
    from dflashkit.sizing.session import available_prompts

    src = tmp_path / "chat.jsonl"
    cfg = load_config(None, [*BASE, f"data.sources=[{{path: {src}, name: chat}}]"])
    rd = RunDir(tmp_path / "run")
    assert available_prompts(cfg, rd) is None
    stats = {"sources": {"chat": {"path": str(src), "kept": 120, "read": 130}}}
    write(rd.root / "prepare" / "stats.json", json.dumps(stats))
    assert available_prompts(cfg, rd) == 120
    other = load_config(None, [*BASE, f"data.sources=[{{path: {tmp_path / 'other.jsonl'}, name: chat}}]"])
    assert available_prompts(other, rd) is None


@pytest.mark.parametrize("key, value", [("stages", {"prepare": 15.0, "capture": -3.0}), ("planned_s", -1.0),
                                        ("planned_s", math.nan), ("samples", math.inf), ("epochs", -2.0)])
def test_check_plan_names_a_number_that_cannot_be(key, value):
    cfg = config()
    p = plan_run(cfg, Rates(**{**RATES, "decode_s": {1: 0.06, 4: 0.1}}), budget_minutes=20, active=ACTIVE)
    with pytest.raises(PlanError, match=key.rstrip("s") if key == "stages" else key):
        check_plan({**p, key: value})
    sizes = {**p["sizes"], "data.num_prompts": 0}
    with pytest.raises(PlanError, match="data.num_prompts"):
        check_plan({**p, "sizes": sizes})


def test_decode_times_below_a_smaller_size_are_raised_and_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="dflashkit.sizing"):
        out = calib.monotone_steps({1: 0.0559, 2: 0.0361, 4: 0.06})
    assert out == {1: 0.0559, 2: 0.0559, 4: 0.06} and "unreliable" in caplog.text and "t(2)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflashkit.sizing"):
        assert calib.monotone_steps({1: 0.05, 2: 0.049, 4: 0.06}) == {1: 0.05, 2: 0.05, 4: 0.06}  # noise: no warning
    assert "unreliable" not in caplog.text
