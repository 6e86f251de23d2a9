"""Test gear: tiny targets, random drafters, our server on a free port, a fault-injecting server, proposer stubs.

Usage:
    make_tiny_target("/tmp/t", arch="qwen3")                  # Qwen3ForCausalLM + byte tokenizer
    python -m dflashkit.testing /tmp/t qwen3
    with serving({"target": {"path": "/tmp/t"}}) as (app, url): ...   # our `serve` on 127.0.0.1
    with FaultServer(Faults(rates={"500": 0.1})) as srv: srv.url     # canned answers, injected faults
    SpecDecoder(target, None, 4, proposer=CopyTargetProposer(target))  # τ = B on every full step

    drafters.py    random_drafter: a small random drafter that fits a loaded target
    servers.py     serving (our `serve` app in a thread), penalty_serving (a server with its own defaults)
    faults.py      FaultServer: a fast, fault-injecting OpenAI-compatible server (tests, `bench generate`)
    proposers.py   CopyTargetProposer, AdversarialProposer: proposer stubs for the speculative decoder
Tiny targets are built by `dflashkit.model.tiny` (re-exported here). Importing this package is cheap:
torch and transformers load inside the functions.
"""

from __future__ import annotations

from dflashkit.model.tiny import (  # noqa: F401
    CHATML_TEMPLATE,
    SPECIALS,
    TINY_VOCAB,
    make_byte_tokenizer,
    make_tiny_target,
    tiny_config,
)
from dflashkit.testing.drafters import random_drafter  # noqa: F401
from dflashkit.testing.faults import FaultServer, Faults, canned_answer  # noqa: F401
from dflashkit.testing.proposers import AdversarialProposer, CopyTargetProposer  # noqa: F401
from dflashkit.testing.servers import penalty_serving, serving  # noqa: F401
