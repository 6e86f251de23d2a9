"""`dflashkit generate` against the fault-injecting server: retries, accounting, resume, multi-turn."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.generate.conversations import build_prompt, plan_turns
from dflashkit.testing.faults import FaultServer, Faults, canned_answer
from dflashkit.generate.journal import Journal, read_records

ALL_FAULTS = {"429": 0.1, "500": 0.1, "timeout": 0.05, "drop": 0.08, "malformed": 0.08}


def write_prepared(run_dir: Path, n: int = 40, max_turns: int = 3) -> list[dict]:
    convs = []
    for i in range(n):
        msgs = [{"role": "system", "content": "be brief"}] if i % 2 else []
        for t in range(1 + i % max_turns):
            msgs += [{"role": "user", "content": f"question {i}.{t}"}, {"role": "assistant", "content": "old"}]
        if i % 5 == 4:
            msgs.pop()  # ends with a user turn: an answer is appended
        convs.append({"id": f"{i:016x}", "source": "unit", "messages": msgs})
    (run_dir / "prepare").mkdir(parents=True, exist_ok=True)
    (run_dir / "prepare" / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    return convs


def run_generate(run_dir: Path, url: str | list[str], *extra: str, capsys=None) -> tuple[int, dict]:
    urls = url if isinstance(url, list) else [url]
    rc = main(["generate", f"run.run_dir={run_dir}", f"server.urls=[{','.join(urls)}]", "server.timeout_s=0.5",
               "generate.backoff_s=0.005", "generate.concurrency=8", "generate.max_tokens=32", *extra, "--json"])
    out = {}
    if capsys is not None:
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return rc, out


def expected_conversation(conv: dict) -> list[dict]:
    """The oracle: each answer is canned_answer(the prompt that includes the previous answers)."""
    turns = plan_turns(conv["messages"])
    answers: list[str] = []
    for t in range(len(turns)):
        answers.append(canned_answer(build_prompt(conv["messages"], turns, answers, t)))
    return build_prompt(conv["messages"], turns + [len(conv["messages"])], answers + [""], len(turns))


def read_out(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "generate" / "conversations.jsonl").read_text().splitlines()]


def check_accounting(g: dict, n_convs: int) -> None:
    assert g["turns_total"] == g["turns_skipped_done"] + g["turns_ok"] + g["turns_failed"] + g["turns_not_attempted"]
    assert g["conversations_written"] + g["conversations_failed"] + g["conversations_dropped_length"] \
        + g["conversations_no_user_turn"] == n_convs
    assert sum(g["failed_by_reason"].values()) == g["turns_failed"]


def test_all_faults_recovered_multi_turn_order(tmp_path, capsys):
    convs = write_prepared(tmp_path)
    with FaultServer(Faults(rates=ALL_FAULTS, timeout_sleep_s=1.0, max_faults_per_key=3)) as srv:
        rc, out = run_generate(tmp_path, srv.url, "generate.max_retries=4",
                               capsys=capsys)
        stats = dict(srv.stats)
    assert rc == 0, out
    g = out["generate"]
    check_accounting(g, len(convs))
    for kind in ("429", "500", "timeout", "drop", "malformed"):
        assert stats.get(kind, 0) > 0, stats  # every fault kind was exercised
    assert g["turns_failed"] == 0 and g["turns_retried"] > 0 and g["retries"] >= g["turns_retried"]
    assert g["turns_ok"] == sum(len(plan_turns(c["messages"])) for c in convs)
    rows = read_out(tmp_path)
    assert [r["id"] for r in rows] == [c["id"] for c in convs]
    for conv, row in zip(convs, rows):
        assert row["messages"] == expected_conversation(conv), conv["id"]
        assert row["meta"]["finish_reasons"] == ["stop"] * len(plan_turns(conv["messages"]))
        assert [bytes(ids).decode() for ids in row["meta"]["token_ids"]] == \
            [m["content"] for m in row["messages"] if m["role"] == "assistant"]
    keys = Counter((r["id"], r["turn"]) for r in read_records(tmp_path / "generate" / "shards"))
    assert max(keys.values()) == 1
    manifest = json.loads((tmp_path / "generate" / "manifest.json").read_text())
    assert manifest["model"] == "fault-model" and manifest["sampling"]["max_tokens"] == 32


def test_permanent_failures_counted_then_resumed(tmp_path, capsys):
    convs = write_prepared(tmp_path, n=30)
    with FaultServer(Faults(rates={"500": 0.2}, always_fail=0.25, seed=3)) as srv:
        rc, out = run_generate(tmp_path, srv.url, "generate.max_retries=2", capsys=capsys)
    assert rc == 4 and out["ok"] is False  # finished with failures: an honest, documented exit code
    g = out["generate"]
    assert f"{g['turns_failed']} of {g['turns_total']} turns failed" in out["error"]
    assert out["error"].endswith("re-run to retry")
    check_accounting(g, len(convs))
    assert g["turns_failed"] > 0 and g["failed_by_reason"].get("http 500") == g["turns_failed"]
    failures = [json.loads(x) for x in (tmp_path / "generate" / "failures.jsonl").read_text().splitlines()]
    assert len({f["id"] for f in failures}) == g["conversations_failed"]
    assert all(f["reason"] == "http 500" and f["attempts"] == 3 for f in failures)
    written_before = g["conversations_written"]
    # second run against a healthy server: only the missing turns are requested
    with FaultServer(Faults(seed=3)) as srv:
        rc, out2 = run_generate(tmp_path, srv.url, capsys=capsys)
        sent = srv.stats["requests"]
    g2 = out2["generate"]
    assert rc == 0 and g2["turns_failed"] == 0
    assert g2["turns_skipped_done"] == g["turns_ok"]
    assert sent == g2["turns_ok"] == g["turns_failed"] + g["turns_not_attempted"]
    assert g2["conversations_written"] == len(convs) > written_before
    assert [r["messages"] for r in read_out(tmp_path)] == [expected_conversation(c) for c in convs]
    assert (tmp_path / "generate" / "failures.jsonl").read_text() == ""


def test_torn_tail_is_truncated_and_regenerated(tmp_path, capsys):
    convs = write_prepared(tmp_path, n=12)
    with FaultServer() as srv:
        assert run_generate(tmp_path, srv.url, capsys=capsys)[0] == 0
    shard = sorted((tmp_path / "generate" / "shards").glob("part-*.jsonl"))[-1]
    data = shard.read_bytes()
    cut = data.rstrip(b"\n").rfind(b"\n") + 1
    shard.write_bytes(data[: cut + 25])  # the last line loses its end, as after a power cut
    with FaultServer() as srv:
        rc, out = run_generate(tmp_path, srv.url, capsys=capsys)
    g = out["generate"]
    assert rc == 0 and g["torn_lines_dropped"] == 1 and g["turns_ok"] == 1
    assert all(line.endswith(b"}") for line in shard.read_bytes().splitlines())
    keys = Counter((r["id"], r["turn"]) for r in read_records(tmp_path / "generate" / "shards"))
    assert max(keys.values()) == 1 and len(keys) == g["turns_total"]
    assert [r["messages"] for r in read_out(tmp_path)] == [expected_conversation(c) for c in convs]


def test_journal_refuses_duplicates_and_rotates(tmp_path):
    j = Journal(tmp_path, shard_size=3)
    assert j.open() == []
    for i in range(7):
        j.append({"id": "a", "turn": i, "content": "x"})
    with pytest.raises(ValueError):
        j.append({"id": "a", "turn": 2, "content": "again"})
    j.close()
    assert [len(p.read_text().splitlines()) for p in sorted(tmp_path.glob("part-*.jsonl"))] == [3, 3, 1]
    j2 = Journal(tmp_path, shard_size=3)
    assert len(j2.open()) == 7
    j2.append({"id": "b", "turn": 0, "content": "y"})
    j2.close()
    assert len(list(read_records(tmp_path))) == 8 and len(list(tmp_path.glob("part-*.jsonl"))) == 3


@pytest.mark.parametrize("on_length", ["keep", "flag", "drop"])
def test_on_length_and_reasoning(tmp_path, capsys, on_length):
    convs = write_prepared(tmp_path, n=20)
    with FaultServer(Faults(length_rate=0.3, reasoning=True)) as srv:
        rc, out = run_generate(tmp_path, srv.url, f"generate.on_length={on_length}", capsys=capsys)
    g = out["generate"]
    assert rc == 0
    check_accounting(g, len(convs))
    rows = read_out(tmp_path)
    lengths = [r for r in rows if "length" in r["meta"]["finish_reasons"]]
    if on_length == "drop":
        assert not lengths and g["conversations_dropped_length"] > 0
        # every turn not attempted follows a cut one in a dropped conversation (at most 3 turns each),
        # and the server saw exactly the attempted turns
        assert g["turns_not_attempted"] <= 2 * g["conversations_dropped_length"]
        assert srv.stats["requests"] == g["turns_total"] - g["turns_not_attempted"] + g["turns_retried"]
        assert len(rows) == len(convs) - g["conversations_dropped_length"]
    else:
        assert lengths and len(rows) == len(convs)
        for r in rows:
            flagged = [f"length:turn{t}" for t, f in enumerate(r["meta"]["finish_reasons"]) if f == "length"]
            assert r["meta"]["flags"] == (flagged if on_length == "flag" else [])
    for r in rows:  # reasoning: keep -> a think block before the content, raw text in meta
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        for a, reasoning in zip(answers, r["meta"]["reasoning"]):
            assert reasoning.startswith("thinking ") and a.startswith(f"<think>\n{reasoning}\n</think>\n\n")


def test_reasoning_drop_and_settings_change_refused(tmp_path, capsys):
    write_prepared(tmp_path, n=6)
    with FaultServer(Faults(reasoning=True)) as srv:
        assert run_generate(tmp_path, srv.url, "generate.reasoning=drop", capsys=capsys)[0] == 0
        rows = read_out(tmp_path)
        assert all("<think>" not in m["content"] for r in rows for m in r["messages"])
        assert all(x is None for r in rows for x in r["meta"]["reasoning"])
        rc, out = run_generate(tmp_path, srv.url, "generate.temperature=0.7", capsys=capsys)
    assert rc == 2 and "generate.temperature" in out["error"]


def test_missing_prepare_is_exit_3(tmp_path, capsys):
    rc, out = run_generate(tmp_path, "http://127.0.0.1:9/v1", capsys=capsys)
    assert rc == 3 and "dflashkit prepare" in out["hint"]


def test_bad_prepared_line_names_file_and_line(tmp_path, capsys):
    write_prepared(tmp_path, n=3)
    p = tmp_path / "prepare" / "train.jsonl"
    p.write_text(p.read_text() + '{"id": "x", "messages": [{"role": "robot", "content": "hi"}]}\n')
    rc, out = run_generate(tmp_path, "http://127.0.0.1:9/v1", capsys=capsys)
    assert rc == 2 and f"{p}:4" in out["error"]


def test_two_endpoints_balanced_and_retry_after_honoured(tmp_path, capsys):
    write_prepared(tmp_path, n=24, max_turns=1)
    with FaultServer(Faults(latency_s=(0.005, 0.01))) as a, FaultServer(Faults(latency_s=(0.005, 0.01))) as b:
        rc, out = run_generate(tmp_path, [a.url, b.url], capsys=capsys)
        assert rc == 0 and a.stats["requests"] > 4 and b.stats["requests"] > 4
        assert a.stats["requests"] + b.stats["requests"] == 24
    import asyncio

    from dflashkit.generate.openai_client import OpenAIClient

    async def one(url: str) -> float:
        async with OpenAIClient([url], backoff_s=0.001, max_retries=2) as c:
            t0 = time.monotonic()
            r = await c.chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.attempts == 2 and r.retry_reasons == ["http 429"]
            return time.monotonic() - t0

    with FaultServer(Faults(rates={"429": 1.0}, max_faults_per_key=1, retry_after="0.4")) as srv:
        assert asyncio.run(one(srv.url)) >= 0.4


def test_api_key_sent_but_never_logged(tmp_path, capsys, monkeypatch, caplog):
    write_prepared(tmp_path, n=3)
    secret = "sk-test-very-secret-123"
    monkeypatch.setenv("DFK_TEST_KEY", secret)
    with FaultServer(Faults(rates={"500": 0.5}, seed=1)) as srv:
        with caplog.at_level(logging.DEBUG, logger="dflashkit"):
            rc, _ = run_generate(tmp_path, srv.url, "server.api_key_env=DFK_TEST_KEY", "--log-level", "debug")
    assert rc == 0 and srv.auth_seen == {f"Bearer {secret}"}
    captured = capsys.readouterr()
    assert "retry" in caplog.text  # debug logging was on and did log the retries
    assert secret not in caplog.text + captured.err + captured.out
    assert secret not in "".join(p.read_text() for p in (tmp_path / "generate").rglob("*.json*"))


def test_strict_server_without_token_ids(tmp_path, capsys):
    convs = write_prepared(tmp_path, n=10)
    with FaultServer(Faults(reject_token_ids=True)) as srv:
        rc, out = run_generate(tmp_path, srv.url, capsys=capsys)
        assert srv.stats["rejected_token_ids"] >= 1
    assert rc == 0 and out["generate"]["turns_failed"] == 0
    rows = read_out(tmp_path)
    assert [r["messages"] for r in rows] == [expected_conversation(c) for c in convs]
    assert all(r["meta"]["token_ids"] is None for r in rows)


def test_original_answer_sources_are_not_regenerated(tmp_path, capsys):
    run_dir = tmp_path / "run"
    convs = write_prepared(run_dir, n=12, max_turns=1)
    raw_ids = {c["id"] for c in convs[::3]}
    for c in convs:
        c["source"] = "raw" if c["id"] in raw_ids else "chat"
    (run_dir / "prepare" / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    sources = '[{path: raw.jsonl, name: raw, answers: original}, {path: chat.jsonl, name: chat}]'
    with FaultServer(Faults(seed=1)) as srv:
        rc, g = run_generate(run_dir, srv.url, f"data.sources={sources}", capsys=capsys)
    assert rc == 0, g
    out = read_out(run_dir)
    assert {o["id"] for o in out} == {c["id"] for c in convs} - raw_ids
    assert g["generate"]["turns_total"] == len(convs) - len(raw_ids)
