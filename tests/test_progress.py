"""`dflashkit.progress`: without a terminal, a line with rate and ETA at the interval; a bar on a terminal."""

from __future__ import annotations

import io
import logging
import re

from dflashkit.progress import Progress, duration


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_without_a_terminal_it_logs_rate_and_eta_once_per_interval(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="dflashkit.progress")
    with Progress("capture", total=1000, unit="tok", interval=15, stream=io.StringIO(), clock=clock) as p:
        for _ in range(40):                     # 40 updates of 25 tokens, one every 2 s: 80 s in all
            clock.t += 2.0
            p.update(25, loss=1.5)
    lines = [r.getMessage() for r in caplog.records]
    progress, done = lines[:-1], lines[-1]
    # one line per 15 s (at 16, 32, 48, 64, 80 s), not one per update
    assert len(progress) == 5, lines
    first = progress[0]
    assert first.startswith("capture: 200/1k tok (20.0%)") and "12.5 tok/s" in first, first
    # ETA = (1000 - 200) / 12.5 = 64 s; elapsed 16 s
    assert "elapsed 16s" in first and "ETA 1m04s" in first and "loss 1.5" in first, first
    etas = [re.search(r"ETA ([^,]+)", x).group(1) for x in progress]
    assert etas == ["1m04s", "48s", "32s", "16s", "0s"]
    assert done == "capture: done, 1k tok in 1m20s (12.5 tok/s)", done


def test_the_rate_leaves_out_what_was_done_before_a_resume(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="dflashkit.progress")
    p = Progress("train", total=100, initial=60, unit="step", interval=10, stream=io.StringIO(), clock=clock)
    clock.t = 10.0
    p.set(70)                                     # 10 steps in 10 s: 1 step/s, 30 left
    assert "70/100 step (70.0%), 1 step/s" in caplog.records[-1].getMessage()
    assert "ETA 30s" in caplog.records[-1].getMessage()


def test_on_a_terminal_it_draws_a_bar_and_logs_nothing(caplog):
    from tqdm import tqdm

    caplog.set_level(logging.INFO, logger="dflashkit.progress")
    out = io.StringIO()
    with Progress("eval", total=10, unit="tok", stream=out, tty=True, interval=0) as p:
        p.update(10)
        assert isinstance(p.bar, tqdm)              # (drawn unless TQDM_DISABLE, which conftest sets)
    assert not caplog.records
    with Progress("off", total=10, enabled=False, stream=out, tty=False) as q:
        q.update(5)
    assert not caplog.records


def test_durations_read_naturally():
    assert [duration(s) for s in (9, 64, 3720)] == ["9s", "1m04s", "1h02m"]


def test_track_counts_what_it_yields_and_can_close_at_the_end(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="dflashkit.progress")
    p = Progress("capture", total=30, unit="tok", interval=1e9, stream=io.StringIO(), clock=clock)
    batches = [[1, 2], [3], [4, 5, 6]]
    clock.t = 6.0
    got = list(p.track(iter(batches), size=lambda b: 5 * len(b), close=True))
    assert got == batches and p.n == 30
    assert caplog.records[-1].getMessage() == "capture: done, 30 tok in 6s (5 tok/s)"
