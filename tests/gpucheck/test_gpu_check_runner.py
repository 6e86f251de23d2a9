"""The GPU check's orchestration, on fake checks in child processes: every outcome is recorded (passed, failed,
raised, hung past its time box, crashed, skipped by the deadline), the rest still run, the summary and the log
are written, and the exit status names the failures. Also: the comparisons fail where they should."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dflashkit.gpucheck.compare import FLEX_FP32, RANKS, Tolerance, close_losses, close_tensors, close_weights
from dflashkit.gpucheck.runner import (CHECKS, DEADLINE_S, LOG, SUMMARY, CheckSpec, part, run_gpu_check, select,
                                       verdict)

FAKE_CHECKS = '''
import os, subprocess, sys, time
from dflashkit.gpucheck.runner import part, verdict

def ok(ctx):
    return verdict([part("a", True, max_rel=1.5e-7), part("b", None, "skipped: not on this machine")])

def bad(ctx):
    return verdict([part("a", True), part("b", False, "b differs", max_rel=0.2)])

def boom(ctx):
    raise ValueError("no such kernel")

def hang(ctx):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (ctx.work_dir / "grandchild.pid").write_text(str(child.pid))
    time.sleep(120)

def crash(ctx):
    os._exit(3)

def slow(ctx):
    time.sleep(1.0)
    return verdict([part("a", True)])
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture
def fake_checks(tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "fake_gpu_checks.py").write_text(textwrap.dedent(FAKE_CHECKS))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "mods") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return lambda name, box=30.0: CheckSpec(name, f"fake_gpu_checks:{name}", box, f"the {name} fake")


def test_every_outcome_is_recorded_and_the_rest_still_run(tmp_path, fake_checks):
    # hang's box leaves a loaded machine time to start its child and write the grandchild's pid before the kill
    specs = (fake_checks("ok"), fake_checks("bad"), fake_checks("boom"), fake_checks("hang", 3.0),
             fake_checks("crash"))
    out = tmp_path / "out"
    s = run_gpu_check(out, device="cpu", specs=specs, min_box_s=1.0, scratch=tmp_path / "scratch")
    checks = s["checks"]
    assert list(checks) == ["ok", "bad", "boom", "hang", "crash"]
    assert checks["ok"]["status"] == "passed" and [p["status"] for p in checks["ok"]["parts"]] == ["passed", "skipped"]
    assert checks["bad"]["status"] == "failed" and checks["bad"]["parts"][1]["max_rel"] == 0.2
    assert checks["boom"]["reason"] == "ValueError: no such kernel"
    assert "raise ValueError" in checks["boom"]["traceback"]
    assert "time box of 3 s" in checks["hang"]["reason"] and checks["hang"]["duration_s"] < 13
    grandchild = int((tmp_path / "scratch" / "hang" / "grandchild.pid").read_text())
    deadline = time.monotonic() + 30
    while _alive(grandchild) and time.monotonic() < deadline:  # the whole process group was killed
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert "exited 3 without a result" in checks["crash"]["reason"]
    assert all(r["duration_s"] >= 0 and r["time_box_s"] > 0 for r in checks.values())
    assert s["failed"] == ["bad", "boom", "hang", "crash"] and s["exit_code"] == 1 and s["ok"] is False
    on_disk = json.loads((out / SUMMARY).read_text())
    assert on_disk == json.loads(json.dumps(s, default=str))
    assert list(on_disk)[:8] == ["tool", "ran", "ok", "exit_code", "failed", "device", "gpu", "versions"]
    assert {"torch", "transformers", "python"} <= set(on_disk["versions"])
    text = (out / LOG).read_text()
    assert "[ passed] ok" in text and "[ failed] boom" in text and "exit 1: failed bad, boom, hang, crash" in text
    assert "===== boom: output =====" in text and "ValueError: no such kernel" in text
    assert not (tmp_path / "out" / "scratch").exists() and sorted(p.name for p in out.iterdir()) == [LOG, SUMMARY]


def test_the_deadline_skips_what_no_longer_fits_and_skips_are_not_failures(tmp_path, fake_checks):
    # the first check takes at least 1 s of the run's 30: the second no longer fits its minimum box of 29.5 s,
    # however fast the machine (a fast "ok" left the whole deadline for the second one), and the first has 30 s
    # to start its process and sleep its 1 s, however loaded the machine (a 3 s box could run out on one)
    specs = (fake_checks("slow", 30.0), CheckSpec("later", fake_checks("ok").target, 30.0, "a second check"))
    s = run_gpu_check(tmp_path / "out", device="cpu", specs=specs, deadline_s=30.0, min_box_s=29.5)
    assert s["checks"]["slow"]["status"] == "passed"
    assert s["checks"]["later"]["status"] == "skipped" and "deadline of 30 s" in s["checks"]["later"]["reason"]
    assert s["exit_code"] == 0 and s["failed"] == [] and s["ok"] is True


def test_in_process_checks_record_a_raise_as_a_failure(tmp_path, fake_checks):
    import sys

    sys.path.insert(0, str(tmp_path / "mods"))
    try:
        s = run_gpu_check(tmp_path / "out", device="cpu", specs=(fake_checks("boom"), fake_checks("ok")),
                          isolate=False)
    finally:
        sys.path.remove(str(tmp_path / "mods"))
    assert s["checks"]["boom"]["status"] == "failed" and s["checks"]["ok"]["status"] == "passed"
    assert s["exit_code"] == 1


def test_no_cuda_runs_nothing_and_exits_0(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    s = run_gpu_check(tmp_path / "out")
    assert s["ran"] is False and s["exit_code"] == 0 and s["checks"] == {}
    assert "no CUDA device: the GPU check did not run" in (tmp_path / "out" / LOG).read_text()
    assert json.loads((tmp_path / "out" / SUMMARY).read_text())["reason"] == s["reason"]


def test_the_checks_fit_the_eight_minute_promise_and_names_are_checked():
    assert sum(c.box_s for c in CHECKS) <= DEADLINE_S < 8 * 60
    assert [c.name for c in select(["decode", "flex"])] == ["flex", "decode"]  # the run's order, not the ask's
    with pytest.raises(Exception, match="unknown GPU check nope"):
        select(["nope"])


def test_verdict_rules():
    assert verdict([part("a", True), part("b", None, "skipped: x")])["status"] == "passed"
    assert verdict([part("a", True), part("b", False)])["status"] == "failed"
    v = verdict([part("a", None, "skipped: one GPU")])
    assert v["status"] == "skipped" and v["reason"] == "skipped: one GPU"


def test_comparisons_pass_within_and_fail_beyond_their_tolerance():
    assert close_losses([2.0, 1.5], [2.0, 1.5], FLEX_FP32)["ok"]
    assert not close_losses([2.0 * (1 + 3e-5)], [2.0], FLEX_FP32)["ok"]
    step = Tolerance(loss_rtol=1e-4, first_loss_rtol=1e-6)
    assert close_losses([1.0, 1.00005], [1.0, 1.0], step)["ok"] and not close_losses([1.00001], [1.0], step)["ok"]
    assert not close_losses([1.0], [1.0, 1.0], RANKS)["ok"] and not close_losses([float("nan")], [1.0], RANKS)["ok"]
    g = {"w": torch.ones(10), "b": torch.ones(3)}
    assert close_tensors(g, {k: v.clone() for k, v in g.items()}, rel=1e-4)["cosine"] == pytest.approx(1.0)
    off = close_tensors({"w": torch.ones(10), "b": torch.tensor([1.0, 1.0, 1.1])}, g, rel=1e-4)
    assert not off["ok"] and off["worst"] == "b"
    assert not close_tensors({"w": torch.ones(10)}, g, rel=1)["ok"]
    w = close_weights({"w": torch.ones(4) + 3e-4}, {"w": torch.ones(4)}, atol=2e-4)
    assert not w["ok"] and w["max_abs"] == pytest.approx(3e-4, rel=1e-3)
