"""One training setup: `train.loop.preflight` runs once per `train`, reads the contract and the resume point once,
and `setup` builds from what it returns (nothing read or checked twice)."""

from __future__ import annotations

import json

from dflashkit.cli import main
from dflashkit.family.contract import DrafterContract
from dflashkit.train import checkpoint as ckpt, guards, loop
from tests.helpers import make_run, overrides


def _counting(monkeypatch):
    """Counters of `DrafterContract.load` and `checkpoint.checkpoint_state` calls, of `preflight` runs and of
    the contract and resume checks (each still does its work)."""
    calls = {"contract": 0, "state": 0}
    real_load, real_state = DrafterContract.load.__func__, ckpt.checkpoint_state
    for mod, name in ((loop, "preflight"), (guards, "check_drafter_overrides"), (guards, "check_objective"),
                      (guards, "check_trajectory")):
        calls[name] = 0

        def counted(*a, _real=getattr(mod, name), _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, counted)

    def load(cls, path):
        calls["contract"] += 1
        return real_load(cls, path)

    def state(path):
        calls["state"] += 1
        return real_state(path)

    monkeypatch.setattr(DrafterContract, "load", classmethod(load))
    monkeypatch.setattr(ckpt, "checkpoint_state", state)
    return calls


def test_one_train_run_loads_the_contract_once_and_resumes_from_the_checked_checkpoint(tmp_path, tiny_qwen3,
                                                                                      monkeypatch, capsys):
    rd = tmp_path / "run"
    make_run(rd, tiny_qwen3)
    calls = _counting(monkeypatch)
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=2, train__save_every=2)]) == 0
    assert calls == {"contract": 1, "state": 0, "preflight": 1, "check_drafter_overrides": 1,  # from scratch:
                     "check_objective": 0, "check_trajectory": 0}                             # no checkpoint
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["steps"] == 2

    calls.update(dict.fromkeys(calls, 0))  # more steps continue the run from its step-2 checkpoint
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=3, train__save_every=2)]) == 0
    assert calls == {"contract": 1, "state": 1, "preflight": 1, "check_drafter_overrides": 1, "check_objective": 1,
                     "check_trajectory": 1}  # checked once, by preflight, not again when the checkpoint loads
    rows = [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "split" not in r] == [1, 2, 3]  # resumed at step 2, not retrained
