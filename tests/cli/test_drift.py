"""Drift from the server is caught: `generate` → `tokenize` against our own `serve` (tiny Qwen3, fp32),
faithful, with a different chat template (a default system prompt the target's lacks), and with a
server-side repetition penalty; plus the pieces (neutral fields dropped on 400, the teacher-forced
check against a one-sequence-at-a-time oracle, "not checked" instead of "0/0")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflashkit.cli import main
from dflashkit.data.drift import answer_line, compare_prompt, prompt_line
from dflashkit.testing.faults import FaultServer, Faults
from dflashkit.generate.preflight import NEUTRAL_SAMPLING
from dflashkit.target.tiny import CHATML_TEMPLATE
from tests.harness.servers import penalty_serving, serving

SYSTEM = "You are a helpful AI assistant named Tiny."
# A generic server-side template that inserts a default system prompt the target's template lacks.
DRIFTED_TEMPLATE = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n" + SYSTEM
                    + "<|im_end|>\n' }}{% endif %}" + CHATML_TEMPLATE)
CONVS = [
    {"id": f"{i:016x}", "source": "chat" if i % 2 else "code",
     "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "old"}]}
    for i, q in enumerate(["hello there", "what is two plus two", "write a poem", "list three colours",
                           "say something", "count to five"])
] + [{"id": "f" * 16, "source": "multi", "messages": [
    {"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
    {"role": "user", "content": "second"}, {"role": "assistant", "content": "y"}]}]
# Agreement is asserted on single-turn data: the random byte-level model emits invalid UTF-8, so a
# turn-2 prompt holds the lossy text of answer 1 while the sample holds answer 1's real ids (the
# check rightly flags that pairing: ~75% on the two-turn conversation).
SINGLE = CONVS[:6]
MAX_TOKENS = 24


def write_prepared(run_dir, convs=CONVS):
    (run_dir / "prepare").mkdir(parents=True, exist_ok=True)
    (run_dir / "prepare" / "train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))


def generate(run_dir, url, target, capsys, *extra):
    rc = main(["generate", f"run.run_dir={run_dir}", f"server.urls=[{url}]", f"target.path={target}",
               f"generate.max_tokens={MAX_TOKENS}", "generate.concurrency=4", "generate.progress=false",
               *extra, "--json"])
    cap = capsys.readouterr()
    return rc, cap


def tokenize(run_dir, target, capsys, *extra):
    rc = main(["tokenize", f"run.run_dir={run_dir}", f"target.path={target}", "drafter.block_size=2",
               "tokenize.min_supervised=1", *extra])
    cap = capsys.readouterr()
    stats = json.loads((run_dir / "tokenize" / "stats.json").read_text()) if rc == 0 else None
    return rc, cap, stats


@pytest.fixture(scope="module")
def drifted_template(tmp_path_factory):
    p = tmp_path_factory.mktemp("tpl") / "drifted.jinja"
    p.write_text(DRIFTED_TEMPLATE)
    return p


@pytest.fixture(scope="module")
def faithful(tiny_qwen3):
    with serving({"target": {"path": str(tiny_qwen3)}, "serve": {"batch_wait_ms": 5}}) as app_url:
        yield app_url


@pytest.fixture(scope="module")
def drifted(tiny_qwen3, drifted_template):
    cfg = {"target": {"path": str(tiny_qwen3), "chat_template": str(drifted_template)},
           "serve": {"batch_wait_ms": 5}}
    with serving(cfg) as app_url:
        yield app_url


def system_block_tokens(tok) -> int:
    return len(tok.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", add_special_tokens=False))


def test_faithful_server_passes_with_full_agreement(tmp_path, faithful, tiny_qwen3, capsys):
    app, url = faithful
    write_prepared(tmp_path, SINGLE)
    rc, cap = generate(tmp_path, url, tiny_qwen3, capsys)
    assert rc == 0, cap.err
    manifest = json.loads((tmp_path / "generate" / "manifest.json").read_text())
    assert manifest["preflight"]["status"] == "ok" and manifest["preflight"]["ids_equal"] is True, manifest
    assert manifest["fields_refused"] == [] and manifest["request_token_ids"] is True
    rc, cap, stats = tokenize(tmp_path, tiny_qwen3, capsys)
    assert rc == 0, cap.err
    turns = len(SINGLE)
    p = stats["prompt_check"]
    assert (p["turns"], p["checked"], p["mismatches"], p["ids_checked"]) == (turns, turns, 0, turns), p
    assert stats["server_token_check"]["server_turns"] == turns
    tf = stats["teacher_forced"]
    assert tf["status"] == "checked" and tf["dtype"] == "float32"
    assert set(tf["sources"]) == {"chat", "code"}
    for name, r in tf["sources"].items():
        assert r["judged"] and r["labels"] > 0 and r["agreement"] >= 0.99, (name, r)
    assert f"prompt tokens: 0/{turns} server prompts differ" in cap.out
    assert "answer token ids: " in cap.out and "not checked" not in cap.out


def test_drifted_template_fails_preflight_and_tokenize(tmp_path, drifted, tiny_qwen3, capsys):
    app, url = drifted
    extra = system_block_tokens(app.tok)
    write_prepared(tmp_path)
    rc, cap = generate(tmp_path, url, tiny_qwen3, capsys)
    assert rc == 2, cap.err
    assert "pre-flight" in cap.err and f"(+{extra})" in cap.err and "generate.endpoint=completions" in cap.err
    assert not (tmp_path / "generate" / "conversations.jsonl").exists()
    rc, cap = generate(tmp_path, url, tiny_qwen3, capsys, "generate.preflight=warn")
    assert rc == 0, cap.err
    rc, cap, _ = tokenize(tmp_path, tiny_qwen3, capsys)
    assert rc == 2, cap.err
    assert f"prompt tokens: 8/8 server prompts differ from the local rendering (server − local: +{extra} on 8)" \
        in cap.err, cap.err
    assert "teacher-forced agreement" in cap.err and "< tokenize.min_agreement 0.9" in cap.err
    assert not list((tmp_path / "tokenize").glob("shard-*.parquet"))
    # report only: the numbers are kept, the run passes
    rc, cap, stats = tokenize(tmp_path, tiny_qwen3, capsys, "tokenize.max_prompt_mismatch=1",
                              "tokenize.min_agreement=0")
    assert rc == 0, cap.err
    assert stats["prompt_check"]["delta_counts"] == {str(extra): 8}
    first = stats["prompt_check"]["first_mismatch"]
    assert first["first_diff_token"] == 1 and first["server"].startswith("<|im_start|>system\n")
    for r in stats["teacher_forced"]["sources"].values():
        assert r["judged"] and r["agreement"] < 0.9, r  # answers to another prompt are not the target's


def test_completions_endpoint_takes_the_server_template_out(tmp_path, drifted, tiny_qwen3, capsys):
    app, url = drifted
    write_prepared(tmp_path, SINGLE)
    rc, cap = generate(tmp_path, url, tiny_qwen3, capsys, "generate.endpoint=completions")
    assert rc == 0, cap.err
    manifest = json.loads((tmp_path / "generate" / "manifest.json").read_text())
    assert manifest["preflight"]["status"] == "ok" and manifest["preflight"]["ids_equal"] is True
    rc, cap, stats = tokenize(tmp_path, tiny_qwen3, capsys)
    assert rc == 0, cap.err
    assert stats["prompt_check"]["mismatches"] == 0 and stats["prompt_check"]["checked"] == len(SINGLE)
    for r in stats["teacher_forced"]["sources"].values():
        assert r["agreement"] >= 0.99, r


def test_doctor_preflight_names_the_drift(tmp_path, faithful, drifted, tiny_qwen3, capsys):
    good, bad = faithful[1], drifted[1]
    rc = main(["doctor", f"server.urls=[{good},{bad}]", f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path),
               "--json"])
    assert rc == 1  # a drifted endpoint makes doctor unhealthy (exit 1)
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    checks = {c["name"]: c for c in res["checks"]}
    assert checks[f"drift {good}"]["status"] == "ok" and "ids equal" in checks[f"drift {good}"]["detail"]
    bad_check = checks[f"drift {bad}"]
    assert bad_check["status"] == "error" and f"(+{system_block_tokens(drifted[0].tok)})" in bad_check["detail"]
    assert f"drift {bad}" in res["problems"]


@pytest.fixture(scope="module")
def penalised(tiny_qwen3):
    with penalty_serving(tiny_qwen3, default_penalty=2.0) as app_url:
        yield app_url


@pytest.mark.parametrize("neutral", [True, False])
def test_server_repetition_penalty_default(tmp_path, penalised, tiny_qwen3, capsys, neutral):
    _, url = penalised
    write_prepared(tmp_path, SINGLE)
    rc, cap = generate(tmp_path, url, tiny_qwen3, capsys, f"generate.neutral_sampling={str(neutral).lower()}")
    assert rc == 0, cap.err  # same template: the pre-flight cannot see a sampling default
    rc, cap, stats = tokenize(tmp_path, tiny_qwen3, capsys)
    if neutral:  # repetition_penalty 1 was sent and honoured
        assert rc == 0, cap.err
        for r in stats["teacher_forced"]["sources"].values():
            assert r["agreement"] >= 0.99, r
    else:
        assert rc == 2, cap.err
        assert "teacher-forced agreement" in cap.err and "< tokenize.min_agreement 0.9" in cap.err, cap.err
        print("penalty drift:", [line for line in cap.err.splitlines() if "agreement" in line])


def test_rejected_neutral_fields_are_dropped_once(tmp_path, capsys):
    write_prepared(tmp_path)
    refused = ("repetition_penalty", "repeat_penalty", "min_p", "top_k")
    with FaultServer(Faults(reject_fields=refused)) as srv:
        rc = main(["generate", f"run.run_dir={tmp_path}", f"server.urls=[{srv.url}]", "generate.max_tokens=8",
                   "generate.concurrency=1", "generate.progress=false", "--json"])
        rejected = srv.stats["rejected_fields"]
    err = capsys.readouterr().err
    assert rc == 0, err
    manifest = json.loads((tmp_path / "generate" / "manifest.json").read_text())
    assert manifest["fields_refused"] == sorted(refused) and manifest["counts"]["turns_failed"] == 0
    assert manifest["preflight"]["status"] == "skipped"  # no target.path: nothing to render locally
    assert rejected == len(refused)  # one 400 per field, then never sent again
    assert all(err.count(f"the server refuses {k} ") == 1 for k in refused), err
    assert set(refused) <= set(NEUTRAL_SAMPLING)


def test_label_agreement_matches_one_at_a_time_oracle(tiny_qwen3):
    import torch

    from dflashkit.config import TargetSection
    from dflashkit.data.agreement import label_agreement
    from dflashkit.target.load import load_target

    target = load_target(TargetSection(path=str(tiny_qwen3)), with_tokenizer=False)
    rng = np.random.default_rng(0)
    seqs = []
    for n in (5, 17, 9, 33, 2):
        ids = rng.integers(0, 259, n).astype(np.int32)
        mask = (rng.random(n) < 0.6).astype(np.int8)
        seqs.append((ids, mask))
    # one greedy continuation makes some labels the argmax for sure
    with torch.no_grad():
        prompt = torch.tensor([[1, 2, 3]])
        out = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                    do_sample=False, pad_token_id=0)
    seqs.append((out[0].numpy().astype(np.int32), np.array([0, 0, 0] + [1] * 6, dtype=np.int8)))
    agree = total = 0
    with torch.no_grad():
        for ids, mask in seqs:
            logits = target.model(torch.tensor(ids[None], dtype=torch.long)).logits[0]
            for t in range(1, len(ids)):
                if mask[t]:
                    total += 1
                    agree += int(logits[t - 1].argmax()) == int(ids[t])
    got = label_agreement(target.model, seqs, device=target.device, batch_tokens=40)
    assert got == (agree, total) and agree >= 6


def test_not_checked_is_not_zero_of_zero(tmp_path, tiny_qwen3, capsys):
    rows = [{"id": c["id"], "source": c["source"], "messages": c["messages"],
             "meta": {"finish_reasons": ["stop"] * 2, "token_ids": None}} for c in CONVS[:3]]
    (tmp_path / "generate").mkdir(parents=True)
    (tmp_path / "generate" / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "generate" / "manifest.json").write_text(json.dumps({"request_token_ids": True}))
    rc, cap, stats = tokenize(tmp_path, tiny_qwen3, capsys, "tokenize.agreement_samples=0")
    assert rc == 0, cap.err
    assert "answer token ids: not checked (asked for, none returned by the server on 3 turns)" in cap.out
    assert "prompt tokens: not checked (3 turns without usage.prompt_tokens" in cap.out
    assert "0/0" not in cap.out
    assert stats["teacher_forced"] == {"status": "off"}
    assert answer_line(0, 0, 0, False).endswith("(generate.request_token_ids was off)")


def test_compare_prompt_lengths_and_ids():
    assert not compare_prompt([1, 2, 3], server_tokens=3, server_ids=None).differs
    c = compare_prompt([1, 2, 3], server_tokens=5, server_ids=None)
    assert c.differs and c.delta == 2 and c.ids_equal is None
    c = compare_prompt([1, 2, 3], server_tokens=3, server_ids=[1, 9, 3])
    assert c.differs and c.delta == 0 and c.ids_equal is False and c.first_diff == 1
    c = compare_prompt([1, 2, 3], server_tokens=None, server_ids=None)
    assert not c.checked and not c.differs
    assert prompt_line({"turns": 0, "checked": 0}) == "prompt tokens: not checked (no regenerated turns)"


def test_journal_from_before_the_new_settings_resumes(tmp_path, capsys):
    """Changing neutral_sampling with a journal whose settings.json records it is refused; an older
    settings.json without the key is not a settings change."""
    write_prepared(tmp_path)
    with FaultServer(Faults()) as srv:
        args = ["generate", f"run.run_dir={tmp_path}", f"server.urls=[{srv.url}]", "generate.max_tokens=8",
                "generate.progress=false", "generate.neutral_sampling=false", "--json"]
        assert main(args[:-2] + ["--json"]) == 0
        assert main(args) == 2
        assert "generate.neutral_sampling: True in the existing journal" in capsys.readouterr().err
        settings = tmp_path / "generate" / "settings.json"
        old = {k: v for k, v in json.loads(settings.read_text()).items() if k not in ("endpoint", "neutral_sampling")}
        settings.write_text(json.dumps(old))
        assert main(args) == 0
