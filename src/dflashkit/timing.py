"""The fastest of a few calls, synchronised: how every step time in dflashkit is read (the decoder's own t(n)
for the adaptive draft length, calibration, the step costs and benchmarks).

Usage:
    s = seconds(fn, device)                                   # one call, synchronised
    t = fastest(fn, device, reps=5)                           # the fastest of 5 calls after a warm-up
    ts = fastest_each({1: step1, 4: step4}, device, reps=5)   # several sizes timed interleaved: {1: …, 4: …}
    m = median_time(fn, device, iters=5)                      # the median of 5 calls (the caller warms up)

Sizes compared with each other (t(1) against t(B)) are timed by `fastest_each`: every one warmed up, then in
turns, so a cold start, a clock ramp or another job's burst falls on all of them alike instead of on the first
one timed. It sits below every room because the decoder, not only the measuring code, reads it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable, Mapping, TypeVar

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of `fn`, synchronised on CUDA before and after."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def fastest(fn: Callable[[], object], device: torch.device, reps: int, *, warmup: int = 1,
            after: Callable[[], object] | None = None) -> float:
    """Seconds of the fastest of `reps` calls of `fn` after `warmup` untimed ones, synchronised on CUDA; `after`
    (untimed) runs after every call (e.g. a cache rollback)."""
    best = float("inf")
    for i in range(warmup + reps):
        dt = seconds(fn, device)
        if i >= warmup:
            best = min(best, dt)
        if after is not None:
            after()
    return best


K = TypeVar("K", bound=Hashable)


def fastest_each(fns: Mapping[K, Callable[[], object]], device: torch.device, reps: int, *, warmup: int = 1,
                 after: Mapping[K, Callable[[], object]] | None = None,
                 clock: Callable[[], float] | None = None) -> dict[K, float]:
    """Seconds of the fastest of `reps` calls of each fn in `fns`, timed interleaved: `warmup` untimed rounds over
    every fn first, then `reps` rounds that call every fn once each, the order rotated by one per round (so no fn
    is always first after another). `after[k]` (untimed) runs after every call of `fns[k]`; `clock` (default:
    perf_counter after a CUDA synchronise on `device`) reads the time before and after each call."""
    keys = list(fns)
    if not keys:
        return {}

    def now() -> float:
        _sync(device)
        return time.perf_counter()

    tick = clock or now
    best = {k: float("inf") for k in keys}
    for r in range(warmup + max(1, reps)):
        shift = r % len(keys)
        for k in keys[shift:] + keys[:shift]:
            t0 = tick()
            fns[k]()
            dt = tick() - t0
            if r >= warmup:
                best[k] = min(best[k], dt)
            if after is not None and k in after:
                after[k]()
    return best


def median_time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Seconds of the median of `iters` calls of `fn` (no warm-up: the caller warms up), synchronised on CUDA."""
    return statistics.median(seconds(fn, device) for _ in range(iters))
