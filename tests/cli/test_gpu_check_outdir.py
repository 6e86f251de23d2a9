"""`dflashkit gpu-check`'s OUT_DIR: a user's directory is never overwritten, a bad path is a usage error (exit 2,
the path named, no traceback), both refused before any check runs and in `--dry-run` too; a previous
gpu-check's OUT_DIR is replaced. Without CUDA the summary names no device it did not have."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.errors import UsageError
from dflashkit.gpucheck.runner import LOG, SUMMARY, run_gpu_check


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    """The no-CUDA path on every machine: nothing here may start the real checks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` and its bytes (None for a directory)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def gpu_check(argv: list[str], capsys) -> tuple[int, dict, str]:
    capsys.readouterr()
    rc = main(["gpu-check", *argv])
    out, err = capsys.readouterr()
    return rc, json.loads(out.strip().splitlines()[-1]), err


def users_dir(tmp_path: Path) -> Path:
    """A directory of the user's holding files named like gpu-check's outputs (and one more)."""
    d = tmp_path / "user" / "results"
    d.mkdir(parents=True)
    (d / SUMMARY).write_text(json.dumps({"ran": True, "ok": True, "checks": {"mine": "precious"}}))
    (d / LOG).write_text("my own log\n")
    (d / "notes.txt").write_text("keep me\n")
    return d


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_a_users_non_empty_dir_is_refused_and_left_unchanged(tmp_path, capsys, dry_run):
    d = users_dir(tmp_path)
    before = snapshot(tmp_path)
    rc, res, err = gpu_check([*(["--dry-run"] if dry_run else []), str(d), f"run.run_dir={tmp_path / 'run'}"],
                             capsys)
    assert rc == 2, res
    assert f"refusing to write into {d}" in res["error"] and "did not write" in res["error"]
    assert "new or empty directory" in res["hint"] and "Traceback" not in err
    assert snapshot(tmp_path) == before


def test_a_summary_json_of_another_tool_is_not_a_marker(tmp_path, capsys):
    d = tmp_path / "results"
    d.mkdir()
    (d / SUMMARY).write_text(json.dumps({"tool": "someone else's gpu-check", "ran": False}))
    before = snapshot(tmp_path)
    rc, res, _ = gpu_check([str(d)], capsys)
    assert rc == 2 and str(d) in res["error"]
    assert snapshot(tmp_path) == before


def test_run_gpu_check_itself_refuses_a_users_dir(tmp_path):
    d = users_dir(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(UsageError, match="refusing to write into"):
        run_gpu_check(d)
    assert snapshot(tmp_path) == before


def test_a_previous_gpu_checks_dir_and_an_empty_dir_are_written(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, res, _ = gpu_check([str(empty)], capsys)
    assert rc == 0, res
    first = json.loads((empty / SUMMARY).read_text())
    rc, res, _ = gpu_check([str(empty)], capsys)  # its own OUT_DIR: replaced
    assert rc == 0, res
    assert sorted(p.name for p in empty.iterdir()) == [LOG, SUMMARY]
    assert json.loads((empty / SUMMARY).read_text())["ran"] is False and first["ran"] is False


def test_without_cuda_the_summary_names_no_cuda_device(tmp_path, capsys):
    rc, _, _ = gpu_check([str(tmp_path / "out")], capsys)
    assert rc == 0
    summary = json.loads((tmp_path / "out" / SUMMARY).read_text())
    assert summary["ran"] is False and summary["gpu"]["cuda_available"] is False
    assert summary["device"] is None


BAD_PATHS = {
    "a-file": (lambda t: t / "f", "is a file, not a directory"),
    "under-a-file": (lambda t: t / "f" / "out", "is under"),
    "proc": (lambda t: Path("/proc/dflashkit-no-such/out"), "cannot write there"),
}


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("case", sorted(BAD_PATHS))
def test_a_bad_out_path_is_a_named_usage_error(tmp_path, capsys, case, dry_run):
    (tmp_path / "f").write_text("a file of the user's\n")
    make, needle = BAD_PATHS[case]
    out = make(tmp_path)
    before = snapshot(tmp_path)
    rc, res, err = gpu_check([*(["--dry-run"] if dry_run else []), str(out)], capsys)
    assert rc == 2, res
    assert f"gpu-check OUT_DIR {out}" in res["error"] and needle in res["error"], res
    assert "directory you can write to" in res["hint"] and "Traceback" not in err
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_dir_is_a_named_usage_error(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc, res, _ = gpu_check([str(ro / "out")], capsys)
    finally:
        ro.chmod(0o755)
    assert rc == 2 and f"{ro / 'out'}: cannot write there" in res["error"]
    assert list(ro.iterdir()) == []


def test_the_default_out_dir_under_a_run_dir_that_is_a_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.write_text("not a run dir\n")
    rc, res, err = gpu_check(["--dry-run", f"run.run_dir={run}"], capsys)
    assert rc == 2 and f"{run / 'gpu-check'} is under {run}" in res["error"] and "run.run_dir" in res["error"]
    assert run.read_text() == "not a run dir\n" and "Traceback" not in err
