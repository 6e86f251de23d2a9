"""The data-budget forecast (`sizing/forecast.py`) on synthetic learning curves with a known law."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dflashkit.sizing.forecast import MIN_POINTS, fit_power_law, forecast, forecast_from_curve


def law(n, tau_inf=3.0, a=40.0, b=0.3):
    return tau_inf - a * np.power(n, -b)


def true_tokens(target, tau_inf=3.0, a=40.0, b=0.3):
    return (a / (tau_inf - target)) ** (1 / b)


N = np.array([1, 2, 3, 4, 5, 6], dtype=float) * 2e4   # the target τ 2.0 lies beyond the last point


def test_a_noise_free_curve_recovers_the_law_and_the_tokens_for_the_target():
    assert law(N[-1]) < 2.0
    fit = fit_power_law(N, law(N))
    assert not isinstance(fit, str)
    assert fit.tau_inf == pytest.approx(3.0, abs=0.01) and fit.b == pytest.approx(0.3, rel=0.02)
    fc = forecast(N, law(N), 2.0)
    assert fc.warning is None or "beyond the last point" in fc.warning
    assert fc.tokens == pytest.approx(true_tokens(2.0), rel=0.03), (fc.tokens, true_tokens(2.0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_noisy_curve_predicts_within_tolerance_and_its_band_holds_the_truth(seed):
    n = np.linspace(1, 8, 8) * 2e4
    y = law(n) + np.random.default_rng(seed).normal(0, 0.004, n.size)
    fc = forecast(n, y, 2.0)
    truth = true_tokens(2.0)
    assert fc.tokens is not None, fc.warning
    assert fc.tokens == pytest.approx(truth, rel=0.25), (fc.tokens, truth)
    assert fc.tokens_low < fc.tokens < fc.tokens_high
    # the 1σ band is not degenerate and is centred on the estimate in log space
    assert math.log(fc.tokens_high / fc.tokens) == pytest.approx(math.log(fc.tokens / fc.tokens_low), rel=1e-6)


def test_too_few_points_give_a_warning_and_no_number():
    fc = forecast(N[:MIN_POINTS - 1], law(N[:MIN_POINTS - 1]), 2.0)
    assert fc.tokens is None and fc.samples is None and fc.hours is None
    assert "at least" in fc.warning and "no number" in fc.text()


def test_a_target_beyond_the_asymptote_gives_a_warning_and_no_number():
    fc = forecast(N, law(N), 3.2)
    assert fc.tokens is None and "asymptote" in fc.warning


def test_a_flat_or_falling_curve_gives_no_number():
    fc = forecast(N, law(N)[::-1], 2.0)
    assert fc.tokens is None and "does not rise" in fc.warning


def test_a_target_already_reached_is_the_first_measured_crossing():
    fc = forecast(N, law(N), float(law(N[2])) - 1e-9)
    assert fc.tokens == N[2] and fc.notes


def test_the_curve_file_gives_samples_and_hours_from_the_runs_own_rates():
    points = [{"step": i + 1, "tokens": float(n), "train_s": float(n) * 1e-3, "heldout": {"tau": float(t)},
               "by_source": {"code": {"tokens": float(n) / 2, "tau": float(t)}}}
              for i, (n, t) in enumerate(zip(N, law(N)))]
    curve = {"points": points, "supervised_per_sample": 250.0}
    fc = forecast_from_curve(curve, 2.0)
    assert fc.samples == pytest.approx(fc.tokens / 250.0)
    assert fc.hours == pytest.approx(fc.tokens * 1e-3 / 3600)
    # per source: that source's own tokens on the x axis (half of the total here)
    fs = forecast_from_curve(curve, 2.0, source="code")
    assert fs.tokens == pytest.approx(fc.tokens / 2, rel=0.02)
    # a rate at scale (plan) replaces the run's own
    assert forecast_from_curve(curve, 2.0, seconds_per_token=2e-3).hours == pytest.approx(2 * fc.hours)
