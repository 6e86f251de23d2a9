"""One writer per run dir: a second `generate` on the same run dir is refused, naming the first's PID.

The first writer is a real `dflashkit generate` subprocess kept busy by a slow fault server; the
second runs in-process and must exit 2 without touching the journal. After the first is SIGKILLed
its lock is gone with it (flock), so the next run proceeds and finishes every turn exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

from dflashkit.cli import main
from dflashkit.testing.faults import FaultServer, Faults
from dflashkit.generate.journal import read_records


def test_second_writer_is_refused_naming_the_first(tmp_path, capsys):
    convs = [{"id": f"{i:04d}", "source": "t", "messages": [{"role": "user", "content": f"q{i}"}]}
             for i in range(300)]
    (tmp_path / "prepare").mkdir()
    (tmp_path / "prepare" / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    with FaultServer(Faults(latency_s=(0.05, 0.05))) as srv:
        args = [f"run.run_dir={tmp_path}", f"server.urls=[{srv.url}]", "generate.concurrency=2",
                "generate.progress=false", "--json"]
        first = subprocess.Popen([sys.executable, "-m", "dflashkit", "generate", *args],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the first writer holds the lock and is generating
                if list((tmp_path / "generate" / "shards").glob("part-*.jsonl")):
                    break
                assert first.poll() is None, first.stderr.read().decode()
                time.sleep(0.05)
            capsys.readouterr()
            rc = main(["generate", *args])
            out, err = capsys.readouterr()
            assert rc == 2, err
            assert f"PID {first.pid}" in err and "dflashkit generate" in err and "Traceback" not in err
            assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 2
            assert main(["plan", "1x80", f"run.run_dir={tmp_path}"]) == 3  # readers do not lock
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        capsys.readouterr()
        assert main(["generate", *args]) == 0  # the lock died with the killed writer
    keys = Counter((r["id"], r["turn"]) for r in read_records(tmp_path / "generate" / "shards"))
    assert len(keys) == len(convs) and max(keys.values()) == 1
