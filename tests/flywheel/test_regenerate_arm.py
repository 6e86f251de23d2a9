"""`learn.compare_regenerate`: a round on a tiny target also trains the regenerate arm — the window's training
prompts answered again offline, within half the round's CPU budget, then a fine-tune for the rest — on training
prompts only, at the candidate's CPU budget, reproducing the recorded greedy replies; a failing arm is recorded and
the round goes on. The CPU clock is a counter (one tick a reading), so nothing here depends on the machine's speed."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import load_config
from dflashkit.decode.api import SamplingParams, default_stop_ids
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.flywheel.traffic import run_fingerprint
from dflashkit.target.load import load_target
from tests.flywheel.test_learn import _learn, _write
from tests.helpers import TEXTS, make_run, overrides


def _greedy_records(tiny, run_dir, n, *, max_tokens=6):
    """Chat records as `serve` would write them for the tiny target's greedy replies: the prompt rendered by the
    tokenizer's own chat template, the reply decoded greedily, its ids (stop token included) recorded."""
    cfg = load_config(None, [f"target.path={tiny}", f"run.run_dir={run_dir}"])
    target = load_target(cfg.target, device="cpu")
    tok, dec, stops = target.tokenizer, SpecDecoder(target, None, 1), default_stop_ids(target)
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"{TEXTS[i % len(TEXTS)][0]} ({i})"}]
        prompt = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
        ids = list(dec.generate(prompt, SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stops)).token_ids)
        text = tok.decode(ids[:-1] if ids[-1] in stops else ids, skip_special_tokens=True)
        rows.append({"id": f"req{i:04d}", "v": 1, "time": 1000.0 + i, "endpoint": "chat",
                     "messages": msgs + [{"role": "assistant", "content": text}], "completion_token_ids": ids,
                     "sampling": {"max_tokens": max_tokens}, "finish_reason": "stop",
                     "target": {"fingerprint": run_fingerprint(cfg), "how": "files"}})
    return rows


@pytest.fixture()
def ticking_cpu(monkeypatch):
    """`time.process_time` as a counter (+1 s a reading) and one torch thread (the round's CPU budget is
    minutes × 60 × learn.train_fraction × threads)."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(time, "process_time", lambda: float(next(ticks)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_regenerate_arm_trains_on_regenerated_training_prompts_within_the_budget(tmp_path, tiny_qwen3, capsys,
                                                                                      ticking_cpu, monkeypatch):
    run_dir = make_run(tmp_path / "run", tiny_qwen3)
    assert main(["train", "--json", *overrides(run_dir, tiny_qwen3, train__max_steps=2)]) == 0
    capsys.readouterr()
    rec = tmp_path / "rec"
    rows = _greedy_records(tiny_qwen3, run_dir, 16)
    _write(rec / "records-00000001.jsonl", rows[:12])
    # 0.5 min × 60 × 0.5 × 1 thread = 15 CPU-s (ticks): the candidate trains 15 one-tick steps
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.compare_regenerate=true", "learn.min_gain=100",
                          "run.budget_minutes=0.5", "learn.train_fraction=0.5", "learn.max_steps=40",
                          "tokenize.min_supervised=1")
    assert rc == 0, err[-3000:]
    r1 = json.loads((run_dir / "learn" / "rounds" / "001" / "round.json").read_text())
    arm = r1["regenerate_arm"]
    assert "error" not in arm, arm
    budget = 0.5 * 60 * 0.5 * 1
    assert arm["basis"] == "cpu" and arm["budget_cpu_s"] == budget and r1["train"]["steps"] == 15
    # regeneration stopped at the first prompt that reached half the budget, oldest prompts first
    done, avail = arm["prompts"]["regenerated"], arm["prompts"]["available"]
    assert avail == len(r1["ids"]["train"]) == 10 and 1 <= done < avail, arm["prompts"]
    assert budget / 2 <= arm["regen_cpu_s"] < budget / 2 + arm["regen_cpu_s"] / done
    # the rest of the budget trained the arm: regeneration + training CPU within the candidate's budget
    assert arm["steps"] >= 1 and arm["train_budget_cpu_s"] == budget - arm["regen_cpu_s"]
    assert arm["regen_cpu_s"] + arm["train_cpu_s"] == arm["total_cpu_s"] <= budget
    # only regenerated training prompts trained it: the oldest `done` of the window, never a held-out one
    assert sorted(arm["ids"]["train"]) == sorted(r1["ids"]["train"])[:done]
    assert not set(arm["ids"]["train"]) & set(r1["ids"]["heldout"])
    # the recording is the same target's greedy output: every regenerated reply equals it token for token
    assert arm["replies"] == {"compared": done, "equal": done}
    # scored on the round's slice by the same paired bootstrap; it never promotes
    c = arm["candidate_vs_regenerate"]
    assert len(arm["scores"]) == c["samples"] == len(r1["ids"]["heldout"]) == 2
    assert 1 <= arm["tau"] == c["tau_regenerate"] <= 4 and c["tau_candidate"] == r1["comparison"]["tau_new"]
    assert set(c["by_source"]) == {"chat"} and c["by_source"]["chat"]["gain"] == c["gain"]
    assert r1["decision"] == "keep" and not (run_dir / "learn" / "promoted.json").exists()
    row = out["rounds"][0]["regenerate_arm"]  # `dflashkit learn`'s result: the arm without per-sample data
    assert row["candidate_vs_regenerate"] == c and not {"scores", "ids"} & set(row)

    # a failing arm is recorded; the round is kept and the cursor moves on
    def broken(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr("dflashkit.flywheel.rounds.run_arm", broken)
    _write(rec / "records-00000001.jsonl", rows[12:])
    rc, _, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.compare_regenerate=true", "learn.min_gain=100",
                        "learn.max_steps=1", "tokenize.min_supervised=1")
    assert rc == 0, err[-3000:]
    r2 = json.loads((run_dir / "learn" / "rounds" / "002" / "round.json").read_text())
    assert r2["regenerate_arm"] == {"error": "RuntimeError: planted"} and "planted" in err
    cursor = json.loads((run_dir / "learn" / "cursor.json").read_text())
    assert cursor["round"] == 2 and cursor["segments"] == {"records-00000001.jsonl": 16}


def test_an_epoch_capped_candidate_gives_the_arm_only_the_cpu_it_used(tmp_path, tiny_qwen3, capsys, ticking_cpu):
    """learn.max_epochs stops the candidate before the budget: equal CPU is then what it used, not the budget."""
    run_dir = make_run(tmp_path / "run", tiny_qwen3)
    assert main(["train", "--json", *overrides(run_dir, tiny_qwen3, train__max_steps=2)]) == 0
    capsys.readouterr()
    rec = tmp_path / "rec"
    _write(rec / "records-00000001.jsonl", _greedy_records(tiny_qwen3, run_dir, 12))
    # 10 training samples, batch 2, 1 pass: 5 one-tick steps of the 15 CPU-s budget
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.compare_regenerate=true", "learn.min_gain=100",
                          "run.budget_minutes=0.5", "learn.train_fraction=0.5", "learn.max_steps=40",
                          "learn.max_epochs=1", "tokenize.min_supervised=1")
    assert rc == 0, err[-3000:]
    r1 = json.loads((run_dir / "learn" / "rounds" / "001" / "round.json").read_text())
    arm = r1["regenerate_arm"]
    assert "error" not in arm and r1["train"]["steps"] == r1["steps"] == 5, (arm, r1["train"])
    assert arm["budget_cpu_s"] == arm["candidate_train_cpu_s"] < 0.5 * 60 * 0.5
    assert arm["total_cpu_s"] <= arm["budget_cpu_s"]
