"""`dflashkit tokenize` end to end on a tiny real target (byte tokenizer, ChatML template):
shard schema, masks, drop/refuse rules, server-token checks, atomic re-runs, the bench."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from dflashkit.cli import main
from dflashkit.data.records import Conversation, write_jsonl
from tests.helpers import tokenized_rows

ANSWERS = ["The capital of France is Paris, of course.", "Berlin is the capital of Germany, friend.",
           "Rome has been the capital of Italy since 1871."]


def convs(answers=ANSWERS, meta=None):
    out = []
    for i, a in enumerate(answers):
        c = Conversation.from_messages("t", [{"role": "user", "content": f"Question {i}?"},
                                             {"role": "assistant", "content": a}])
        c.meta = dict(meta or {})
        out.append(c.to_dict())
    return out


def setup(tmp_path, target, rows, where="generate/conversations.jsonl", **tok):
    run_dir = tmp_path / "run"
    if rows is not None:
        write_jsonl(run_dir / where, rows)
    cfg = {"run": {"run_dir": str(run_dir)}, "target": {"path": str(target)}, "drafter": {"block_size": 4},
           "tokenize": tok}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return run_dir


def tokenize(tmp_path, capsys, *extra):
    code = main(["tokenize", "-c", str(tmp_path / "run.yaml"), "--json", *extra])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def supervised_text(tok, row):
    return tok.decode(row["input_ids"][row["loss_mask"] == 1].tolist())


@pytest.fixture(scope="module")
def tok(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def test_tokenize_generate_output(tmp_path, capsys, tiny_qwen3, tok):
    run_dir = setup(tmp_path, tiny_qwen3, convs(), shard_size=2)
    code, out = tokenize(tmp_path, capsys)
    assert code == 0 and out["samples"] == 3 and out["shards"] == 2
    shards = sorted((run_dir / "tokenize").glob("shard-*.parquet"))
    assert [p.name for p in shards] == ["shard-00000.parquet", "shard-00001.parquet"]
    schema = pq.read_schema(shards[0])
    assert [str(schema.field(n).type) for n in ("id", "input_ids", "loss_mask")] == \
        ["string", "list<element: int32>", "list<element: int8>"]
    rows = tokenized_rows(run_dir)
    assert [r["id"] for r in rows] == [c["id"] for c in convs()]
    for r, answer in zip(rows, ANSWERS):
        assert supervised_text(tok, r) == answer + "<|im_end|>"
        assert tok.decode(r["input_ids"].tolist()).endswith("<|im_start|>assistant\n" + answer + "<|im_end|>")
    stats = json.loads((run_dir / "tokenize/stats.json").read_text())
    assert [s["samples"] for s in stats["shards"]] == [2, 1]
    assert stats["supervised"] == sum(int(r["loss_mask"].sum()) for r in rows)
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert (run_dir / "tokenize/manifest.json").is_file()


def test_missing_input_names_the_stage(tmp_path, capsys, tiny_qwen3):
    setup(tmp_path, tiny_qwen3, None)
    code, out = tokenize(tmp_path, capsys)
    assert code == 3 and "dflashkit generate" in out["hint"]
    code, out = tokenize(tmp_path, capsys, "tokenize.source=prepare")
    assert code == 3 and "dflashkit prepare" in out["hint"]


def test_source_prepare_and_min_supervised(tmp_path, capsys, tiny_qwen3, tok):
    rows = convs(ANSWERS + ["ok"]) + [Conversation.from_messages("t", [{"role": "user", "content": "hi"}]).to_dict()]
    setup(tmp_path, tiny_qwen3, rows, where="prepare/train.jsonl", source="prepare")
    code, out = tokenize(tmp_path, capsys)
    # "ok<|im_end|>" is 3 tokens < 2·block_size = 8; the prompt-only conversation has no answer
    assert code == 0 and out["samples"] == 3
    assert out["dropped"] == {"no_assistant_turn": 1, "no_aligned_turn": 0, "template_error": 0,
                              "too_few_supervised": 1}
    code, out = tokenize(tmp_path, capsys, "tokenize.min_supervised=2")
    assert out["samples"] == 4
    code, out = tokenize(tmp_path, capsys, "tokenize.max_length=24")  # cuts every answer away
    assert code == 2 and "4 samples were cut at tokenize.max_length=24" in out["error"]


def test_refuses_all_zero_and_all_one_masks(tmp_path, capsys, tiny_qwen3):
    prompts_only = [Conversation.from_messages("t", [{"role": "user", "content": f"q{i}"}]).to_dict()
                    for i in range(3)]
    setup(tmp_path, tiny_qwen3, prompts_only)
    code, out = tokenize(tmp_path, capsys)
    assert code == 2 and "all zero" in out["error"]
    tpl = tmp_path / "answers_only.jinja"
    tpl.write_text("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}<|im_end|>"
                   "{% endif %}{% endfor %}")
    setup(tmp_path, tiny_qwen3, convs())
    code, out = tokenize(tmp_path, capsys, f"target.chat_template={tpl}")
    assert code == 2 and "all one" in out["error"]
    assert not list((tmp_path / "run/tokenize").glob("shard-*"))


def test_template_errors_are_counted_and_named(tmp_path, capsys, tiny_qwen3):
    tpl = tmp_path / "strict.jinja"
    tpl.write_text("{% for m in messages %}{% if m.role == 'user' and 'boom' in m.content %}"
                   "{{ raise_exception('no boom allowed') }}{% endif %}"
                   "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    bad = Conversation.from_messages("t", [{"role": "user", "content": "boom"},
                                           {"role": "assistant", "content": ANSWERS[0]}]).to_dict()
    setup(tmp_path, tiny_qwen3, convs() + [bad])
    code, out = tokenize(tmp_path, capsys, f"target.chat_template={tpl}")
    assert code == 0 and out["samples"] == 3 and out["dropped"]["template_error"] == 1
    setup(tmp_path, tiny_qwen3, [bad])
    code, out = tokenize(tmp_path, capsys, f"target.chat_template={tpl}")
    assert code == 2 and "no boom allowed" in out["error"]


def test_server_token_mismatch_reported(tmp_path, capsys, tiny_qwen3, tok):
    rows = convs()
    rows[0]["meta"] = {"token_ids": [tok.encode(ANSWERS[0], add_special_tokens=False)]}
    rows[1]["meta"] = {"token_ids": [tok.encode("Berlin!", add_special_tokens=False) + [258]]}
    run_dir = setup(tmp_path, tiny_qwen3, rows)
    assert tokenize(tmp_path, capsys)[0] == 0
    check = json.loads((run_dir / "tokenize/stats.json").read_text())["server_token_check"]
    assert check["server_turns"] == 2 and check["server_mismatches"] == 1
    first = check["first_mismatch"]
    assert first["id"] == rows[1]["id"] and first["token"] == len("Berlin")  # byte tokens
    assert first["server"].startswith("rlin!") and first["ours"].startswith("rlin is")
    row = tokenized_rows(run_dir)[1]
    assert supervised_text(tok, row) == "Berlin!<|im_end|>"  # the server's tokens were used


def test_failed_rerun_keeps_shards_and_rerun_drops_stale(tmp_path, capsys, tiny_qwen3):
    run_dir = setup(tmp_path, tiny_qwen3, convs(), shard_size=1)
    assert tokenize(tmp_path, capsys)[0] == 0
    tdir = run_dir / "tokenize"
    before = {p.name: p.read_bytes() for p in tdir.iterdir()}
    assert len([n for n in before if n.startswith("shard-")]) == 3
    with open(run_dir / "generate/conversations.jsonl", "a") as fh:
        fh.write("{broken\n")
    code, out = tokenize(tmp_path, capsys)
    assert code == 2 and "conversations.jsonl:4" in out["error"]
    assert {p.name: p.read_bytes() for p in tdir.iterdir()} == before  # nothing lost, no staging left
    setup(tmp_path, tiny_qwen3, convs(), shard_size=10)
    assert tokenize(tmp_path, capsys)[0] == 0
    assert sorted(p.name for p in tdir.glob("shard-*")) == ["shard-00000.parquet"]
    assert len(tokenized_rows(tdir.parent)) == 3


def test_workers_give_identical_output(tmp_path, capsys, tiny_qwen3):
    rows = convs([f"{a} Variant {i}." for i in range(7) for a in ANSWERS])
    run_dir = setup(tmp_path, tiny_qwen3, rows, batch_size=4, shard_size=5)
    assert tokenize(tmp_path, capsys)[0] == 0
    one = [(r["id"], r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in tokenized_rows(run_dir)]
    stats1 = json.loads((run_dir / "tokenize/stats.json").read_text())
    code, out = tokenize(tmp_path, capsys, "tokenize.workers=2")
    assert code == 0 and out["samples"] == len(rows) == 21
    two = [(r["id"], r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in tokenized_rows(run_dir)]
    stats2 = json.loads((run_dir / "tokenize/stats.json").read_text())
    assert one == two and stats1["shards"] == stats2["shards"]


def test_a_worker_stuck_in_native_code_does_not_hang_the_stage(tmp_path, capsys, tiny_qwen3, monkeypatch):
    """One forked worker blocks forever in native code (a pthread mutex locked twice: no Python bytecode
    runs, so a Python SIGTERM handler inherited from the CLI never would); the other does every batch.
    The pool's closing terminate() must still end it: the stage returns with the same shards as one
    process. An alarm turns the former hang into a failure."""
    import ctypes
    import os
    import signal

    from dflashkit.data import tokenizing

    rows = convs([f"{a} Variant {i}." for i in range(3) for a in ANSWERS])
    run_dir = setup(tmp_path, tiny_qwen3, rows, batch_size=2, shard_size=4)
    assert tokenize(tmp_path, capsys, "tokenize.workers=1")[0] == 0
    one = [(r["id"], r["input_ids"].tolist()) for r in tokenized_rows(run_dir)]
    claim = tmp_path / "stuck-worker"
    init = tokenizing._init_worker

    def stuck_once(chat):
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL))  # the first worker only
        except FileExistsError:
            return init(chat)
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)
        libc.pthread_mutex_init(mutex, None)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # never returns

    hung = []

    def alarm(*_):
        import multiprocessing

        hung.append(True)
        for child in multiprocessing.active_children():  # end the hang (the test then fails below)
            child.kill()

    monkeypatch.setattr(tokenizing, "_init_worker", stuck_once)
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(120)
    try:
        code, out = tokenize(tmp_path, capsys, "tokenize.workers=2")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not hung, "tokenize hung on the stuck worker until the alarm killed it"
    assert claim.exists() and code == 0, out
    assert [(r["id"], r["input_ids"].tolist()) for r in tokenized_rows(run_dir)] == one


def test_bench_tokenize(tmp_path, capsys, tiny_qwen3):
    run_dir = setup(tmp_path, tiny_qwen3, convs(ANSWERS * 4))
    code = main(["bench", "tokenize", "-c", str(tmp_path / "run.yaml"), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["tokens"] == out["raw_tokens"] > 0
    assert out["identical_token_sequences"] == out["samples"] == 12
    assert out["ratio_full_vs_raw"] > 0 and Path(run_dir / "bench/tokenize.json").is_file()


def test_original_answer_sources_join_the_regenerated_ones_without_generate(tmp_path, capsys, tiny_qwen3, tok):
    """`answers: original` sources come from prepare as they are; the regenerated ones from generate;
    every shard row names its source; with only original sources generate is not needed at all."""
    from dflashkit.config import load_config
    from dflashkit.stages.pipeline import active_stages

    raw = [dict(c, source="raw") for c in convs(["Raw answer one, as a person wrote it.",
                                                  "Raw answer two, as a person wrote it."])]
    regen_prepared = [dict(c, source="chat") for c in convs(["to be regenerated " * 3])]
    run_dir = setup(tmp_path, tiny_qwen3, raw + regen_prepared, where="prepare/train.jsonl")
    cfg = yaml.safe_load((tmp_path / "run.yaml").read_text())
    cfg["data"] = {"sources": [{"path": "raw.jsonl", "name": "raw", "answers": "original"},
                               {"path": "chat.jsonl", "name": "chat"}]}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert "generate" in active_stages(load_config(tmp_path / "run.yaml"))
    code, out = tokenize(tmp_path, capsys)
    assert code == 3 and "generate" in out["hint"]  # the regenerated source's answers are missing
    regenerated = [dict(c, source="chat") for c in convs(["The target's own answer here, regenerated."])]
    write_jsonl(run_dir / "generate" / "conversations.jsonl", regenerated)
    code, out = tokenize(tmp_path, capsys)
    assert code == 0, out
    rows = tokenized_rows(run_dir)
    table = pq.read_table(sorted((run_dir / "tokenize").glob("shard-*.parquet"))[0])
    sources = table.column("source").to_pylist()
    texts = {s: [] for s in sources}
    for s, r in zip(sources, rows):
        texts[s].append(supervised_text(tok, r))
    assert sorted(sources) == ["chat", "raw", "raw"]
    assert any("regenerated" in t for t in texts["chat"]) and not any("to be regenerated" in t for t in texts["chat"])
    assert all("as a person wrote it" in t for t in texts["raw"])
    stats = json.loads((run_dir / "tokenize" / "stats.json").read_text())
    assert stats["by_source"]["raw"]["samples"] == 2 and stats["by_source"]["chat"]["samples"] == 1
    # every source original: generate drops out of `run`, tokenize needs no generate output
    cfg["data"]["sources"][1]["answers"] = "original"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert "generate" not in active_stages(load_config(tmp_path / "run.yaml"))
    (run_dir / "generate" / "conversations.jsonl").unlink()
    code, out = tokenize(tmp_path, capsys)
    assert code == 0 and out["samples"] == 3
