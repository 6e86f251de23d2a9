"""`python -m tests.harness.slow_teardown ARGS...`: `python -m dflashkit ARGS...` with one rank slow to leave.

Usage (a test's torchrun):
    DFLASHKIT_TEST_SLOW_TEARDOWN=1:3 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m tests.harness.slow_teardown train --json ...      # the repo root on PYTHONPATH

`RANK:SECONDS` makes that rank sleep SECONDS before it leaves the process group
(`train.parallel.leave_distributed`), so the other rank reaches teardown, and exits, first.
`DFLASHKIT_TEST_STALLED_DESTROY=RANK` makes `destroy_process_group` never return on that rank (the
stall gloo shows once in a few hundred runs), with `parallel.TEARDOWN_S` cut to 3 s. Only this test
gear reads the variables; the library never does.
"""

from __future__ import annotations

import os
import time

import torch

from dflashkit.train import parallel


def _slowed(leave):
    spec = os.environ.get("DFLASHKIT_TEST_SLOW_TEARDOWN", "")
    rank, _, seconds = spec.partition(":")

    def leave_late(*args, **kwargs):
        if rank and int(os.environ.get("RANK", "0")) == int(rank):
            time.sleep(float(seconds or 0))
        return leave(*args, **kwargs)

    return leave_late


def _stall_destroy() -> None:
    stalled = os.environ.get("DFLASHKIT_TEST_STALLED_DESTROY", "")
    if stalled and int(os.environ.get("RANK", "0")) == int(stalled):
        parallel.TEARDOWN_S = 3.0

        def destroy_forever(*args, **kwargs):
            while True:
                time.sleep(60)

        torch.distributed.destroy_process_group = destroy_forever


if __name__ == "__main__":
    parallel.leave_distributed = _slowed(parallel.leave_distributed)
    _stall_destroy()
    from dflashkit.__main__ import run_as_main

    run_as_main()
