"""A family's metric names are declared by its objective (`Objective.metric_names`), and a step's record holds
its metrics to them: the names are not found by running the metrics on made-up statistics."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflashkit import family
from dflashkit.family.base import Objective, StatField
from dflashkit.train.stats import StepStats


def _stats(fam: family.Family) -> StepStats:
    st = StepStats.zeros(4, fam)
    st.blocks, st.tokens = 3.0, 12.0
    st.total += torch.tensor([0.0, 4, 4, 4], dtype=torch.float64)
    for f in fam.objective.stats:
        st.extra[f.name] = st.extra[f.name] + 1.0
    return st


def test_the_names_are_the_declared_ones_and_each_family_returns_them():
    for fam in family.BUILTIN:
        assert fam.metric_names == fam.objective.metric_names
        st = _stats(fam)
        assert tuple(fam.objective.metrics(st)) == fam.metric_names, fam.name
        assert set(fam.metric_names) <= set(st.metrics(1)) and set(fam.metric_names) <= set(st.heldout_row(1))


def test_metric_names_do_not_run_the_metrics():
    def metrics(stats):
        raise AssertionError("the metrics ran")

    fam = replace(family.DEFAULT, objective=Objective(stats=(StatField("seen"),), metrics=metrics,
                                                      metric_names=("seen_rate",)))
    assert fam.metric_names == ("seen_rate",)


def test_metrics_that_return_other_names_than_declared_are_refused():
    fam = replace(family.DEFAULT, title="Odd", objective=Objective(
        stats=(StatField("seen"),), metrics=lambda st: {"seen_rate": st.extra["seen"] / 2, "more": 0.0},
        metric_names=("seen_rate",)))
    with pytest.raises(ValueError, match=r"Odd's metrics returned \['seen_rate', 'more'\].*metric_names"):
        _stats(fam).metrics(1)
