"""`dflashkit record --upstream URL`: the recording proxy over real HTTP on 127.0.0.1 (a stub upstream)."""

from __future__ import annotations

import base64
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from dflashkit.cli import main
from dflashkit.serving.record import RecordReport, read_recorded
from dflashkit.testing.upstream import stub_upstream
from tests.serving.test_record import _free_port, kill_under_load, start_cli


def _stop(child, log: Path) -> None:
    child.send_signal(signal.SIGTERM)
    assert child.wait(60) == 0, log.read_text()[-2000:]


def test_proxy_streams_through_and_records_each_kind(tmp_path):
    port, root, log = _free_port(), tmp_path / "rec", tmp_path / "proxy.log"
    with stub_upstream(chunks=5, delay_s=0.01) as up:
        child = start_cli(["record", "--upstream", up, "--port", str(port), f"record.dir={root}",
                           "record.target_fingerprint=my-target-v1"], port, log)
        url = f"http://127.0.0.1:{port}/v1"
        try:
            body = {"messages": [{"role": "user", "content": "stream it"}], "stream": True,
                    "chat_template_kwargs": {"enable_thinking": True}, "temperature": 0}
            with httpx.stream("POST", url + "/chat/completions", json=body, timeout=30) as r:
                through = b"".join(r.iter_raw())
            direct = httpx.post(up + "/chat/completions", json=body, timeout=30).content
            assert through == direct  # every event, byte for byte
            plain = httpx.post(url + "/chat/completions", json={**body, "stream": False}, timeout=30)
            assert plain.json()["choices"][0]["message"]["content"] == "w0 w1 w2 w3 w4 "
            assert httpx.post(url + "/completions", json={"prompt": "abc"}, timeout=30).status_code == 200
            assert httpx.get(url + "/models", timeout=30).json()["data"][0]["id"] == "stub"
            assert httpx.post(url + "/nothing", json={}, timeout=30).status_code == 404  # relayed, not recorded
        finally:
            _stop(child, log)
    report = RecordReport()
    recs = list(read_recorded(root, report))
    assert [r["endpoint"] for r in recs] == ["chat", "chat", "completions"] and report.partial == 0
    stream, whole, comp = recs
    assert stream["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2 w3 w4 "}
    assert stream["completion_token_ids"] == [0, 1, 2, 3, 4] and stream["finish_reason"] == "stop"
    assert stream["thinking"] is True and stream["sampling"] == {"temperature": 0}
    assert whole["prompt_token_ids"] == [1, 2, 3] and whole["messages"][-1]["content"] == "w0 w1 w2 w3 w4 "
    assert comp["prompt"] == "abc" and comp["completion"] == "w0 w1 w2 w3 w4 "
    assert {json.dumps(r["target"]) for r in recs} == {json.dumps({"fingerprint": "my-target-v1", "how": "given"})}
    assert stream["time"] <= whole["time"] <= comp["time"]


@pytest.mark.parametrize("upstream_auth", ["url", "env"])
def test_keys_in_a_header_an_env_var_or_the_url_are_never_written(tmp_path, monkeypatch, upstream_auth):
    """Each credential really goes upstream (the stub quotes the Authorization it got back into its reply, which
    the client sees), and no written file holds it, plain or base64. The proxy sends the URL's `user:password@` as
    Basic before record.api_key_env, so the env-var key is exercised by an upstream URL without credentials."""
    header_key, env_key, url_pw = "sk-header-7Hq2LxP9vZ", "sk-envvar-3Rt8MnB4wQ", "urlpass-K5jD2sW9"
    basic = base64.b64encode(f"alice:{url_pw}".encode()).decode()
    monkeypatch.setenv("REC_TEST_KEY", env_key)
    port, root, log = _free_port(), tmp_path / "rec", tmp_path / "proxy.log"
    with stub_upstream(chunks=3, echo_auth=True) as up:
        upstream = up.replace("http://", f"http://alice:{url_pw}@") if upstream_auth == "url" else up
        child = start_cli(["record", "--upstream", upstream, "--port", str(port), f"record.dir={root}",
                           "record.api_key_env=REC_TEST_KEY", "--log-level", "debug"], port, log)
        url = f"http://127.0.0.1:{port}/v1"
        try:
            msg = {"role": "user", "content": f"my key is {header_key}, and the url http://bob:{url_pw}@h/v1"}
            r = httpx.post(url + "/chat/completions", json={"messages": [msg]},
                           headers={"Authorization": f"Bearer {header_key}"}, timeout=30)
            assert f"auth=Bearer {header_key} " in r.text  # the client's key went upstream, and came back quoted
            r = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "stream": True}, timeout=30)
            sent = f"Basic {basic}" if upstream_auth == "url" else f"Bearer {env_key}"
            assert f"auth={sent} " in r.text  # no client key: the proxy's own credential went upstream
        finally:
            _stop(child, log)
    assert len(list(read_recorded(root))) == 2
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".jsonl" for p in written) and log in written
    for p in written:
        data = p.read_bytes()
        for secret in (header_key, env_key, url_pw, f"alice:{url_pw}", basic):
            assert secret.encode() not in data, (p, secret)


def test_record_refusals_name_the_key(tmp_path, capsys):
    def said() -> str:
        c = capsys.readouterr()
        return c.out + c.err

    assert main(["record", "record.dir=" + str(tmp_path / "r")]) == 2
    assert "--upstream" in said()
    assert main(["record", "--upstream", "http://127.0.0.1:9/v1"]) == 2
    assert "record.dir" in said()
    assert main(["record", "--upstream", "http://127.0.0.1:9/v1", f"record.dir={tmp_path / 'r'}",
                 "record.redact=['(unclosed']"]) == 2
    assert "record.redact[0]" in said()
    assert main(["record", "--upstream", "http://127.0.0.1:9/v1", f"record.dir={tmp_path / 'r'}",
                 "record.api_key_env=DFLASHKIT_NO_SUCH_VAR"]) == 2
    assert "DFLASHKIT_NO_SUCH_VAR" in said()
    assert not (tmp_path / "r").exists()
    assert main(["record", "--upstream", "http://127.0.0.1:9/v1", f"record.dir={tmp_path / 'r'}"]) == 3
    assert "record.upstream" in said()  # nothing answers there to name the target's fingerprint


@pytest.mark.serial  # the proxy process, the upstream and the 4 clients that flood it
def test_kill9_of_the_proxy_mid_stream_under_four_clients(tmp_path):
    port, root = _free_port(), tmp_path / "rec"
    with stub_upstream(chunks=6, delay_s=0.02) as up:
        kill_under_load(["record", "--upstream", up, "--port", str(port), f"record.dir={root}"], port, root,
                        tmp_path / "proxy.log")
    assert os.stat(root).st_mode & 0o777 == 0o700
