"""Stubs that installed commands run: a fault-injecting server, a random drafter, a perfect proposer.

Usage:
    with FaultServer(Faults(rates={"500": 0.1})) as srv: srv.url     # canned answers, injected faults
    drafter = random_drafter(target, block_size=4)                     # a real, random drafter for `target`
    SpecDecoder(target, None, 4, proposer=CopyTargetProposer(target))  # τ = B on every full step

    faults.py      FaultServer: stays installed because `dflashkit bench generate` serves from it
    drafters.py    random_drafter: stays installed because `dflashkit gpu-check` drafts with it
    proposers.py   CopyTargetProposer: stays installed because `dflashkit gpu-check` verifies with it
The tests use these too; gear only the tests use lives in the repository's tests/harness/. Tiny targets are
built by `dflashkit.target.tiny` (`python -m dflashkit.target.tiny DIR [ARCH]`). Importing this package is
cheap: torch and transformers load inside the functions; the server is imported from `dflashkit.testing.faults`
(not re-exported, so `python -m dflashkit.testing.faults` runs a module not yet imported).
"""

from __future__ import annotations

from dflashkit.testing.drafters import random_drafter  # noqa: F401
from dflashkit.testing.proposers import CopyTargetProposer  # noqa: F401
