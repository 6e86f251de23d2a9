"""End to end: `generate` against a real `dflashkit serve` (tiny Qwen3) over HTTP on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from dflashkit.decode.api import SamplingParams
from dflashkit.generate.conversations import build_prompt, plan_turns
from tests.harness.servers import serving

CONVS = [
    {"id": "a" * 16, "source": "t", "messages": [{"role": "user", "content": "hello"},
                                                 {"role": "assistant", "content": "dataset answer"}]},
    {"id": "b" * 16, "source": "t", "messages": [{"role": "system", "content": "terse"},
                                                 {"role": "user", "content": "first question"},
                                                 {"role": "assistant", "content": "old 1"},
                                                 {"role": "user", "content": "second question"},
                                                 {"role": "assistant", "content": "old 2"}]},
    {"id": "c" * 16, "source": "t", "messages": [{"role": "user", "content": "just a prompt"}]},
    {"id": "d" * 16, "source": "t", "messages": [{"role": "user", "content": "q1"},
                                                 {"role": "assistant", "content": "a1"},
                                                 {"role": "user", "content": "q2"},
                                                 {"role": "assistant", "content": "a2"},
                                                 {"role": "user", "content": "q3"}]},
]
MAX_TOKENS = 12


def write_prepared(run_dir, convs=CONVS):
    (run_dir / "prepare").mkdir(parents=True, exist_ok=True)
    (run_dir / "prepare" / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))


def greedy_reference(app, conv) -> tuple[list[dict], list[list[int]]]:
    """What the model itself answers, turn by turn, feeding its own previous answers."""
    tok = app.tok
    turns = plan_turns(conv["messages"])
    answers, ids = [], []
    for t in range(len(turns)):
        prompt = build_prompt(conv["messages"], turns, answers, t)
        text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        out = app.engine.generate(tok.encode(text, add_special_tokens=False),
                                  SamplingParams(max_new_tokens=MAX_TOKENS, stop_token_ids=(tok.eos_token_id,)))
        ids.append(out.token_ids)
        answers.append(tok.decode(out.token_ids, skip_special_tokens=True))
    return build_prompt(conv["messages"], turns + [len(conv["messages"])], answers + [""], len(turns)), ids


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    with serving({"target": {"path": str(tiny_qwen3)}, "serve": {"batch_wait_ms": 20}}) as app_url:
        yield app_url


def test_generate_against_serve_equals_greedy(tmp_path, served, capsys):
    app, url = served
    write_prepared(tmp_path)
    rc = main(["generate", f"run.run_dir={tmp_path}", f"server.urls=[{url}]", f"generate.max_tokens={MAX_TOKENS}",
               "generate.concurrency=4", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    rows = [json.loads(x) for x in (tmp_path / "generate" / "conversations.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [c["id"] for c in CONVS]
    for conv, row in zip(CONVS, rows):
        messages, ids = greedy_reference(app, conv)
        assert row["messages"] == messages
        assert row["meta"]["token_ids"] == ids
        assert all(m["content"] not in ("dataset answer", "old 1", "old 2", "a1", "a2")
                   for m in row["messages"] if m["role"] == "assistant")
        assert len(row["meta"]["finish_reasons"]) == len(plan_turns(conv["messages"]))
    manifest = json.loads((tmp_path / "generate" / "manifest.json").read_text())
    assert manifest["counts"]["conversations_written"] == len(CONVS)
    assert manifest["server_urls"] == [url] and manifest["model"] == app.model_name
    assert manifest["chat_template_sha256"] == app.template_sha256 and len(app.template_sha256) == 64


def test_generate_starts_a_local_server(tmp_path, tiny_qwen3, capsys):
    """server.urls empty: `dflashkit serve` runs as a subprocess for target.path and is stopped after."""
    write_prepared(tmp_path, CONVS[:2])
    rc = main(["generate", f"run.run_dir={tmp_path}", f"target.path={tiny_qwen3}", "generate.max_tokens=6",
               "generate.progress=false", "serve.cpu_threads=1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    assert out["generate"]["conversations_written"] == 2
    log = (tmp_path / "generate" / "serve.log").read_text()
    assert "serving" in log and "server stopped" in log  # started, then shut down cleanly
