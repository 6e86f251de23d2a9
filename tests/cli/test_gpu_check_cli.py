"""`dflashkit gpu-check` through the CLI: without CUDA it says so and exits 0; --dry-run lists the checks;
an unknown check name is a usage error."""

from __future__ import annotations

import json

import torch

from dflashkit.cli import main


def last_json(capsys) -> tuple[str, dict]:
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


def test_without_cuda_it_says_so_and_exits_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-check", str(tmp_path / "out"), f"run.run_dir={tmp_path / 'run'}"]) == 0
    out, res = last_json(capsys)
    assert "no CUDA device: the GPU check did not run" in out.splitlines()[0]
    assert res["ok"] is True and res["ran"] is False and res["checks"] == {}
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["ran"] is False
    assert not (tmp_path / "run").exists()  # it writes its OUT_DIR only (no run-dir lock, no stage dir)


def test_dry_run_lists_the_checks_and_bad_names_exit_2(tmp_path, capsys):
    assert main(["gpu-check", "--dry-run", str(tmp_path / "out"), "decode", "flex"]) == 0
    _, res = last_json(capsys)
    assert [c["name"] for c in res["checks"]] == ["flex", "decode"] and res["deadline_s"] < 480
    assert main(["gpu-check", str(tmp_path / "out"), "nosuch"]) == 2
    _, res = last_json(capsys)
    assert "unknown GPU check nosuch" in res["error"] and "distributed" in res["hint"]
