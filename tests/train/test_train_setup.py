"""The deterministic data plan (the run-dir helpers that lived here are in tests/helpers.py)."""

from __future__ import annotations

import numpy as np

from dflashkit.train.data import BatchPlan, split_heldout


def test_global_batch_same_for_any_world_size():
    idx, held = split_heldout(20, 4, seed=3)
    assert len(held) == 4 and not set(idx) & set(held)
    one = BatchPlan(idx, batch_size=4, grad_accum=1, world=1, seed=3)
    two = BatchPlan(idx, batch_size=2, grad_accum=1, world=2, seed=3)
    acc = BatchPlan(idx, batch_size=1, grad_accum=2, world=2, seed=3)
    for step in range(9):  # crosses epoch boundaries
        g1 = sorted(sum(one.micro_batches(step, 0), []))
        g2 = sorted(sum(two.micro_batches(step, 0) + two.micro_batches(step, 1), []))
        g3 = sorted(sum(acc.micro_batches(step, 0) + acc.micro_batches(step, 1), []))
        assert g1 == g2 == g3
    seen = [i for s in range(4) for m in one.micro_batches(s, 0) for i, e in m if e == 0]
    assert sorted(seen) == sorted(idx)  # one epoch = every training sample once
    assert np.unique([len(m) for m in one.micro_batches(0, 0)]).tolist() == [4]
