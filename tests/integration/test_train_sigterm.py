"""SIGTERM during `train`: a checkpoint at the next step boundary, exit 143, and the resumed run ends at exactly
the weights of an uninterrupted one — in one process and under torchrun (2 gloo ranks, which agree on the
step). The signal is delivered at a chosen step by `tests.harness.sigterm.sigterm_after_step`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cli import main
from tests.harness.sigterm import sigterm_after_step
from tests.helpers import make_run, overrides

STEPS = 6


def _weights(rd):
    return load_file(str(rd / "train" / "final" / "model.safetensors"))


def _assert_equal_weights(a, b):
    assert a.keys() == b.keys()
    diff = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not diff, diff  # the same process, the same steps: bit-identical


def _steps(rd):
    return sorted(int(p.name.split("-")[1]) for p in (rd / "train" / "checkpoints").glob("step-*"))


def test_sigterm_checkpoints_at_the_next_step_and_resumes_bit_identically(tmp_path, tiny_qwen3, capsys):
    ov = dict(train__max_steps=STEPS, train__save_every=4, train__eval_every=2, train__keep_checkpoints=0)
    whole, cut = make_run(tmp_path / "whole", tiny_qwen3), make_run(tmp_path / "cut", tiny_qwen3)
    assert main(["train", "--json", *overrides(whole, tiny_qwen3, **ov)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    handler = signal.getsignal(signal.SIGTERM)
    remove = sigterm_after_step(3)
    try:
        rc = main(["train", "--json", *overrides(cut, tiny_qwen3, **ov)])
    finally:
        remove()
    out, err = capsys.readouterr()
    assert rc == 143, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 143
    assert _steps(cut) == [3], "the checkpoint of the step the signal ended (no periodic one was due yet)"
    assert "terminated by SIGTERM after step 3" in err and "resume from step 3" in err, err
    assert "train: done" not in err and not (cut / "train" / "final").exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # training's handler and the CLI's are both gone
    assert main(["train", "--json", *overrides(cut, tiny_qwen3, **ov)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["resumed_from"] == 3, err
    _assert_equal_weights(_weights(whole), _weights(cut))
    a, b = (json.loads((rd / "train" / "curve.json").read_text()) for rd in (whole, cut))
    assert [p["step"] for p in a["points"]] == [p["step"] for p in b["points"]] == [2, 4, 6]
    assert [p["heldout"]["tau"] for p in a["points"]] == [p["heldout"]["tau"] for p in b["points"]]


def test_a_second_sigterm_exits_at_once(tmp_path, tiny_qwen3, capsys):
    from dflashkit.train.stopping import STEP_HOOKS

    rd = make_run(tmp_path / "run", tiny_qwen3)

    def twice(step, stop):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the first: stop at this step's end
            os.kill(os.getpid(), signal.SIGTERM)  # the second: at once, no checkpoint

    STEP_HOOKS.append(twice)
    try:
        rc = main(["train", *overrides(rd, tiny_qwen3, train__max_steps=STEPS, train__save_every=0)])
    finally:
        STEP_HOOKS.remove(twice)
    err = capsys.readouterr().err
    assert rc == 143, err[-3000:]
    assert not (rd / "train" / "checkpoints").exists() or _steps(rd) == [], _steps(rd)
    assert "train: done" not in err


SCRIPT = """
import sys
sys.path.insert(0, {root!r})  # the repo root: tests.harness
from tests.harness.sigterm import sigterm_after_step
sigterm_after_step({step}, rank=0, to_parent={to_parent})
from dflashkit.__main__ import run_as_main
run_as_main()  # as `python -m dflashkit`: a rank ends through exit_rank, never interpreter finalization
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}


def _torchrun(tmp_path, rd, target, script: str | None, **ov):
    entry = ["-m", "dflashkit"] if script is None else [script]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *entry,
           "train", "--json", *overrides(rd, target, train__batch_size=2, **ov)]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.distributed
def test_sigterm_under_torchrun_stops_every_rank_at_the_same_step_and_resumes_the_same(tmp_path, tiny_qwen3):
    """SIGTERM to torchrun's agent: it forwards the signal to both workers; the ranks agree on the step
    (an all-reduced flag), write its checkpoint together and exit 143; the resumed run equals an
    uninterrupted one."""
    ov = dict(train__max_steps=STEPS, train__save_every=0, train__parallel__mode="ddp")
    whole, cut = make_run(tmp_path / "whole", tiny_qwen3), make_run(tmp_path / "cut", tiny_qwen3)
    r = _torchrun(tmp_path, whole, tiny_qwen3, None, **ov)
    assert r.returncode == 0, r.stderr[-3000:]
    script = tmp_path / "sigterm_train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(step=3, to_parent=True, root=str(Path(__file__).resolve().parents[2]))))
    r = _torchrun(tmp_path, cut, tiny_qwen3, str(script), **ov)
    assert r.returncode != 0, r.stderr[-3000:]  # torchrun itself was terminated
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [x["exit_code"] for x in results] == [143, 143], r.stdout + r.stderr[-3000:]
    assert _steps(cut) == [3], (_steps(cut), r.stderr[-3000:])
    assert "terminated by SIGTERM after step 3" in r.stderr and "resume from step 3" in r.stderr
    r = _torchrun(tmp_path, cut, tiny_qwen3, None, **ov)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["resumed_from"] == 3
    _assert_equal_weights(_weights(whole), _weights(cut))


def test_train_nproc_per_node_forwards_sigterm_to_torchrun_and_waits(monkeypatch):
    """`dflashkit train --nproc-per-node N` is torchrun's parent: its SIGTERM (SystemExit 143 from the CLI's
    handler while it waits) goes on to torchrun, which forwards it to the ranks; it waits for them to checkpoint."""
    from dflashkit.train import parallel

    events = []

    class Proc:
        def __init__(self, cmd):
            self.waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits == 1:
                raise SystemExit(143)  # the signal arrives while the parent waits
            events.append(("waited", timeout))
            return 1

        def send_signal(self, sig):
            events.append(("signal", sig))

        def kill(self):  # pragma: no cover - only when torchrun does not stop in time
            events.append(("kill", None))

    monkeypatch.setattr(parallel.subprocess, "Popen", Proc)
    with pytest.raises(SystemExit) as e:
        parallel.relaunch_under_torchrun(2, ["train", "--nproc-per-node", "2"])
    assert e.value.code == 143 and events == [("signal", signal.SIGTERM), ("waited", 120)]
