"""Recording served traffic (`serving.record`): the record dir's guarantees, `serve`'s records and their features."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from dflashkit.config import SourceSection, TargetSection
from dflashkit.data.features import local_batches
from dflashkit.data.sources import SourceReport, iter_source, to_record
from dflashkit.export.hf import save_drafter
from dflashkit.target.load import load_target
from dflashkit.redact import remember_secret
from dflashkit.serving.record import (RecordPolicy, Recorder, RecordReport, dir_bytes, read_features, read_recorded,
                                      target_fingerprint)
from dflashkit.testing import random_drafter
from tests.harness.servers import serving

CHAT = {"endpoint": "chat", "time": 1.0, "messages": [{"role": "user", "content": "Hi"},
                                                      {"role": "assistant", "content": "Hello"}]}


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_torn_last_line_is_skipped_then_cut_at_restart_and_nothing_is_duplicated(tmp_path):
    rec = Recorder(tmp_path / "r", fingerprint="fp").open()
    ids = [rec.write(dict(CHAT)) for _ in range(3)]
    seg = rec.segment
    rec.close()
    with open(seg, "ab") as fh:  # what a kill in the middle of a write leaves
        fh.write(b'{"id": "torn", "messages": [{"role": "us')
    report = RecordReport()
    assert [r["id"] for r in read_recorded(tmp_path / "r", report)] == ids
    assert report.partial == 1 and report.records == 3

    rec = Recorder(tmp_path / "r", fingerprint="fp").open()  # the restart repairs the torn segment
    assert rec.repaired == 1 and rec.segment != seg
    ids.append(rec.write(dict(CHAT)))
    rec.close()
    report = RecordReport()
    got = [r["id"] for r in read_recorded(tmp_path / "r", report)]
    assert got == ids and len(set(got)) == 4 and report.partial == 0 and report.bad == 0
    assert seg.read_bytes().endswith(b"\n")


def test_a_second_writer_is_refused(tmp_path):
    from dflashkit.errors import UsageError

    rec = Recorder(tmp_path / "r", fingerprint="fp").open()
    try:
        with pytest.raises(UsageError, match="in use by another recording process"):
            Recorder(tmp_path / "r", fingerprint="fp").open()
    finally:
        rec.close()


def test_rotation_keeps_the_dir_under_its_cap_and_drops_old_segments(tmp_path):
    cap = 40_000
    policy = RecordPolicy(max_bytes=cap, segment_bytes=1 << 20, max_age_days=1.0)
    rec = Recorder(tmp_path / "r", fingerprint="fp", policy=policy).open()
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 900}, {"role": "assistant", "content": "y"}]}
    written = [rec.write(dict(big)) for _ in range(150)]  # ~150 kB through a 40 kB cap
    assert dir_bytes(tmp_path / "r") <= cap
    left = [r["id"] for r in read_recorded(tmp_path / "r")]
    assert 0 < len(left) < len(written) and left == written[-len(left):]  # the newest kept, in order
    rec.close()
    segs = sorted((tmp_path / "r").glob("records-*.jsonl"))
    old = segs[0]
    os.utime(old, (time.time() - 2 * 86400, time.time() - 2 * 86400))  # older than max_age_days
    Recorder(tmp_path / "r", fingerprint="fp", policy=policy).open().close()
    assert not old.exists() and segs[-1].exists()


def test_files_are_private_and_redaction_applies(tmp_path):
    remember_secret("sk-remembered-0123456789")
    policy = RecordPolicy(redact=[r"\b\d{3}-\d{2}-\d{4}\b"])
    rec = Recorder(tmp_path / "r", fingerprint="fp", policy=policy,
                   features_meta={"hidden_size": "4"}).open()
    msgs = [{"role": "user", "content": "ssn 123-45-6789, fetch https://bob:hunter2pw@example.com/x?api_key=abc123 "
                                        "with sk-remembered-0123456789"},
            {"role": "assistant", "content": "ok"}]
    rec.write({**CHAT, "messages": msgs}, torch.zeros(3, 4), [1])
    rec.close()
    text = "".join(p.read_text(errors="replace") for p in (tmp_path / "r").glob("*.jsonl"))
    for secret in ("123-45-6789", "hunter2pw", "abc123", "sk-remembered-0123456789"):
        assert secret not in text
    assert "example.com" in text  # the rest of the text stays
    assert (tmp_path / "r").stat().st_mode & 0o777 == 0o700
    files = _files(tmp_path / "r")
    assert any(p.name.endswith(".features.safetensors") for p in files)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files), [(p, oct(p.stat().st_mode)) for p in files]


def test_records_are_a_prepare_source(tmp_path):
    rec = Recorder(tmp_path / "r", fingerprint="fp").open()
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {}}}}]
    rec.write({"endpoint": "chat", "time": 1.0, "tools": tools, "chat_template_kwargs": {"enable_thinking": True},
               "thinking": True, "messages": [
                   {"role": "user", "content": "weather?"},
                   {"role": "assistant", "content": "", "reasoning_content": "look it up",
                    "tool_calls": [{"id": "call_0", "type": "function",
                                    "function": {"name": "get", "arguments": "{}"}}]}]})
    rec.write({"endpoint": "completions", "time": 2.0, "prompt": "def f():", "completion": " return 1"})
    rec.close()
    report = SourceReport(name="served", path=str(tmp_path / "r"))
    out = [to_record(obj) for _, obj in iter_source(SourceSection(path=str(tmp_path / "r")), report)]
    assert report.malformed_lines == 0 and len(out) == 2
    (chat, chat_tools), (plain, _) = out
    assert chat_tools == tools and chat[-1]["tool_calls"][0]["function"]["name"] == "get"
    assert chat[-1]["content"].startswith("<think>\nlook it up\n</think>")  # the reasoning, inline
    assert plain == [{"role": "user", "content": "def f():"}, {"role": "assistant", "content": " return 1"}]


def _usage_of(text: str, stream: bool) -> dict:
    """The `usage` of a reply: the body's, or a stream's last event before `[DONE]`."""
    if not stream:
        return json.loads(text)["usage"]
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return json.loads(events[-1])["usage"]


@pytest.mark.parametrize("proposer", ["drafter", "hybrid"])
def test_serve_records_features_that_equal_captures(tiny_qwen3, tmp_path, proposer):
    """The recorded features equal capture's. With the hybrid, the same request comes back (after a first one,
    streamed and not): the suffix branch drafts it from the tenant pool, so verify steps accept whole blocks and
    their committed rows come from inside one verify forward, rejected rows dropped (a random drafter alone
    almost never gets a draft accepted)."""
    target = load_target(TargetSection(path=str(tiny_qwen3)))
    drafter = random_drafter(target, block_size=4)
    save_drafter(drafter, tmp_path / "drafter", dtype="float32")
    rdir = tmp_path / "rec"
    cfg = {"target": {"path": str(tiny_qwen3)}, "capture": {"dtype": "float32"},
           "serve": {"drafter": str(tmp_path / "drafter"), "record_dir": str(rdir), "record_features": True,
                     "proposer": proposer}}
    contents = ["Tell me about tokens, take 0", "Tell me about tokens, take 1"]
    if proposer == "hybrid":
        contents = [contents[0]] * 3
    answers, accepted = [], []
    with serving(cfg) as (app, url):
        for i, content in enumerate(contents):
            stream = i % 2 == 1
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 12,
                    "chat_template_kwargs": {"enable_thinking": False}, "stream": stream}
            r = httpx.post(url + "/chat/completions", json=body, timeout=120)
            assert r.status_code == 200
            answers.append(r.text if stream else r.json()["choices"][0]["token_ids"])
            accepted.append(_usage_of(r.text, stream)["acceptance_lengths"])
    app.recording.recorder.close()
    if proposer == "hybrid":  # the repeats: several drafted tokens accepted per step
        assert max(max(a) for a in accepted[1:]) >= 3, accepted
    recs = list(read_recorded(rdir))
    assert len(recs) == len(contents) and recs[0]["completion_token_ids"] == answers[0]
    assert recs[0]["target"] == {"fingerprint": target_fingerprint(tiny_qwen3), "how": "files"}
    assert recs[1]["thinking"] is False and recs[1]["messages"][-1]["role"] == "assistant"
    layer_ids = list(drafter.target_layer_ids)
    for r in recs:
        ids = r["prompt_token_ids"] + r["completion_token_ids"]
        feats = read_features(rdir, r)
        assert r["features"]["layer_ids"] == layer_ids and feats is not None
        assert feats.shape == (len(ids) - 1, len(layer_ids) * target.hidden_size) == (r["features"]["rows"],
                                                                                      feats.shape[1])
        (row,), = list(local_batches(target, [torch.tensor(ids)], layer_ids, batch_size=1, pad_id=0,
                                     last_hidden=False))
        torch.testing.assert_close(feats, row[1][: len(ids) - 1].float(), atol=1e-4, rtol=1e-4)


def test_a_client_key_sent_to_serve_is_never_recorded_or_logged(tiny_qwen3, tmp_path, caplog):
    """A client's credentials (Authorization, x-api-key, a key in the query string) reach `dflashkit serve` with
    recording on and debug logging: no record, features file or log line carries them."""
    target = load_target(TargetSection(path=str(tiny_qwen3)))
    save_drafter(random_drafter(target, block_size=4), tmp_path / "drafter", dtype="float32")
    rdir = tmp_path / "rec"
    cfg = {"target": {"path": str(tiny_qwen3)}, "run": {"log_level": "debug"},
           "serve": {"drafter": str(tmp_path / "drafter"), "record_dir": str(rdir), "record_features": True}}
    key, other = "sk-client-7f3a9c1e5b2d4f60", "xk-client-0b1c2d3e4f5a6b7c"
    body = {"messages": [{"role": "user", "content": "Tell me about tokens"}], "max_tokens": 6,
            "chat_template_kwargs": {"enable_thinking": False}}
    for name in (None, "dflashkit", "dflashkit.serve"):  # an earlier CLI run in this process may have set levels
        caplog.set_level("DEBUG", logger=name)
    ours_logger = logging.getLogger("dflashkit")  # the CLI stops it propagating: hear it directly
    ours_logger.addHandler(caplog.handler)
    try:
        with serving(cfg) as (app, url):
            for stream in (False, True):
                r = httpx.post(url + f"/chat/completions?api_key={other}", json={**body, "stream": stream},
                               timeout=120, headers={"Authorization": f"Bearer {key}", "x-api-key": other})
                assert r.status_code == 200
    finally:
        ours_logger.removeHandler(caplog.handler)
    app.recording.recorder.close()
    recs = list(read_recorded(rdir))
    assert len(recs) == 2  # both requests were recorded, so the files below are what recording wrote
    files = _files(rdir)
    assert files
    for secret in (key, other):
        for f in files:
            assert secret.encode() not in f.read_bytes(), f
        ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("dflashkit"))
        assert "POST /v1/chat/completions" in ours and secret not in ours  # the access log ran, key hidden


# -- kill -9 of `serve` under 4 concurrent clients -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli(args: list[str], port: int, log: Path) -> subprocess.Popen:
    """`python -m dflashkit ARGS` in its own process group, answering /v1/models on `port` (waits for it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "dflashkit", *args], stdout=subprocess.DEVNULL,
                             stderr=open(log, "ab"), env=env, start_new_session=True)  # noqa: SIM115
    deadline = time.time() + 120
    while time.time() < deadline:
        if child.poll() is not None:
            raise AssertionError(f"{args[0]} exited {child.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return child
        except httpx.HTTPError:
            time.sleep(0.2)
    child.kill()
    raise AssertionError(f"{args[0]} did not answer in time: {log.read_text()[-2000:]}")


def flood(url: str, clients: int, *, stop: threading.Event, acked: list[str], midway: set[str] | None = None,
          stream_every: int = 2, max_tokens: int = 6, tag: str = "") -> list[threading.Thread]:
    """`clients` threads sending chat requests (each with a nonce unique among floods of distinct `tag`s) until
    `stop`; the nonces of the requests acknowledged (a whole body, or a stream through `data: [DONE]`) go into
    `acked`; `midway` holds the nonces of the streams now open that have had bytes of their answer, not all."""
    midway = set() if midway is None else midway

    def client(k: int) -> None:
        n = 0
        while not stop.is_set() and n < 200:
            nonce = f"nonce{tag}-{k}-{n}"
            n += 1
            body = {"messages": [{"role": "user", "content": f"Say {nonce}"}], "max_tokens": max_tokens,
                    "stream": n % stream_every == 0}
            try:
                if body["stream"]:
                    parts: list[bytes] = []
                    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=30) as r:
                        for part in r.iter_raw():
                            if r.status_code == 200:
                                midway.add(nonce)
                            parts.append(part)
                    text = b"".join(parts)
                    if r.status_code == 200 and text.rstrip().endswith(b"data: [DONE]"):
                        acked.append(nonce)
                else:
                    r = httpx.post(url + "/chat/completions", json=body, timeout=30)
                    if r.status_code == 200 and r.json().get("choices"):
                        acked.append(nonce)
            except (httpx.HTTPError, ValueError):
                if stop.is_set():
                    return
                time.sleep(0.05)
            finally:
                midway.discard(nonce)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    return threads


def freeze_mid_stream(child: subprocess.Popen, midway: set[str], acked: list[str], deadline: float) -> set[str]:
    """Stop (SIGSTOP) `child`'s process group at a moment when a stream is half answered; returns the nonces of
    the streams it left half answered (once the clients have read all it sent: no new acknowledgement for 0.5 s,
    at most 10 s)."""
    while time.time() < deadline:
        if midway:
            os.killpg(child.pid, signal.SIGSTOP)
            settle, seen = time.time() + 10, -1
            while seen != len(acked) and time.time() < settle:
                seen = len(acked)
                time.sleep(0.5)
            cut = set(midway) - set(acked)
            if cut:
                return cut
            os.killpg(child.pid, signal.SIGCONT)  # they all ended before the stop: another moment
        time.sleep(0.01)
    return set()


def assert_exactly_once(root: Path, acked: list[str]) -> None:
    """Every acknowledged nonce is in exactly one record; no record id twice; nothing torn is read."""
    report = RecordReport()
    recs = list(read_recorded(root, report))
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids))
    users = [r["messages"][0]["content"] for r in recs]
    for nonce in acked:
        assert sum(u.endswith(" " + nonce) for u in users) == 1, nonce
    assert report.bad == 0
    for seg in root.glob("records-*.jsonl"):
        assert seg.read_bytes()[-1:] in (b"", b"\n")  # every restart cut what a kill tore


def kill_under_load(args: list[str], port: int, root: Path, log: Path, *, min_acked: int = 4) -> None:
    """Run ARGS (a recording server on `port`), flood it with 4 clients, kill -9 it mid-stream (stopped first at a
    moment a stream is half answered, so that moment is certain), restart it, flood again briefly, stop it: every
    acknowledged request recorded exactly once, and a request was in flight at the kill."""
    acked: list[str] = []
    midway: set[str] = set()
    cut: set[str] = set()
    url = f"http://127.0.0.1:{port}/v1"
    for round_ in range(2):
        child = start_cli(args, port, log)
        stop = threading.Event()
        threads = flood(url, 4, stop=stop, acked=acked, midway=midway, tag=str(round_))
        deadline = time.time() + 120
        want = len(acked) + min_acked
        while len(acked) < want and time.time() < deadline:
            time.sleep(0.05)
        if round_ == 0 and len(acked) >= want:
            cut = freeze_mid_stream(child, midway, acked, deadline)
        if len(acked) < want or (round_ == 0 and not cut):  # no child or client outlives a failed test
            stop.set()
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
            raise AssertionError(f"{len(acked)} of {want} requests answered, {len(cut)} frozen mid-stream: "
                                 f"{log.read_text()[-2000:]}")
        if round_ == 0:
            os.killpg(child.pid, signal.SIGKILL)  # mid-stream: the streams in `cut` are half answered
            child.wait(10)
            stop.set()
        else:
            stop.set()
            for t in threads:
                t.join(60)
            child.send_signal(signal.SIGTERM)
            assert child.wait(60) == 0, log.read_text()[-2000:]
        for t in threads:
            t.join(60)
    assert cut and not cut & set(acked)  # in flight at the kill: started, answered in part, never acknowledged
    assert_exactly_once(root, acked)


@pytest.mark.serial  # a server process and the 4 clients that flood it
def test_kill9_of_serve_under_four_clients_loses_and_duplicates_nothing(tiny_qwen3, tmp_path):
    port = _free_port()
    root = tmp_path / "rec"
    args = ["serve", str(tiny_qwen3), "--port", str(port), f"serve.record_dir={root}", "serve.max_batch=4"]
    kill_under_load(args, port, root, tmp_path / "serve.log")
