"""A `dflashkit serve` started by `generate` lives and dies with it: no orphan, no temp dir left.

`generate` without `server.urls` starts its own server for the tiny target. Once that server
answers, the parent is killed (SIGKILL: no handler of ours runs; then SIGTERM: the clean path);
within seconds the child must be gone and `$TMPDIR` must hold no `dflashkit-serve-*` dir.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_generate(run_dir: Path, target: Path, tmp: Path) -> subprocess.Popen:
    convs = [{"id": f"{i:04d}", "source": "t", "messages": [{"role": "user", "content": f"q{i}"}]}
             for i in range(200)]
    (run_dir / "prepare").mkdir(parents=True, exist_ok=True)
    (run_dir / "prepare" / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    cmd = [sys.executable, "-m", "dflashkit", "generate", f"run.run_dir={run_dir}", f"target.path={target}",
           "target.device=cpu", "generate.max_tokens=400", "generate.concurrency=2", "serve.cpu_threads=1",
           "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp), "TQDM_DISABLE": "1"})


def _server_child(proc: subprocess.Popen, log: Path, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        kids = _children(proc.pid)
        if kids and log.is_file() and "serving " in log.read_text(errors="replace"):
            return kids[0]
        time.sleep(0.1)
    raise AssertionError(f"the local server did not come up; log: {log.read_text() if log.is_file() else '-'}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_parent_leaves_no_server_and_no_temp_dir(tmp_path, tiny_qwen3, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run_dir = tmp_path / "run"
    proc = _start_generate(run_dir, tiny_qwen3, tmp)
    child = _server_child(proc, run_dir / "generate" / "serve.log")
    assert list(tmp.glob("dflashkit-serve-*")), "the parent made no temp dir?"
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    stderr = proc.stderr.read().decode()
    assert rc == (-9 if sig == signal.SIGKILL else 128 + signal.SIGTERM), stderr
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), f"orphaned server {child} still runs after the parent got {sig.name}"
    deadline = time.monotonic() + 60
    while list(tmp.glob("dflashkit-serve-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(tmp.glob("dflashkit-serve-*")), "temp dir leaked"
    assert "Traceback" not in stderr
