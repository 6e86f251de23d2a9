"""Sizes compared with each other are timed alike: every size warmed up, then timed in turns (`fastest_each`), in
`step_times`, `SpecDecoder._calibrate` and the benches; `timing_flags` names a measurement that cannot be true.
Time here is a fake clock the fake steps advance: nothing is measured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflashkit import timing
from dflashkit.decode import spec_decode
from dflashkit.decode.draft_length import DraftLength
from dflashkit.decode.metrics import compare_flags, timing_flags
from dflashkit.sizing import step_cost
from dflashkit.timing import fastest_each


class Machine:
    """A fake clock and a step whose cost is n tokens × 1 s, except the first `slow` calls (a cold start, or
    another job's burst), which cost 100 s each."""

    def __init__(self, slow: int):
        self.now, self.calls, self.slow = 0.0, 0, slow

    def clock(self) -> float:
        return self.now

    def step(self, n: int) -> None:
        self.now += 100.0 if self.calls < self.slow else float(n)
        self.calls += 1


@pytest.mark.parametrize("slow", [0, 1, 3, 5])
def test_fastest_each_warms_every_size_and_times_them_in_turns(slow):
    m = Machine(slow)
    order: list[int] = []

    def step(n: int) -> None:
        order.append(n)
        m.step(n)

    rolled: list[int] = []
    t = fastest_each({n: (lambda n=n: step(n)) for n in (1, 2, 4)}, torch.device("cpu"), reps=4, warmup=2,
                     after={n: (lambda n=n: rolled.append(n)) for n in (1, 2, 4)}, clock=m.clock)
    assert t == {1: 1.0, 2: 2.0, 4: 4.0}  # no size pays for the slow start
    assert order[:6] == [1, 2, 4, 2, 4, 1] and len(order) == 3 * (2 + 4)  # warm-up rounds first, then turns
    assert rolled == order  # `after` follows each call of its own fn


def test_fastest_each_of_nothing():
    assert fastest_each({}, torch.device("cpu"), reps=3) == {}


def fake_target(m: Machine, context: int):
    def model(*, input_ids, use_cache, logits_to_keep=None, **cache):
        if input_ids.shape[1] != context:  # the prefill is not a timed step
            m.step(input_ids.shape[1])

    return SimpleNamespace(device=torch.device("cpu"), vocab_size=100, config=None, model=model)


def test_step_times_does_not_time_the_first_size_cold(monkeypatch):
    """The decode-step line once read t(1) 291 ms against t(2) 34 ms: n = 1 was timed while the machine was slow.
    Five slow calls outlast one size's warm-up and repetitions, not every size's in turns."""
    m = Machine(slow=5)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=m.clock))
    monkeypatch.setattr(step_cost, "decode_cache", lambda config, capacity: object())
    monkeypatch.setattr(step_cost, "arm", lambda cache, n: None)
    monkeypatch.setattr(step_cost, "rollback", lambda cache, n: None)
    monkeypatch.setattr(step_cost, "cache_kwarg", lambda model: "past_key_values")
    t = step_cost.step_times(fake_target(m, context=8), [1, 2, 4], context=8, reps=3, warmup=2)
    assert t == {1: 1.0, 2: 2.0, 4: 4.0}


def test_the_decoders_calibration_does_not_time_the_first_size_cold(monkeypatch):
    m = Machine(slow=3)
    monkeypatch.setattr(spec_decode, "DynamicCache", lambda config: SimpleNamespace(layers=[]))
    monkeypatch.setattr(spec_decode, "arm", lambda cache, n: None)
    monkeypatch.setattr(spec_decode, "rollback", lambda cache, n: None)
    dec = object.__new__(spec_decode.SpecDecoder)
    dec.target = SimpleNamespace(device=torch.device("cpu"), config=None)
    dec.block_size, dec.policy = 4, DraftLength(max_drafts=3)
    dec._now = m.clock

    def forward(ids, cache, last_only=False, start=None):
        if not last_only:  # the context's prefill is not timed
            m.step(ids.shape[1])

    dec._forward = forward
    dec._calibrate(list(range(20)))
    assert dec.policy.cost == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}


@pytest.mark.parametrize("kw, phrases", [
    ({"tau": 1.34, "speedup": 2.14, "bound": 1.5, "t1": 0.0559, "tb": 0.0361},
     ["above its tau 1.34", "above its bound 1.50", "t(B) 36.1 ms below t(1) 55.9 ms"]),
    ({"tau": 1.36, "speedup": 1.92}, ["above its tau"]),
    ({"tau": 2.0, "speedup": 1.5, "bound": 1.4, "t1": 0.04, "tb": 0.057}, ["above its bound"]),
    ({"t1": 0.291, "tb": 0.034}, ["below t(1)"]),
    ({"tau": 2.0, "speedup": 2.05, "bound": 2.0, "t1": 0.040, "tb": 0.0385}, []),   # within tolerance and noise
    ({"tau": 3.1, "speedup": 1.8, "bound": 2.6, "t1": 0.040, "tb": 0.048}, []),     # an honest win
    ({}, []),                                                                       # nothing measured
    ({"tau": float("nan"), "speedup": 1.2}, ["tau nan is not a finite number"]),
    ({"speedup": -1.0}, ["speedup -1.0 is not a finite number"]),
])
def test_timing_flags(kw, phrases):
    flags = timing_flags(**kw)
    assert len(flags) == len(phrases) and all(p in f for p, f in zip(phrases, flags)), flags


def test_compare_flags_reads_a_compare_result():
    cmp = {"speedup": 2.14, "bound": 1.9, "t1_s": 0.0559, "tB_s": 0.0361}
    assert len(compare_flags(cmp, 1.34)) == 3 and compare_flags({"speedup": 1.1, "bound": 1.2}, 1.3) == []
