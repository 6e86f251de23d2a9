"""SIGTERM during training: finish the step, checkpoint at its boundary, exit 143 — on every rank at once.

Usage (what `loop._fit` does):
    with StopOnSignal(dist) as stop:
        for step in range(start, steps):
            ...train, evaluate, save as usual...
            if stop.agreed(n):                     # one all-reduce of a flag per step (ranks agree)
                save the checkpoint of step n unless it was just saved
                stop.exit(n, where)                # logs where a re-run resumes, raises SystemExit(143)

The first SIGTERM a process receives only sets a flag (and puts the previous handler back, so a second
SIGTERM acts at once: the CLI's, which exits 143 immediately). At every step boundary the ranks
all-reduce their flags, so when any rank was signalled (torchrun forwards a SIGTERM to every worker,
a scheduler may signal one) all of them stop after the same step, write that step's checkpoint
together and exit 143; a re-run resumes from it exactly as from a periodic checkpoint. A signal that
arrives during the last step or after it lets training finish (its final evaluation and train/final)
and then exits 143.

`STEP_HOOKS` are called after each step, before the ranks agree (`hook(step, stop)`); tests use them
to deliver a signal at a chosen step (tests/harness/sigterm.py `sigterm_after_step`).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dflashkit.train.parallel import all_reduce_sum

if TYPE_CHECKING:
    from dflashkit.train.parallel import DistInfo

log = logging.getLogger("dflashkit.train")

STEP_HOOKS: list[Callable[[int, "StopOnSignal"], None]] = []


class StopOnSignal:
    """The SIGTERM flag of one training run (see the module docstring)."""

    def __init__(self, dist: DistInfo):
        self.dist = dist
        self.signum: int | None = None  # set by the handler of this process
        self._previous: Any = None
        self._installed = False

    def install(self) -> StopOnSignal:
        """Catch SIGTERM from now on (main thread only: signal handlers live there)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        return self

    def restore(self) -> None:
        """Put the previous SIGTERM handler back (if ours is still the one installed)."""
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, self._previous)
        self._installed = False

    def __enter__(self) -> StopOnSignal:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signum = signum
        signal.signal(signum, self._previous if self._previous is not None else signal.SIG_DFL)
        log.warning("SIGTERM: stopping at the end of this step with a checkpoint (a second SIGTERM exits at once)")

    def agreed(self, step: int) -> bool:
        """After step `step`: run the hooks, then whether any rank was signalled (all ranks get the same answer)."""
        for hook in STEP_HOOKS:
            hook(step, self)
        flag = 1.0 if self.signum is not None else 0.0
        if self.dist.world > 1:
            import torch

            flag = float(all_reduce_sum(torch.tensor([flag], dtype=torch.float64), self.dist)[0])
        return flag > 0

    def exit(self, step: int, checkpoint: Path | None, *, finished: bool = False) -> None:
        """Log what was kept and where a re-run resumes, then raise SystemExit(143)."""
        if self.dist.is_main:
            if finished:
                log.warning("train: terminated by SIGTERM after training finished (step %d): train/final is "
                            "written; a re-run of the same command completes at once", step)
            else:
                log.warning("train: terminated by SIGTERM after step %d; checkpoint %s written: re-run the same "
                            "command to resume from step %d", step, checkpoint, step)
        raise SystemExit(128 + int(signal.SIGTERM))
