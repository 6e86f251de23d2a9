"""`python -m tests.harness.slow_teardown ARGS...`: `python -m dflashkit ARGS...` with one rank slow to leave.

Usage (a test's torchrun):
    DFLASHKIT_TEST_SLOW_TEARDOWN=1:3 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m tests.harness.slow_teardown train --json ...      # the repo root on PYTHONPATH

`RANK:SECONDS` makes that rank sleep SECONDS before it leaves the process group
(`train.parallel.leave_distributed`), so the other rank reaches teardown, and exits, first. Only
this test gear reads the variable; the library never does.
"""

from __future__ import annotations

import os
import time

from dflashkit.train import parallel


def _slowed(leave):
    spec = os.environ.get("DFLASHKIT_TEST_SLOW_TEARDOWN", "")
    rank, _, seconds = spec.partition(":")

    def leave_late(*args, **kwargs):
        if rank and int(os.environ.get("RANK", "0")) == int(rank):
            time.sleep(float(seconds or 0))
        return leave(*args, **kwargs)

    return leave_late


if __name__ == "__main__":
    parallel.leave_distributed = _slowed(parallel.leave_distributed)
    from dflashkit.__main__ import run_as_main

    run_as_main()
