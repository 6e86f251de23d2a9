"""Progress a user can see for every long phase: a bar on a terminal, a line every ~15 s otherwise.

Usage:
    with Progress("capture", total=284_282, unit="tok") as p:
        for batch in batches:
            ...
            p.update(batch_tokens, loss=2.31)       # extra fields are shown beside the rate

On a terminal (stderr is a TTY) this is a tqdm bar: done/total, rate, elapsed and ETA. Otherwise
(`make demo > log 2>&1`, CI, a pipe) it logs one line every `interval` seconds (and a closing
line), so a log file shows the phase moving:
    capture: 61.2k/284k tok (21.5%), 880 tok/s, elapsed 1m10s, ETA 4m14s
    capture: done, 284k tok in 5m23s (880 tok/s)
Rate = units done since the start of this process's work / seconds (units skipped as already done
are `initial`, not counted in the rate); ETA = units left / rate.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

log = logging.getLogger("dflashkit.progress")

INTERVAL_S = 15.0
T = TypeVar("T")


def human(x: float) -> str:
    """12345 → '12.3k'."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.4g}" if isinstance(x, float) and not float(x).is_integer() else f"{int(x)}"


def duration(s: float) -> str:
    """Seconds → '1h02m', '4m14s', '9s'."""
    s = max(0, int(round(s)))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress:
    """A progress reporter (module docstring). `enabled=False` makes every method a no-op."""

    def __init__(self, desc: str, total: float | None = None, *, unit: str = "it", initial: float = 0,
                 interval: float = INTERVAL_S, enabled: bool = True, stream: TextIO | None = None,
                 tty: bool | None = None, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None):
        self.desc, self.total, self.unit = desc, total, unit
        self.n = self.initial = initial
        self.interval, self.enabled, self.clock = interval, enabled, clock
        self.log = logger or log
        self.extra: dict[str, Any] = {}
        self.t0 = self.last = clock()
        self.bar = None
        stream = stream or sys.stderr
        if enabled and (tty if tty is not None else bool(getattr(stream, "isatty", lambda: False)())):
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=stream, dynamic_ncols=True,
                            unit_scale=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close(ok=exc[0] is None)

    def rate(self) -> float:
        dt = self.clock() - self.t0
        return (self.n - self.initial) / dt if dt > 0 else 0.0

    def line(self) -> str:
        """The non-TTY progress line for the state now."""
        rate = self.rate()
        done = f"{human(self.n)}/{human(self.total)} {self.unit}" if self.total else f"{human(self.n)} {self.unit}"
        pct = f" ({100 * self.n / self.total:.1f}%)" if self.total else ""
        eta = ""
        if self.total and rate > 0:
            eta = f", ETA {duration(max(0.0, self.total - self.n) / rate)}"
        extra = "".join(f", {k} {_fmt(v)}" for k, v in self.extra.items())
        return (f"{self.desc}: {done}{pct}, {human(rate)} {self.unit}/s, elapsed "
                f"{duration(self.clock() - self.t0)}{eta}{extra}")

    def update(self, n: float = 1, **extra: Any) -> None:
        """`n` more units done; `extra` fields (loss=…, tau=…) are shown beside the rate."""
        if not self.enabled:
            return
        self.n += n
        if extra:
            self.extra.update(extra)
        if self.bar is not None:
            self.bar.update(n)
            if extra:
                self.bar.set_postfix({k: _fmt(v) for k, v in self.extra.items()}, refresh=False)
            return
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self.log.info("%s", self.line())

    def track(self, items: Iterable[T], size: Callable[[T], float] = lambda _: 1, *, close: bool = False) -> Iterator[T]:
        """Yield `items`, counting `size(item)` units for each once it has been produced (`close`: close the
        progress when they run out)."""
        for item in items:
            self.update(size(item))
            yield item
        if close:
            self.close()

    def set(self, n: float, **extra: Any) -> None:
        """Set the absolute count (e.g. the step just finished)."""
        self.update(n - self.n, **extra)

    def close(self, ok: bool = True) -> None:
        if not self.enabled:
            return
        self.enabled = False
        if self.bar is not None:
            self.bar.close()
            return
        if ok and self.n > self.initial:
            dt = self.clock() - self.t0
            self.log.info("%s: done, %s %s in %s (%s %s/s)", self.desc, human(self.n), self.unit, duration(dt),
                          human(self.rate()), self.unit)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
