"""The budget arithmetic (`sizing/plan.py`): invariants over budgets, machines and fixed keys, never one number."""

from __future__ import annotations

import pytest

from dflashkit.config import load_config
from dflashkit.sizing import plan as sp
from dflashkit.sizing.plan import EPOCHS, SIZED, Rates, plan_run, replan_eval, replan_train

ACTIVE = ["probe", "prepare", "tokenize", "capture", "train", "eval", "export", "report"]
MACHINES = {  # a quick CPU, a slow one (emulated bf16), a GPU-like one
    "fast": Rates(capture_tok_s=665, train_step_s=0.35, decode_s={1: 0.06, 2: 0.08, 4: 0.1}, load_s=3, calibrate_s=25),
    "slow": Rates(capture_tok_s=170, train_step_s=1.2, decode_s={1: 0.14, 4: 0.28}, load_s=4, calibrate_s=40),
    "gpu": Rates(capture_tok_s=40_000, train_step_s=0.05, decode_s={1: 0.01, 2: 0.011, 4: 0.012}, load_s=8),
}
BASE = ["train.features=cached", "data.heldout=24", "train.batch_size=8", "train.heldout_samples=36", "train.num_anchors=16",
        "drafter.block_size=4", "eval.block_sizes=[2,4]", "tokenize.max_length=512", "eval.warmup=1"]


def cfg_and_fixed(*overrides: str):
    from dflashkit.config import given_keys

    cfg = load_config(None, [*BASE, *overrides])
    return cfg, frozenset(given_keys(cfg) or ())


def plan(cfg, fixed, rates, minutes):
    return plan_run(cfg, rates, budget_minutes=minutes, fixed=fixed, active=ACTIVE)


def epochs(cfg, p) -> float:
    train_samples = p["samples"] - cfg.train.heldout_samples
    return p["sizes"]["train.max_steps"] * cfg.train.batch_size / train_samples


@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("minutes", [6, 20, 60, 600])
def test_the_plan_fits_the_budget_and_caps_the_epochs(machine, minutes):
    cfg, fixed = cfg_and_fixed()
    p = plan(cfg, fixed, MACHINES[machine], minutes)
    assert not p["warnings"], p["warnings"]
    assert p["planned_s"] <= minutes * 60 * sp.SAFETY + 1e-6
    assert abs(sum(p["stages"].values()) - p["planned_s"]) < 1.0
    assert epochs(cfg, p) <= EPOCHS * 1.01  # (p["samples"] is rounded)
    assert set(p["sizes"]) == set(SIZED) and all(v >= 1 for v in p["sizes"].values())
    assert p["stages"]["eval"] <= max(sp.EVAL_SHARE * minutes * 60, sp.eval_s(cfg, MACHINES[machine], 1, 16)) + 1e-6
    steps, every = p["sizes"]["train.max_steps"], p["sizes"]["train.eval_every"]
    points = steps // every + (1 if steps % every else 0)  # and one at the end
    assert min(4, steps) <= points <= sp.CURVE_POINTS + 1  # the forecast's 4; the cost counts CURVE_POINTS + 1


@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("fix", [(), ("train.features=online",), ("data.num_prompts=300",), ("train.max_steps=200",), ("eval.num_prompts=4",),
                                 ("eval.max_new_tokens=64",)])
def test_more_budget_never_buys_less(machine, fix):
    cfg, fixed = cfg_and_fixed(*fix)
    prev = None
    for minutes in [4, 5, 6, 8, 10, 12.5, 15, 20, 25, 30, 45, 60, 90, 120, 240]:
        s = plan(cfg, fixed, MACHINES[machine], minutes)["sizes"]
        if prev is not None:
            for key in ("data.num_prompts", "train.max_steps", "eval.num_prompts", "eval.max_new_tokens"):
                assert s[key] >= prev[key], (minutes, key, s, prev)
        prev = s


def test_keys_the_user_set_are_kept_and_named():
    cfg, fixed = cfg_and_fixed("data.num_prompts=300", "train.max_steps=123", "train.eval_every=7",
                               "eval.num_prompts=2", "eval.max_new_tokens=40")
    for minutes in (5, 20, 200):
        p = plan(cfg, fixed, MACHINES["fast"], minutes)
        assert p["sizes"] == {"data.num_prompts": 300, "train.max_steps": 123, "train.eval_every": 7,
                              "train.save_every": sp.cadence(123), "eval.num_prompts": 2, "eval.max_new_tokens": 40}
        assert p["fixed"] == ["data.num_prompts", "train.max_steps", "train.eval_every", "eval.num_prompts",
                              "eval.max_new_tokens"]
    # fixed prompts: the steps fill the time, up to the epoch cap
    cfg, fixed = cfg_and_fixed("data.num_prompts=300")
    p = plan(cfg, fixed, MACHINES["fast"], 600)
    assert p["sizes"]["data.num_prompts"] == 300 and abs(epochs(cfg, p) - EPOCHS) < 0.1
    # fixed steps: no more data than one epoch of them
    cfg, fixed = cfg_and_fixed("train.max_steps=50")
    p = plan(cfg, fixed, MACHINES["gpu"], 600)
    assert p["sizes"]["train.max_steps"] == 50 and epochs(cfg, p) >= 1.0 - 0.05


def test_a_budget_too_small_for_the_smallest_run_says_so():
    cfg, fixed = cfg_and_fixed()
    p = plan(cfg, fixed, MACHINES["slow"], 1)
    assert p["warnings"] and "does not fit" in p["warnings"][-1]
    assert p["sizes"]["data.num_prompts"] >= cfg.data.heldout and p["sizes"]["train.max_steps"] >= 1


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_replan_train_uses_the_time_left(machine):
    cfg, fixed = cfg_and_fixed()
    rates = MACHINES[machine]
    p = plan(cfg, fixed, rates, 20)
    cap = int(EPOCHS * 500 / cfg.train.batch_size)
    steps = [replan_train(p, rates, cfg, fixed, train_samples=500, elapsed_s=e)["sizes"]["train.max_steps"]
             for e in (0, 200, 400, 600, 800, 1000, 1200, 2000)]
    assert steps == sorted(steps, reverse=True)  # later → never more steps
    assert all(1 <= s <= cap for s in steps) and steps[-1] == 1
    r = replan_train(p, rates, cfg, fixed, train_samples=500, elapsed_s=600)
    if 1 < r["sizes"]["train.max_steps"] < cap:  # the time, not the epochs, bounds it: it ends before eval's share
        end = 600 + r["planned_s"] + sum(p["stages"][s] for s in ("eval", "export", "report"))
        assert end <= p["usable_s"] + 0.1
    slower = replan_train(p, rates, cfg, fixed, train_samples=500, elapsed_s=600, slowdown=2.0)
    assert slower["sizes"]["train.max_steps"] <= r["sizes"]["train.max_steps"]
    assert replan_train(p, rates, cfg, fixed, train_samples=10**6, elapsed_s=0)["sizes"]["train.max_steps"] < 10**6
    fixed_cfg, fx = cfg_and_fixed("train.max_steps=77")
    assert replan_train(p, rates, fixed_cfg, fx, train_samples=500, elapsed_s=1e6)["sizes"]["train.max_steps"] == 77


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_replan_eval_uses_the_time_left_within_its_bound(machine):
    cfg, fixed = cfg_and_fixed("data.heldout=200")
    rates = MACHINES[machine]
    p = plan(cfg, fixed, rates, 20)
    prev = None
    for e in (1200, 1000, 900, 800, 600, 0):  # earlier → never fewer prompts
        r = replan_eval(p, rates, cfg, fixed, elapsed_s=e)
        k = r["sizes"]["eval.num_prompts"]
        assert r["planned_s"] <= max(sp.EVAL_MAX_SHARE * p["budget_s"], sp.eval_s(cfg, rates, 1, sp.MIN_NEW_TOKENS))
        if k > 1:
            assert e + r["planned_s"] <= p["usable_s"] - p["stages"]["export"] - p["stages"]["report"] + 1e-6
        if prev is not None:
            assert k >= prev
        prev = k
    assert replan_eval(p, rates, cfg, fixed, elapsed_s=1e6)["sizes"]["eval.num_prompts"] == 1


def test_eval_prompts_never_exceed_the_held_out_prompts():
    cfg, fixed = cfg_and_fixed("data.heldout=5")
    assert plan(cfg, fixed, MACHINES["gpu"], 600)["sizes"]["eval.num_prompts"] == 5


def test_the_cadence_gives_the_forecast_its_points_and_no_more():
    for steps in range(1, 3000):
        every = sp.cadence(steps)
        points = steps // every + (1 if steps % every else 0)
        assert min(4, steps) <= points <= sp.CURVE_POINTS + 1, steps


def test_decode_times_interpolate_between_measured_block_sizes():
    r = Rates(capture_tok_s=1, train_step_s=1, decode_s={1: 0.1, 4: 0.4, 8: 0.5})
    assert r.t(1) == 0.1 and r.t(4) == 0.4 and r.t(2) == pytest.approx(0.2) and r.t(6) == pytest.approx(0.45)
    assert r.t(16) == 0.5 and Rates(1, 1, {2: 0.3}).t(1) == 0.3
