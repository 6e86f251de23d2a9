"""A training fault for tests: SIGTERM at a chosen step (`train/stopping.py` STEP_HOOKS).

Usage:
    remove = sigterm_after_step(3)       # SIGTERM to this process after step 3 (rank 0)
    ...; remove()
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from dflashkit.train.stopping import STEP_HOOKS


def sigterm_after_step(step: int, *, rank: int = 0, to_parent: bool = False):
    """A training fault: after step `step`, the process of rank `rank` gets SIGTERM (`train/stopping.py`
    STEP_HOOKS), delivered before the ranks agree whether to stop, so the stop step is deterministic. With
    `to_parent` the signal goes to the parent instead (torchrun's agent, which forwards it to every worker)
    and the hook waits until this process has received its copy. Returns a function that removes the hook."""

    def hook(n: int, stop: Any) -> None:
        if n != step or int(os.environ.get("RANK", "0")) != rank:
            return
        os.kill(os.getppid() if to_parent else os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while stop.signum is None and time.monotonic() < deadline:  # the forwarded copy is asynchronous
            time.sleep(0.01)

    STEP_HOOKS.append(hook)
    return lambda: STEP_HOOKS.remove(hook)
