"""`dflashkit flywheel` refuses a learn.traffic file that is not there (exit 3), dry run or not, before it starts a
server: the message names the key, the path and what makes the file."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from tests.helpers import TEXTS, make_run, overrides


@pytest.mark.parametrize("dry", [True, False])
def test_missing_traffic_is_a_missing_artifact(tmp_path, tiny_qwen3, capsys, dry):
    run_dir = make_run(tmp_path / "run", tiny_qwen3)
    there = tmp_path / "traffic.jsonl"
    there.write_text(json.dumps({"id": "c0", "source": "chat", "messages": [{"role": "user", "content": TEXTS[0][0]}]})
                     + "\n")
    missing = tmp_path / "prepared" / "prepare" / "train.jsonl"
    capsys.readouterr()
    rc = main(["flywheel", "--json", *(["--dry-run"] if dry else []), *overrides(run_dir, tiny_qwen3),
               f"learn.traffic=[\"{there}\", \"{missing}\"]"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 3 and out["exit_code"] == 3, out
    assert "learn.traffic[1]" in out["error"] and str(missing) in out["error"]
    assert "dflashkit prepare" in out["hint"]
    assert not (run_dir / "learn").exists()  # nothing served, recorded or learned
