"""Test gear only the tests use (none of it is installed with dflashkit); `python -m pytest` from the repo root
puts it on the path as `tests.harness`.

    servers.py        serving (our `serve` app in a thread), penalty_serving (a server with its own defaults)
    hybrid.py         tiny hybrid targets (`python -m tests.harness.hybrid DIR qwen3_next`)
    fake_engine.py    FakeHiddenStatesEngine: a stand-in for vLLM's hidden-states connector
    proposers.py      AdversarialProposer: the worst possible drafter (τ = 1)
    sigterm.py        sigterm_after_step: a training fault at a chosen step
    slow_teardown.py  `python -m tests.harness.slow_teardown ARGS…`: `dflashkit ARGS…` with one rank slow to leave
    vllm_pieces.py    vLLM's own DFlash2 / LiLiCorr modules on an export's weights (the engine tests), through
                      vllm_dflash2_reference.py and vllm_lilicorr_reference.py, run by the engine venv's python
What installed commands run (FaultServer, random_drafter, CopyTargetProposer) stays in `dflashkit.testing`.
"""
