"""Kill test: `dflashkit generate` SIGKILLed at random moments, restarted; exactly-once output.

A fault-injecting server with a few ms of latency keeps each run busy; every run is killed a random
moment after it wrote its first new journal line. After ≥ 10 kills a last run completes: every
(id, turn) is in the journal exactly once, no line is torn, and conversations.jsonl equals the
oracle (each answer depends on the whole history the client sent, so order errors show up).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from dflashkit.serving.conversations import build_prompt, plan_turns
from dflashkit.serving.faults import FaultServer, Faults, canned_answer

KILLS = 10


def _journal_lines(run_dir: Path, *, after_kill: bool = False) -> list[bytes]:
    """Complete journal lines. Right after a SIGKILL the kernel may have cut the last write short
    (a fatal signal stops a regular-file write between pages), so a torn tail is allowed then —
    only as the last line of the newest shard, which the next `open()` truncates away. After a
    clean finish no line may be torn."""
    lines: list[bytes] = []
    shards = sorted((run_dir / "generate" / "shards").glob("part-*.jsonl"))
    for i, p in enumerate(shards):
        data = p.read_bytes()
        if data and not data.endswith(b"\n"):
            assert after_kill and i == len(shards) - 1, f"{p}: torn line that is not the newest tail"
            data = data[: data.rfind(b"\n") + 1]
        lines += data.splitlines()
    return lines


def _newlines(run_dir: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (run_dir / "generate" / "shards").glob("part-*.jsonl")) \
        if (run_dir / "generate" / "shards").exists() else 0


def _start(run_dir: Path, url: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflashkit", "generate", f"run.run_dir={run_dir}", f"server.urls=[{url}]",
           "server.timeout_s=2", "generate.backoff_s=0.01", "generate.concurrency=8", "generate.shard_size=150",
           "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TQDM_DISABLE": "1"})


def test_generate_survives_repeated_sigkill(tmp_path):
    rng = random.Random(1234)
    convs = []
    for i in range(700):
        msgs = []
        for t in range(1 + i % 3):
            msgs += [{"role": "user", "content": f"q{i}.{t}"}, {"role": "assistant", "content": "x"}]
        convs.append({"id": f"{i:016x}", "source": "kill", "messages": msgs})
    (tmp_path / "prepare").mkdir()
    (tmp_path / "prepare" / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    total_turns = sum(len(plan_turns(c["messages"])) for c in convs)

    kills = 0
    with FaultServer(Faults(rates={"429": 0.03, "500": 0.03, "drop": 0.02}, latency_s=(0.01, 0.04),
                            max_faults_per_key=1, seed=5)) as srv:
        deadline = time.monotonic() + 120
        while kills < KILLS and time.monotonic() < deadline:
            before = len(_journal_lines(tmp_path, after_kill=True)) if (tmp_path / "generate").exists() else 0
            proc = _start(tmp_path, srv.url)
            while proc.poll() is None:  # wait for this run's first journal line, then a random moment
                if _newlines(tmp_path) > before:  # (a live writer may be mid-line: only count newlines)
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.3))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
            else:
                proc.wait()
                break  # finished before we could kill it: all work is done
            lines = _journal_lines(tmp_path, after_kill=True)
            keys = Counter((json.loads(x)["id"], json.loads(x)["turn"]) for x in lines)
            assert max(keys.values(), default=1) == 1, "duplicate (id, turn) after a kill"
        assert kills >= KILLS, f"only {kills} kills: the runs finish too fast"
        proc = _start(tmp_path, srv.url)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    result = json.loads(out.decode().strip().splitlines()[-1])["generate"]
    lines = _journal_lines(tmp_path)
    keys = Counter((json.loads(x)["id"], json.loads(x)["turn"]) for x in lines)
    assert len(keys) == total_turns and max(keys.values()) == 1
    assert result["turns_total"] == total_turns and result["turns_failed"] == 0
    assert result["turns_skipped_done"] + result["turns_ok"] == total_turns
    assert result["turns_skipped_done"] > 0
    rows = [json.loads(x) for x in (tmp_path / "generate" / "conversations.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [c["id"] for c in convs]
    for conv, row in zip(convs, rows):
        turns = plan_turns(conv["messages"])
        answers: list[str] = []
        for t in range(len(turns)):
            answers.append(canned_answer(build_prompt(conv["messages"], turns, answers, t)))
        assert [m["content"] for m in row["messages"] if m["role"] == "assistant"] == answers
