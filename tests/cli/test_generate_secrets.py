"""A server that echoes the credentials it was sent (401 bodies, header values, /models errors): nothing of them
reaches a file of the run dir, stdout or stderr, whole, without "Bearer ", or as an 8-character prefix or suffix."""

from __future__ import annotations

import base64
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflashkit.assets import asset_path
from dflashkit.cli import main
from dflashkit.redact import mask_secrets, remember_secret

KEY = "sk-proj-Zq81vTnXwA0pLk3RcY7mBdE5hUf2"
USER, PASSWORD = "alice", "pw-Hq7!Tr93xLmZ"


class _Echo(BaseHTTPRequestHandler):
    """Refuses every request with 401, quoting the Authorization header the way real servers do: whole, the
    credential alone, a truncated prefix, a masked middle with the end shown, and Basic's decoded pair."""

    def _refuse(self) -> None:
        auth = self.headers.get("Authorization", "")
        cred = auth.partition(" ")[2]
        decoded = base64.b64decode(cred).decode() if auth.startswith("Basic ") else ""
        msg = (f"Incorrect API key provided: {auth}. You sent {cred!r} ({cred[:10]}…, …{cred[-9:]}); "
               f"decoded {decoded}")
        body = json.dumps({"error": {"message": msg, "type": "invalid_request_error"}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("WWW-Authenticate", f'Bearer realm="{cred}"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._refuse()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._refuse()

    def log_message(self, *args) -> None:
        pass


@contextmanager
def echo_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()


def _fragments(secret: str) -> list[str]:
    """The secret and every 8-character window of it: a partial echo shows at least one."""
    return [secret] + [secret[i:i + 8] for i in range(len(secret) - 7)]


def _prepared(run_dir: Path) -> None:
    convs = [{"id": f"{i:016x}", "source": "unit", "messages": [{"role": "user", "content": f"question {i}"}]}
             for i in range(3)]
    (run_dir / "prepare").mkdir(parents=True)
    (run_dir / "prepare" / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))


@pytest.mark.parametrize("auth", ["api_key", "url_credentials"])
def test_echoed_credentials_never_stored_or_printed(tmp_path, capsys, monkeypatch, auth):
    _prepared(tmp_path)
    monkeypatch.setenv("DFK_ECHO_KEY", KEY)
    with echo_server() as hostport:
        if auth == "api_key":
            url, secrets, extra = f"http://{hostport}/v1", [KEY], ["server.api_key_env=DFK_ECHO_KEY"]
        else:
            basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
            url, secrets = f"http://{USER}:{PASSWORD}@{hostport}/v1", [PASSWORD, basic, f"{USER}:{PASSWORD}"]
            extra = ["server.api_key_env=DFK_ECHO_UNSET"]
        rc = main(["generate", f"run.run_dir={tmp_path}", f"server.urls=[{url}]", "server.model=m",
                   "server.timeout_s=5", f"target.tokenizer={asset_path('tokenizer-qwen3')}",
                   "generate.preflight=warn", *extra, "--json"])
    cap = capsys.readouterr()
    out = json.loads(cap.out.strip().splitlines()[-1])
    assert rc == 2 and out["generate"]["failed_by_reason"] == {"http 401": 3}, out
    failures = [json.loads(x) for x in (tmp_path / "generate" / "failures.jsonl").read_text().splitlines()]
    assert len(failures) == 3 and all("Incorrect API key provided" in f["detail"] for f in failures)
    manifest = json.loads((tmp_path / "generate" / "manifest.json").read_text())
    assert "http 401" in manifest["preflight"]["detail"]  # the server's answer is kept, masked
    written = {str(p): p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file()}
    written.update(stdout=cap.out, stderr=cap.err)
    for secret in secrets:
        for fragment in _fragments(secret):
            leaks = [name for name, text in written.items() if fragment in text]
            assert not leaks, (fragment, leaks)


def test_mask_secrets_whole_partial_and_short():
    key = "sk-live-4fX9qL2mZr7TbW0c"
    remember_secret(key)
    remember_secret("ab")  # too short to mask: every "ab" in a message would go
    text = f"got Bearer {key}; again {key[:12]}… and …{key[-10:]}, tail {key[-7:]}; about"
    masked = mask_secrets(text)
    for fragment in _fragments(key):
        assert fragment not in masked, (fragment, masked)
    assert masked.startswith("got Bearer ***; again ***… and …***, tail ") and masked.endswith("; about")
    assert mask_secrets(f"{key}x", partial=False) == "***x"
    assert mask_secrets(f"{key[:12]}", partial=False) == key[:12]  # training text keeps a mere prefix
