"""The draft-length policy (decode/draft_length.py): the k it picks maximises E(k) / cost(k), by a slow oracle."""

from __future__ import annotations

import itertools
import random

from dflashkit.decode.draft_length import DraftLength


def _oracle(conf, factors, draft_s, cost):
    """Brute force over k: E(k) by the product rule written out, the best rate, ties to the shorter k."""
    best, best_rate = None, None
    for k in range(len(conf) + 1):
        e = 1.0
        for j in range(1, k + 1):
            prod = 1.0
            for i in range(j):
                prod *= min(1.0, conf[i] * factors[i])
            e += prod
        rate = e / (draft_s + cost[k + 1])
        if best_rate is None or rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


def test_choose_matches_the_oracle_on_random_tables():
    rng = random.Random(0)
    for _ in range(300):
        B = rng.choice([2, 4, 8])
        p = DraftLength(max_drafts=B - 1)
        t1 = rng.uniform(0.01, 0.05)
        p.calibrate({n: t1 * (1 + rng.uniform(0, 0.3) * (n - 1)) for n in range(1, B + 1)})
        p.observe_draft(rng.uniform(0, 0.01))
        for _ in range(rng.randrange(0, 20)):  # some calibration history
            conf = [rng.random() for _ in range(B - 1)]
            p.observe(conf, rng.randrange(0, B))
        conf = [rng.random() for _ in range(B - 1)]
        factors = [p.factor(i) for i in range(B - 1)]
        assert p.choose(conf) == _oracle(conf, factors, p.draft_s, p.cost)


def test_cheap_verify_takes_every_draft_and_dear_verify_of_doubtful_drafts_takes_none():
    p = DraftLength(max_drafts=3)
    p.calibrate({1: 0.04, 4: 0.04})            # a 4-token step costs what a 1-token step does
    assert p.choose([0.2, 0.1, 0.05]) == 3
    p.calibrate({1: 0.04, 4: 0.12})            # 3x: only sure drafts pay
    assert p.choose([0.05, 0.05, 0.05]) == 0
    assert p.choose([0.99, 0.99, 0.99]) == 3
    assert DraftLength(max_drafts=3).choose([0.0, 0.0, 0.0]) == 3   # no cost table: fixed B


def test_calibration_learns_an_overconfident_drafter():
    p = DraftLength(max_drafts=2, prior_steps=1.0)
    for step in range(400):  # confidence 0.8 at both positions, but only every other first draft is accepted
        p.observe([0.8, 0.8], 1 if step % 2 == 0 else 0)
    assert abs(p.factor(0) - 0.5 / 0.8) < 0.01
    # position 2 was verified only after an accepted first draft, and then always rejected
    assert p.factor(1) < 0.02


def test_interpolated_cost_table():
    p = DraftLength(max_drafts=3)
    p.calibrate({1: 1.0, 4: 4.0})
    assert [p.cost[n] for n in range(1, 5)] == [1.0, 2.0, 3.0, 4.0]
    assert list(itertools.islice(p.expected([1.0, 1.0, 1.0]), 4)) == [1.0, 2.0, 3.0, 4.0]


def test_observed_steps_move_the_whole_table_and_keep_its_ratios():
    p = DraftLength(max_drafts=3)
    p.calibrate({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.5})
    for _ in range(200):  # the context grows: only 1-token steps are run, each twice the calibrated cost
        p.observe_cost(1, 2.0)
    assert abs(p.cost[1] - 2.0) < 1e-6
    for n, t in {2: 1.1, 3: 1.2, 4: 1.5}.items():  # the sizes never run follow the level
        assert abs(p.cost[n] / p.cost[1] - t) < 1e-9
    p.observe_cost(7, 9.0)                       # a size outside the table changes nothing
    assert abs(p.cost[1] - 2.0) < 1e-6
