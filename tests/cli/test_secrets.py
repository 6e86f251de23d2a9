"""No password from any URL field appears in any output, log, manifest, resolved config or result file.

One sweep puts a distinctive `user:password@` into every field the schema marks `url=True` (`server.urls`,
`bench.urls`, `capture.server_url`, `record.upstream`), runs every command that reads one — on success and on failure — against
fake servers on 127.0.0.1 (`dflashkit.testing`, tests/harness), at debug log level, and searches stdout, stderr and every
file under the test's directory for the password. A field with "url" in its name that the schema does not
mark fails `test_every_url_field_is_marked`, so a new one cannot skip the rule.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import signal
import socket
import typing
from pathlib import Path

import httpx
import pytest

from dflashkit.cli import main
from tests.serving.test_record import _free_port, start_cli

PASSWORD = "Pw-sekr1t-Q7x"
USER = "alice"
SWEPT = {"server.urls", "bench.urls", "capture.server_url", "record.upstream"}  # every url=True field: the sweep sets each


def _with_password(url: str) -> str:
    return url.replace("http://", f"http://{USER}:{PASSWORD}@")


def _marked(cls: type, prefix: str = "") -> dict[str, bool]:
    """dotted key → marked url=True, for every leaf field of the schema."""
    hints = typing.get_type_hints(cls)
    out: dict[str, bool] = {}
    for fl in dataclasses.fields(cls):
        tp = hints[fl.name]
        if dataclasses.is_dataclass(tp):
            out.update(_marked(typing.cast(type, tp), f"{prefix}{fl.name}."))
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            out.update(_marked(typing.get_args(tp)[0], f"{prefix}{fl.name}[]."))
        else:
            out[f"{prefix}{fl.name}"] = bool(fl.metadata.get("url"))
    return out


def test_every_url_field_is_marked():
    from dflashkit.config import RunConfig

    marked = _marked(RunConfig)
    assert {k for k, v in marked.items() if v} == SWEPT  # the sweep below sets each of them
    named = {k for k in marked if "url" in k.rsplit(".", 1)[-1].lower()}
    assert named <= SWEPT, f"fields that look like URLs but are not marked url=True: {sorted(named - SWEPT)}"


def test_dump_config_redacts_every_marked_field():
    from dflashkit.config import config_from_dict, dump_config, url_fields

    cfg = config_from_dict({"server": {"urls": [_with_password("http://h:1/v1")] * 2},
                            "bench": {"urls": [_with_password("http://h:2/v1")]},
                            "capture": {"engine": "vllm", "server_url": _with_password("http://h:3/v1")},
                            "record": {"upstream": _with_password("http://h:4/v1")}})
    assert {k.split("[")[0] for k, _ in url_fields(cfg)} == SWEPT
    text = dump_config(cfg)
    assert PASSWORD not in text and USER not in text
    assert text.count("http://***@h:") == 5, text


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Sweep:
    """Runs commands in-process and collects everything they printed."""

    def __init__(self, capsys):
        self.capsys, self.printed, self.codes = capsys, [], []

    def __call__(self, *argv: str, code: int | None = 0) -> dict:
        rc = main([*argv, "--log-level", "debug"])
        out, err = self.capsys.readouterr()
        self.printed.append((argv[0], out + err))
        self.codes.append((argv[:2], rc))
        assert code is None or rc == code, f"{argv[:2]} exited {rc}, wanted {code}\n{err[-3000:]}"
        return json.loads(out.strip().splitlines()[-1])


def test_no_password_from_any_url_field_appears_anywhere(tmp_path, tiny_qwen3, capsys):
    from tests.harness.fake_engine import FakeHiddenStatesEngine
    from dflashkit.testing.faults import FaultServer, Faults
    from tests.helpers import make_run, overrides

    rd = make_run(tmp_path / "run", tiny_qwen3)
    (rd / "prepare").mkdir()
    conv = {"id": "0000000000000001", "source": "t",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (rd / "prepare" / "train.jsonl").write_text(json.dumps(conv) + "\n")
    n_layers = json.loads((tiny_qwen3 / "config.json").read_text())["num_hidden_layers"]
    aux = [i + 1 for i in json.loads((rd / "contract.json").read_text())["target_layer_ids"]] + [n_layers]
    base = overrides(rd, tiny_qwen3, train__max_steps=2)
    dead = f"http://{USER}:{PASSWORD}@127.0.0.1:{_closed_port()}/v1"
    run = Sweep(capsys)
    with FaultServer(Faults()) as srv, FakeHiddenStatesEngine(tiny_qwen3, aux=aux, storage=tmp_path / "hs") as eng:
        server, engine = _with_password(srv.url), _with_password(eng.url)
        urls = [f"server.urls=['{server}']", f"bench.urls=['{server}']", "capture.engine=vllm",
                f"capture.server_url={engine}", "capture.dtype=float32", "generate.preflight=warn"]
        # `run` writes config.resolved.yaml (every URL field) and regenerates through server.urls
        run("run", *base, *urls, "--from", "generate", "--to", "generate", "generate.progress=false")
        run("doctor", *base, *urls, code=None)  # reachability + drift pre-flight of server.urls
        res = run("bench", "serve", *base, *urls, "server.model=fault-model", "bench.concurrency=[1]",
                  "bench.requests=2", "bench.warmup=0")
        assert res["endpoints"][0]["url"].startswith("http://***@127.0.0.1:")
        run("capture", *base, *urls, "--dry-run")
        run("capture", *base, *urls)
        run("train", *base, *urls, "train.features=engine", "train.labels=target")
        run("report", *base)
        rec_port = _free_port()  # the proxy serves until SIGTERM: its own process, its log under tmp_path
        proxy = start_cli(["record", "--upstream", server, "--port", str(rec_port), f"record.dir={tmp_path / 'rec'}",
                           f"target.path={tiny_qwen3}", "--log-level", "debug"], rec_port, tmp_path / "record.log")
        try:
            answer = httpx.post(f"http://127.0.0.1:{rec_port}/v1/chat/completions", timeout=60,
                                json={"model": "fault-model", "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200, answer.text
        finally:
            proxy.send_signal(signal.SIGTERM)
            assert proxy.wait(60) == 0, (tmp_path / "record.log").read_text()[-2000:]
        assert any((tmp_path / "rec").rglob("*.jsonl"))
        run("record", "--upstream", server, f"record.dir={tmp_path / 'rec'}", "--dry-run")
        assert f"Basic {base64.b64encode(f'{USER}:{PASSWORD}'.encode()).decode()}" in srv.auth_seen
        # failures: a closed port in each URL field, a URL the config refuses, a value the loader cannot read
        run("bench", "serve", *base, f"bench.urls=['{dead}']", code=1)
        run("capture", *base, "capture.engine=vllm", f"capture.server_url={dead}", "capture.dtype=bfloat16",
            code=None)  # another dtype: the shards are redone, through the dead URL
        run("train", *base, "capture.engine=vllm", f"capture.server_url={dead}", "train.features=engine",
            "train.max_steps=3", code=None)
        fresh = tmp_path / "fresh"
        (fresh / "prepare").mkdir(parents=True)
        (fresh / "prepare" / "train.jsonl").write_text(json.dumps(conv) + "\n")
        run("generate", f"run.run_dir={fresh}", f"server.urls=['{dead}']", "server.model=m", "generate.max_retries=0",
            "generate.progress=false", code=4)
        run("doctor", *base, f"server.urls=['{dead}']", code=None)
        run("generate", *base, f"server.urls=['ftp://{USER}:{PASSWORD}@h/v1']", code=2)
        run("bench", "serve", *base, f"bench.urls=[{server}?api_key={PASSWORD}]", code=2)
        run("capture", *base, "capture.engine=vllm", f"capture.server_url={engine}?token={PASSWORD}", code=2)
        run("record", "--upstream", dead, f"record.dir={tmp_path / 'rec2'}", code=3)  # no /models to fingerprint
        run("record", "--upstream", f"{server}?api_key={PASSWORD}", f"record.dir={tmp_path / 'rec2'}", code=2)
    for name, text in run.printed:
        assert PASSWORD not in text, f"`{name}` printed the password:\n" + "\n".join(
            line for line in text.splitlines() if PASSWORD in line)
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert (rd / "config.resolved.yaml").is_file() and (rd / "bench" / "serve.json").is_file()
    assert (rd / "report" / "index.html").is_file() and (rd / "capture" / "manifest.json").is_file()


@pytest.mark.parametrize("url", ["http://h:1/v1?api_key=K", "http://h:1/v1#frag"])
def test_a_base_url_with_a_query_is_refused_without_showing_it(url, tmp_path, capsys):
    assert main(["generate", f"run.run_dir={tmp_path}", f"server.urls=['{url}']"]) == 2
    err = capsys.readouterr().err
    assert "server.urls[0]" in err and "cannot carry a query" in err and "server.api_key_env" in err, err
    assert "=K" not in err
    assert not Path(tmp_path, "generate").exists()


def test_redaction_rule():
    from dflashkit.redact import redact_text, redact_url

    assert redact_url("https://u:p@h:1/v1?api_key=sk-1&x=2") == "https://***@h:1/v1?api_key=***&x=2"
    assert redact_url('http://u:p["@w@[::1]:8/v1') == "http://***@[::1]:8/v1"  # any character, up to the last @
    line = 'GET {"url": "http://u:pw@h/v1?access_token=t", "x": "a@b"} mail a@b.c, x=1; key=v'
    assert redact_text(line) == 'GET {"url": "http://***@h/v1?access_token=***", "x": "a@b"} mail a@b.c, x=1; key=v'
    assert json.loads(redact_text(json.dumps({"u": "http://u:p@h/v1?sig=1", "m": "x"}))) == \
        {"u": "http://***@h/v1?sig=***", "m": "x"}
